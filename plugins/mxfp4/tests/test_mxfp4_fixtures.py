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
from anyquant.runtime.tensors import SafetensorsSource
from tests.peers.recorded import forward_logits, greedy_tokens, rel_error, sha256_f32

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAME = "gptoss_mxfp4"
EXPERTS = "model.layers.{}.mlp.experts"
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{NAME}.json").read_text())
    return data


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    """One load per backend, shared by the tests that only read."""
    return {b: sdk.load(FIXTURES / NAME, backend=b) for b in ("dequantized", "reference")}


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


@pytest.mark.parametrize("backend", ["dequantized", "reference"])
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
    model = sdk.load(FIXTURES / NAME, dtype="bfloat16")
    assert model.module.get_parameter(f"{EXPERTS.format(0)}.down_proj").dtype == torch.bfloat16
    logits = forward_logits(model, rec["prompt_ids"])
    # 0.0 here (the same ops on the same weights); the tolerance allows another CPU's bfloat16 GEMMs
    assert rel_error(logits, torch.tensor(rec["logits_bf16_model"])) <= 2e-2
    assert greedy_tokens(model, rec["prompt_ids"], 8) == rec["greedy_bf16_model"]


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
    model = sdk.load(path)
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
    for backend in ("dequantized", "reference"):
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
    with pytest.raises(NumericalError, match=rf"'{pre}' holds 1 inf"):
        sdk.load(path)


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
    model = sdk.load(path)
    for name, want in rec["dequantized_experts"].items():
        assert sha256_f32(model.module.get_parameter(name)) == want["sha256"], name
