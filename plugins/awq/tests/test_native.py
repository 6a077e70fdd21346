"""anyquant's own AWQ quantizer (anyquant_awq.native): the quantization rule, the packing, the search
against plain round-to-nearest, and GPTQModel reading what it writes (bit-exact weights)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_awq.dequant import dequantize_awq_gemm
from anyquant_awq.native import (
    AWQOptions,
    _pack,
    awq_quantize_model,
    pseudo_quantize,
    quantize_checkpoint,
    quantize_params,
)

TEXTS = [f"Sample {i}: the quick brown fox jumps over the lazy dog while the cat watches. " * 6 for i in range(16)]


@pytest.mark.parametrize("zero_point", [True, False], ids=["zero_point", "symmetric"])
def test_codes_zeros_scales_are_recovered(zero_point: bool) -> None:
    """A weight made of codes, zeros and float16 scales (every group spanning the full code range)
    quantizes back to exactly those."""
    gen = torch.Generator().manual_seed(0)
    n, k, g = 24, 128, 32
    codes = torch.randint(0 if zero_point else 1, 16, (n, k), generator=gen, dtype=torch.int32)  # symmetric: -7..7
    codes[:, ::g] = 0 if zero_point else 1  # the range's ends in every group
    codes[:, 1::g] = 15
    zeros = torch.randint(1, 15, (n, k // g), generator=gen, dtype=torch.int32) if zero_point else None
    if zeros is None:
        zeros = torch.full((n, k // g), 8, dtype=torch.int32)
    scales = (torch.rand(n, k // g, generator=gen) * 0.01 + 1e-3).half()
    w = (codes.reshape(n, -1, g) - zeros.unsqueeze(-1)).float() * scales.float().unsqueeze(-1)
    q, z, s = quantize_params(w.reshape(n, k), g, 4, zero_point)
    assert torch.equal(s, scales) and torch.equal(z, zeros) and torch.equal(q, codes)
    assert torch.equal(pseudo_quantize(w.reshape(n, k), g, 4, zero_point), w.reshape(n, k))


@pytest.mark.parametrize("zero_point", [True, False], ids=["zero_point", "symmetric"])
def test_packed_tensors_dequantize_to_the_searched_weight(zero_point: bool) -> None:
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    q, z, s = quantize_params(w, 64, 4, zero_point)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and s.dtype == torch.float16
    t = _pack(q, z, s)
    assert t["qweight"].shape == (256, 12) and t["qzeros"].shape == (4, 12) and t["scales"].shape == (4, 96)
    got = dequantize_awq_gemm(t["qweight"], t["qzeros"], t["scales"], group_size=64)
    assert torch.equal(got, pseudo_quantize(w, 64, 4, zero_point).half())


def _outlier_model(path: Path) -> Path:
    """The tiny Llama with a few hot input channels (what AWQ is for: activation outliers)."""
    from safetensors.torch import save_file

    make_tiny_dense(path, dtype="float16")
    tensors = load_file(path / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[::16] *= 12
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def test_search_beats_round_to_nearest(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = _outlier_model(tmp_path / "src")
    load = lambda: AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()  # noqa: E731
    dense = load()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(3))
    ref = _logits(dense, ids)
    rtn = load()
    with torch.no_grad():
        for name, mod in rtn.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                mod.weight.copy_(pseudo_quantize(mod.weight, 32))
    awq = load()
    out = awq_quantize_model(awq, ids, AWQOptions(group_size=32))
    assert len(out) == 14  # 7 linears x 2 layers
    with torch.no_grad():  # the model as the checkpoint will hold it
        for name, (q, z, s) in out.items():
            layer = awq.get_submodule(name)
            layer.weight.copy_(
                (q.reshape(q.shape[0], -1, 32) - z.unsqueeze(-1)).float().mul(s.float().unsqueeze(-1)).reshape(q.shape)
            )
    err_rtn = float((_logits(rtn, ids) - ref).pow(2).mean())
    err_awq = float((_logits(awq, ids) - ref).pow(2).mean())
    assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("native")
    src = _outlier_model(root / "src")
    return anyquant.quantize(
        src,
        root / "awq",
        method="awq",
        group_size=32,
        calibration=TEXTS,
        calibration_seq_len=64,
        quantizer_backend="anyquant",
        zero_point=True,
    )


def test_checkpoint_detects_and_loads(native: Path) -> None:
    d = anyquant.detect(native)
    assert (d.format, d.variant, d.details["group_size"], d.details["zero_point"]) == ("awq", "gemm", 32, True)
    model = anyquant.load(native, backend="reference")
    assert model.format == "awq" and isinstance(model.generate("Hello", max_new_tokens=4), str)


def test_bad_options_fail_early(tmp_path: Path) -> None:
    src = make_tiny_dense(tmp_path / "src", dtype="float16")
    with pytest.raises(anyquant.errors.QuantizeError, match="quantizer_backend"):
        anyquant.quantize(src, tmp_path / "o", method="awq", calibration=TEXTS, group_size=32, quantizer_backend="x")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(
        json.dumps({**cfg, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})
    )
    with pytest.raises(anyquant.errors.QuantizeError, match="gptqmodel"):
        quantize_checkpoint(src, tmp_path / "o2", TEXTS, opts=AWQOptions(group_size=32), seq_len=64)
    assert not (tmp_path / "o2").exists()


@pytest.mark.peer
def test_gptqmodel_reads_it_bit_exactly(native: Path) -> None:
    from tests.peers.fixtures import peer_fixture_or_skip

    digest = hashlib.sha256((native / "model.safetensors").read_bytes()).hexdigest()
    params = {
        "mode": "reload",
        "method": "awq",
        "checkpoint": str(native),
        "digest": digest,
        "seed": 0,
        "prompt_len": 16,
        "greedy_prompt_len": 8,
        "new_tokens": 6,
    }
    fixture = peer_fixture_or_skip("gptqmodel_worker", params, packages=("gptqmodel",))
    theirs = load_file(fixture / "judges" / "reload" / "gptqmodel_dequant.safetensors")
    ours = anyquant.load(native, backend="reference", dtype="float16")
    assert len(theirs) == 14
    for name, weight in theirs.items():
        mine = ours.module.get_submodule(name.removesuffix(".weight")).dequantize()
        assert torch.equal(mine, weight.t()), name  # GPTQModel's dequantize_gemm is [in, out]
    judge = load_file(fixture / "judges" / "reload" / "gptqmodel_logits.safetensors")
    with torch.no_grad():
        logits = ours.module(judge["input_ids"]).logits.float()
    torch.testing.assert_close(logits, judge["logits"], rtol=2e-2, atol=2e-2)


def test_zero_point_defaults_to_autoawqs() -> None:
    from anyquant.protocols import QuantizeSpec
    from anyquant_awq.quantize import AWQQuantizer
    from anyquant_tools.gptqmodel_quantizer import GPTQModelQuantizer as GPTQQuantizer  # method "gptq"

    zero_point = AWQQuantizer.zero_point
    assert zero_point(QuantizeSpec("awq")) is True  # AutoAWQ's default
    assert zero_point(QuantizeSpec("awq", sym=True)) is False
    assert zero_point(QuantizeSpec("awq", sym=False)) is True
    assert zero_point(QuantizeSpec("awq", sym=True, options={"zero_point": True})) is True
    job = AWQQuantizer().job(Path("s"), Path("d"), QuantizeSpec("awq"), Path("c"))
    assert job["sym"] is False
    assert GPTQQuantizer().job(Path("s"), Path("d"), QuantizeSpec("gptq"), Path("c"))["sym"] is True  # GPTQ's default


def test_dense_export_from_cpu_fast_equals_reference(tmp_path: Path) -> None:
    """cpu-fast swaps the LM head and a tied embedding for its own modules; a dense export of that
    model must still write what the reference backend writes: the same names, the same values, tied."""
    src = make_tiny_dense(tmp_path / "src", dtype="float16", tie_word_embeddings=True)
    awq = anyquant.quantize(
        src,
        tmp_path / "awq",
        method="awq",
        group_size=32,
        calibration=TEXTS,
        calibration_seq_len=64,
        quantizer_backend="anyquant",
        quality=False,
    )
    fast = anyquant.load(awq, backend="cpu-fast")
    if fast.info["cpu_fast"]["fast_layers"] == 0:
        pytest.skip("torch's int4 CPU kernel does not run here")
    a = load_file(anyquant.export_dense(awq, tmp_path / "a", dtype="float32", backend="cpu-fast") / "model.safetensors")
    b = load_file(
        anyquant.export_dense(awq, tmp_path / "b", dtype="float32", backend="reference") / "model.safetensors"
    )
    assert set(a) == set(b) and "lm_head.weight" not in a and "model.embed_tokens.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in b)
