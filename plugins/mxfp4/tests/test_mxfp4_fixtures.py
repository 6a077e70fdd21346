"""gpt-oss MXFP4 (``quant_method: "mxfp4"``) checkpoints, written by ``make_mxfp4_fixtures.py`` in gpt-oss-20b's
layout and judged by transformers' own reader, ``Mxfp4Config(dequantize=True)``: its dequantized expert tensors
(sha256 of their float32 values, recorded in a venv of the same torch/transformers), the float32 logits and greedy
tokens of its dequantized model. The decoding is also checked against the MX rule written out below (code table
times ``2**(scale - 127)``), independently of transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant as sdk
from anyquant.errors import CheckpointError, ConfigError, FormatConflictError, NumericalError, UnsupportedFormatError
from anyquant.plugin import Probe
from anyquant_runtime.tensors import SafetensorsSource
from tests.peers.recorded import forward_logits, greedy_tokens, rel_error, sha256_f32

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAME = "gptoss_mxfp4"
EXPERTS = "model.layers.{}.mlp.experts"
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{NAME}.json").read_text())
    return data


def _lut_available() -> bool:
    from anyquant_cpu import kernels

    return kernels.lut_available()


needs_kernel = pytest.mark.skipif(not _lut_available(), reason="the compiled 4-bit table kernel is not built")
#: the backends that decode the experts to the model's dtype
EXACT = ("dequantized", "reference")


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    """One load per backend, shared by the tests that only read."""
    out = {b: sdk.load(FIXTURES / NAME, backend=b) for b in EXACT}
    if _lut_available():
        # the head kept dense, prompts in float32: the experts judged alone (the defaults: their own test)
        out["cpu-fast"] = sdk.load(
            FIXTURES / NAME, backend="cpu-fast", cpu_fast_head="dense", cpu_fast_prefill="float32"
        )
    return out


def _packed_parameter(model: Any, name: str) -> torch.Tensor:
    """cpu-fast's packed experts as transformers' parameter ``[E, in, out]``: each expert's exact weight."""
    experts = model.module.get_submodule(name.rpartition(".")[0])
    linears = experts.gate_up if name.endswith("gate_up_proj") else experts.down
    return torch.stack([m.dequantize().t() for m in linears])


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(FIXTURES / NAME, dst)
    return dst


def _rewrite(path: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(path / "model.safetensors")
    edit(t)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


def _config(path: Path, edit: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_detect() -> None:
    det = sdk.detect(FIXTURES / NAME)
    assert (det.format, det.variant, det.plugin) == ("mxfp4", "experts", "anyquant-mxfp4")
    assert det.details["tensors"] == 4 and det.details["experts"] == [4] and det.details["dtype"] == "bfloat16"
    assert not det.details["problems"] and not det.details["unsupported"]


@pytest.mark.parametrize("backend", EXACT)
def test_experts_logits_and_tokens_are_transformers(models: dict[str, Any], backend: str) -> None:
    rec = record()
    model = models[backend]
    assert model.backend == backend and model.info["runtime"] == "transformers"
    assert type(model.module).__name__ == "GptOssForCausalLM"
    assert type(model.module.model.layers[0].mlp.experts).__name__ == rec["loaded_experts_class"]
    assert model.info["unused_tensors"] == []  # the _blocks/_scales pairs were read (decoded), not left over
    for name, want in rec["dequantized_experts"].items():
        got = model.module.get_parameter(name)
        assert list(got.shape) == want["shape"], name
        assert sha256_f32(got) == want["sha256"], name
    for name, want in rec["other_params"].items():  # attention, sinks, router, expert biases, norms, embeddings
        assert sha256_f32(model.module.get_parameter(name)) == want["sha256"], name
    logits = forward_logits(model, rec["prompt_ids"])
    assert rel_error(logits, torch.tensor(rec["logits_float32"])) <= 1e-5
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_float32"]


@needs_kernel
def test_cpu_fast_keeps_experts_packed_and_matches_transformers(models: dict[str, Any]) -> None:
    """cpu-fast (the default here): each expert's two weights are GGML MXFP4 blocks on the compiled block kernel
    (17 bytes a block of 32: the E8M0 exponent and the codes, 4.25 bits a weight), never decoded as a whole; each
    one's exact weight is transformers' decoded expert bit for bit (the blocks and a bfloat16 bias: their bytes
    counted); logits within 1e-4 of transformers' float32 forward (two int8 activation passes per 32-block: within
    1e-4 of each linear's largest output), no bias (fitted gain within 1e-5 of 1), greedy tokens identical."""
    rec = record()
    model = models["cpu-fast"]
    assert model.info["mxfp4"]["held_dtype"] == "packed (4.25 bits)" and model.info["unused_tensors"] == []
    for layer in range(2):
        experts = model.module.get_submodule(EXPERTS.format(layer))
        assert type(experts).__name__ == "PackedGptOssExperts"
        assert not list(experts.parameters())  # no decoded copy beside the packed one
        assert experts.packed_bytes() == sum(
            n * (k // 32 * 17) + 2 * n for n, k in ((256, 128), (128, 128)) for _ in range(4)
        )
    for name, want in rec["dequantized_experts"].items():
        got = _packed_parameter(model, name)
        assert list(got.shape) == want["shape"] and sha256_f32(got) == want["sha256"], name
    for name, want in rec["other_params"].items():
        if "experts." in name and name.endswith("_bias"):
            experts = model.module.get_submodule(name.rpartition(".")[0])
            linears = experts.gate_up if "gate_up" in name else experts.down
            got = torch.stack([m.bias for m in linears])
        else:  # the head is cpu-fast's decode head: its exact table
            owner, _, attr = name.rpartition(".")
            got = getattr(model.module.get_submodule(owner), attr)
        assert sha256_f32(got) == want["sha256"], name
    logits = forward_logits(model, rec["prompt_ids"])
    want = torch.tensor(rec["logits_float32"])
    assert rel_error(logits, want) <= 1e-4
    gain = float((logits * want).sum() / (want * want).sum())
    assert abs(gain - 1) <= 1e-5  # no bias hiding under the tolerance
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_float32"]


@needs_kernel
def test_cpu_fast_defaults_are_within_the_bfloat16_class() -> None:
    """The default load (``auto``: cpu-fast) runs prompts through bfloat16 GEMMs where the CPU has AMX or
    AVX512-BF16 and the head on cpu-fast's Q8_0 decode kernel, as every cpu-fast format: logits within the
    bfloat16 class's 3e-2 of the largest, no bias (fitted gain within 5e-3 of 1), greedy tokens identical."""
    rec = record()
    model = sdk.load(FIXTURES / NAME)
    assert model.backend == "cpu-fast" and model.info["cpu_fast"]["lm_head"]["head"] == "Q8_0 blocks"
    logits = forward_logits(model, rec["prompt_ids"])
    want = torch.tensor(rec["logits_float32"])
    assert rel_error(logits, want) <= 3e-2
    gain = float((logits * want).sum() / (want * want).sum())
    assert abs(gain - 1) <= 5e-3
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_float32"]


@needs_kernel
def test_cpu_fast_decode_and_prompt_paths_agree_with_the_exact_experts(models: dict[str, Any]) -> None:
    """A one-token call (the block kernel: two int8 activation passes, within 1e-4) and a many-token call (the exact
    weights and a GEMM) of one experts module give the dequantized module's outputs: the same routing, weights,
    clamped SwiGLU and sums; no bias under the kernel's tolerance (the gain fitted over 64 decode calls within 5e-6
    of 1; one call's alone scatters by ~1e-5)."""
    torch.manual_seed(0)
    fast = models["cpu-fast"].module.get_submodule(EXPERTS.format(1))
    exact = models["dequantized"].module.get_submodule(EXPERTS.format(1))
    num = den = 0.0
    for call in range(66):
        tokens = 80 if call == 65 else 3 if call % 2 else 1
        x = torch.randn(tokens, 128)
        idx = torch.randint(0, 4, (tokens, 2))
        w = torch.rand(tokens, 2)
        want = exact(x, idx, w)
        got = fast(x, idx, w)
        assert rel_error(got, want) <= (1e-4 if tokens <= 4 else 1e-6), tokens
        if tokens <= 4:
            num, den = num + float((got * want).sum()), den + float((want * want).sum())
    assert abs(num / den - 1) <= 5e-6


def test_backend_choice_on_other_devices() -> None:
    """cpu-fast runs on the CPU only: ``auto`` on another device takes ``dequantized``; naming it is an error."""
    from anyquant.errors import UnsupportedBackendError
    from anyquant_mxfp4.loader import MXFP4Loader

    loader = MXFP4Loader()
    assert loader.choose_backend("auto", torch.device("meta")) == "dequantized"
    with pytest.raises(UnsupportedBackendError, match="runs on the CPU"):
        loader.choose_backend("cpu-fast", torch.device("meta"))


def test_decoding_is_the_mx_rule(models: dict[str, Any]) -> None:
    """Each weight is ``FP4[code] * 2**(scale - 127)``, code ``2j`` in byte ``j``'s low nibble, ``2j + 1`` in its
    high nibble; the model's parameter is the transposed ``[E, in, out]`` of the stored ``[E, out, in]``."""
    from safetensors.torch import load_file

    raw = load_file(FIXTURES / NAME / "model.safetensors")
    model = models["dequantized"]
    table = torch.tensor(FP4, dtype=torch.float64)
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            pre = f"{EXPERTS.format(layer)}.{proj}"
            blocks, scales = raw[f"{pre}_blocks"], raw[f"{pre}_scales"]
            codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-3)  # [E, out, in]
            factor = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)
            want = (table[codes.long()] * factor).transpose(1, 2)
            got = model.module.get_parameter(pre)
            assert got.dtype == torch.float32 and torch.equal(got.double(), want), pre


def test_bfloat16_load_is_transformers_bfloat16_model() -> None:
    """dtype='bfloat16': the checkpoint's own dtype, as transformers loads it; the same modules, the same weights."""
    rec = record()
    model = sdk.load(FIXTURES / NAME, dtype="bfloat16", backend="dequantized")
    assert model.module.get_parameter(f"{EXPERTS.format(0)}.down_proj").dtype == torch.bfloat16
    # 0.0 here (the same ops on the same weights; cpu-fast: float32 sums rounded once, 0.0 too); the tolerance
    # allows another CPU's bfloat16 GEMMs
    for loaded in (model, *([sdk.load(FIXTURES / NAME, dtype="bfloat16")] if _lut_available() else [])):
        logits = forward_logits(loaded, rec["prompt_ids"])
        assert rel_error(logits, torch.tensor(rec["logits_bf16_model"])) <= 2e-2, loaded.backend
        assert greedy_tokens(loaded, rec["prompt_ids"], 8) == rec["greedy_bf16_model"], loaded.backend


def test_inspect_rows() -> None:
    report = sdk.inspect(FIXTURES / NAME)
    rows = {m.name: m for m in report.modules}
    gate_up = rows[f"{EXPERTS.format(0)}.gate_up_proj"]
    assert (gate_up.format, gate_up.shape, gate_up.bits, gate_up.group_size) == ("mxfp4", (4, 256, 128), 4.25, 32)
    assert gate_up.nbytes == 4 * 256 * 128 // 2 + 4 * 256 * 4  # codes + one scale byte per 32
    assert rows[EXPERTS.format(0)].format == "dense"  # its biases
    assert rows["model.layers.0.self_attn.q_proj"].format == "dense"


def test_without_quantization_config_the_tensors_decide(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    _config(path, lambda c: c.pop("quantization_config"))
    det = sdk.detect(path)
    assert det.format == "mxfp4" and "no quantization_config" in det.evidence
    rec = record()
    model = sdk.load(path, backend="dequantized")
    assert rel_error(forward_logits(model, rec["prompt_ids"]), torch.tensor(rec["logits_float32"])) <= 1e-5


def test_scale_shape_that_disagrees_is_a_conflict(tmp_path: Path) -> None:
    """A scales tensor that is not one exponent per block of its blocks: refused before any weight is read."""
    path = _copy(tmp_path)
    name = f"{EXPERTS.format(1)}.down_proj_scales"
    _rewrite(path, lambda t: t.__setitem__(name, t[name][:, :, :-1].contiguous()))
    det = sdk.detect(path)
    assert det.format == "mxfp4" and any(name in p for p in det.details["problems"])
    with pytest.raises(FormatConflictError, match=name):
        sdk.load(path)


def test_blocks_without_scales_is_a_conflict(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    name = f"{EXPERTS.format(0)}.gate_up_proj_scales"
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(FormatConflictError, match="gate_up_proj_blocks has no gate_up_proj_scales"):
        sdk.load(path)


def test_blocks_of_another_width_is_a_conflict(tmp_path: Path) -> None:
    """Blocks of 16 values (8 bytes) are not MXFP4's 32: the scales no longer match and neither does the width."""
    path = _copy(tmp_path)
    name = f"{EXPERTS.format(0)}.down_proj_blocks"
    _rewrite(path, lambda t: t.__setitem__(name, t[name].reshape(4, 128, 8, 8).contiguous()))
    with pytest.raises(FormatConflictError, match=rf"{name} is \[4, 128, 8, 8\]"):
        sdk.load(path)


def test_nan_scale_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """E8M0 0xFF is NaN (transformers would decode it to 2**128: inf, or NaN for a zero code): a NumericalError
    naming the scales tensor, at load."""
    path = _copy(tmp_path)
    name = f"{EXPERTS.format(1)}.gate_up_proj_scales"
    _rewrite(path, lambda t: t[name][2, 5].__setitem__(1, 255))
    for backend in EXACT + (("cpu-fast",) if _lut_available() else ()):
        with pytest.raises(NumericalError, match=rf"'{name}' holds 1 NaN"):
            sdk.load(path, backend=backend)


def test_overflowing_scale_is_refused_naming_the_weight(tmp_path: Path) -> None:
    """Exponent 254 (2**127) times code 7 (6.0) is past float32's and bfloat16's range: inf (transformers keeps it),
    refused naming the decoded parameter."""
    path = _copy(tmp_path)
    pre = f"{EXPERTS.format(0)}.down_proj"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{pre}_scales"][0, 0, 0] = 254
        t[f"{pre}_blocks"][0, 0, 0] = 0  # the block's other 31 codes: zeros
        t[f"{pre}_blocks"][0, 0, 0, 0] = 0x07

    _rewrite(path, edit)
    for backend in EXACT + (("cpu-fast",) if _lut_available() else ()):
        with pytest.raises(NumericalError, match=rf"'{pre}' holds 1 inf"):
            sdk.load(path, backend=backend)


def test_malformed_modules_to_not_convert_is_a_config_error(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    _config(path, lambda c: c["quantization_config"].__setitem__("modules_to_not_convert", 7))
    det = sdk.detect(path)
    assert det.format == "mxfp4" and det.details["config_error"][0] == "ConfigError"
    with pytest.raises(ConfigError, match="modules_to_not_convert is 7"):
        sdk.load(path)


def test_mxfp4_config_without_packed_tensors_is_a_conflict(tmp_path: Path) -> None:
    """The config says mxfp4; the experts are stored dense (bf16 gate_up_proj/down_proj): never loaded as dense."""
    path = _copy(tmp_path)
    rec = record()

    def edit(t: dict[str, torch.Tensor]) -> None:
        for layer in range(2):
            for proj in ("gate_up_proj", "down_proj"):
                pre = f"{EXPERTS.format(layer)}.{proj}"
                del t[f"{pre}_blocks"], t[f"{pre}_scales"]
                t[pre] = torch.zeros(rec["dequantized_experts"][pre]["shape"], dtype=torch.bfloat16)

    _rewrite(path, edit)
    with pytest.raises(FormatConflictError, match="the config says mxfp4, but no tensor is a U8"):
        sdk.load(path)


def test_three_dimensional_blocks_are_unsupported(tmp_path: Path) -> None:
    """A packed 2-D weight (``[out, in/32, 16]``) is valid MXFP4 but no known checkpoint's layout: refused, not
    guessed."""
    path = _copy(tmp_path)

    def edit(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight_blocks"] = torch.zeros(259, 4, 16, dtype=torch.uint8)
        t["lm_head.weight_scales"] = torch.full((259, 4), 127, dtype=torch.uint8)

    _rewrite(path, edit)
    with pytest.raises(UnsupportedFormatError, match=r"lm_head\.weight_blocks"):
        sdk.load(path)


def test_hidden_pair_names_are_not_served() -> None:
    """The decoded parameter replaces its pair: a second reader of ``*_blocks`` is told where it went."""
    from anyquant_mxfp4.dequant import MXFP4Source
    from anyquant_mxfp4.scheme import read_scheme

    probe = Probe.open(FIXTURES / NAME)
    src = MXFP4Source(SafetensorsSource(probe), read_scheme(probe))
    try:
        pre = f"{EXPERTS.format(0)}.gate_up_proj"
        assert pre in src and f"{pre}_blocks" not in src and f"{pre}_bias" in src
        assert pre in set(src.keys()) and f"{pre}_scales" not in set(src.keys())
        with pytest.raises(CheckpointError, match="read decoded"):
            src.get(f"{pre}_blocks")
        assert src.get(pre).shape == (4, 128, 256)
        assert pre not in src.unused() and f"{pre}_blocks" not in src.unused()
        assert f"{EXPERTS.format(0)}.down_proj" in src.unused()
    finally:
        src.close()


def test_packed_weight_no_parameter_takes_is_refused(tmp_path: Path) -> None:
    """A packed pair under a name the model has no parameter for would decode to a tensor nothing reads: the model
    would run without those experts. Refused after the build, naming it (not a warning about unused tensors)."""
    path = _copy(tmp_path)

    def edit(t: dict[str, torch.Tensor]) -> None:
        for suffix in ("_blocks", "_scales"):
            t[f"model.layers.0.mlp.shared.gate_up_proj{suffix}"] = t[
                f"{EXPERTS.format(0)}.gate_up_proj{suffix}"
            ].clone()

    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=r"no parameter for the MXFP4 weight\(s\) model\.layers\.0\.mlp\.shared"):
        sdk.load(path)


def test_scales_typed_e8m0_read_as_the_same_bytes(tmp_path: Path) -> None:
    """Scales stored as F8_E8M0 (the same byte, typed) decode to the same weights."""
    path = _copy(tmp_path)
    rec = record()

    def edit(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.endswith("_scales")]:
            t[name] = t[name].view(torch.float8_e8m0fnu)

    _rewrite(path, edit)
    model = sdk.load(path, backend="dequantized")
    for name, want in rec["dequantized_experts"].items():
        assert sha256_f32(model.module.get_parameter(name)) == want["sha256"], name
    if _lut_available():
        fast = sdk.load(path, backend="cpu-fast")
        for name, want in rec["dequantized_experts"].items():
            assert sha256_f32(_packed_parameter(fast, name)) == want["sha256"], name
