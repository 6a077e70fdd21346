"""The cpu-fast backend on GPTQModel's AWQ checkpoints (tiny Llama): exact weights, logits within the
stated tolerance of the reference backend, greedy tokens equal to GPTQModel's; GEMV layout converts too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from anyquant_awq.dequant import awq_gemv_zeros_width, pack_awq_gemm_cols
from anyquant_awq.loader import AWQLoader
from anyquant_awq.qlinear import AWQLinear
from anyquant_cpu import kernels
from anyquant_cpu import step as step_module
from anyquant_cpu.engine import FastInt4Linear, fast_cpu_capable
from anyquant_cpu.kernels.linear import GroupInt4BlockLinear
from anyquant_runtime.packing import pack_cols
from tests.decoding import rel_error, stepwise_logits
from tests.peers.catalog import GPTQMODEL_AWQ_VARIANTS, gptqmodel_awq_quantized_dir

pytestmark = pytest.mark.skipif(not fast_cpu_capable()[0], reason=fast_cpu_capable()[1])

VARIANTS = [v["name"] for v in GPTQMODEL_AWQ_VARIANTS]
DECODE_TOL = 2e-2  # int4 kernel, bfloat16 (relative to max |logit|)
PREFILL_TOL = 1e-5  # exact weights, float32 GEMM


@pytest.fixture(scope="module")
def root() -> Path:
    return gptqmodel_awq_quantized_dir()


@pytest.mark.peer
@pytest.mark.parametrize("variant", VARIANTS)
def test_exact_weights_logits_in_tolerance_and_greedy_tokens(root: Path, variant: str) -> None:
    path = root / "quantized" / variant
    # auto; the 32-token prompt takes the many-rows path, exact with cpu_fast_prefill="float32"
    fast = anyquant.load(path, cpu_fast_small_rows=16, cpu_fast_prefill="float32")
    assert fast.backend == "cpu-fast" and fast.info["cpu_fast"]["fast_layers"] == 14
    modules = dict(fast.module.named_modules())
    theirs = load_file(root / "judges" / variant / "gptqmodel_dequant.safetensors")
    for key, weight_in_out in theirs.items():
        layer = modules[key.removesuffix(".weight")]
        assert isinstance(layer, (FastInt4Linear, GroupInt4BlockLinear)), key
        got = layer.dequantize()
        assert torch.equal(got, weight_in_out.t().to(got.dtype)), key
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    reference = anyquant.load(path, backend="reference")
    with torch.no_grad():
        want = reference.module(ref["input_ids"]).logits
        assert rel_error(fast.module(ref["input_ids"]).logits, want) < PREFILL_TOL
        assert rel_error(stepwise_logits(fast.module, ref["input_ids"]), want) < DECODE_TOL
        assert rel_error(anyquant.load(path).module(ref["input_ids"]).logits, want) < DECODE_TOL  # default: int4 kernel
        auto = anyquant.load(path, cpu_fast_small_rows=16)  # the default prompt path: bfloat16 where fast
        assert rel_error(auto.module(ref["input_ids"]).logits, want) < DECODE_TOL
    tokens = ref["greedy_tokens"][0].tolist()
    got_tokens = fast.generator.generate_ids(tokens[:8], fast.params(max_new_tokens=8))
    assert got_tokens == tokens[8:]
    assert got_tokens == reference.generator.generate_ids(tokens[:8], reference.params(max_new_tokens=8))


@pytest.mark.peer
@pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")
@pytest.mark.parametrize("variant", VARIANTS)
def test_block_kernel_decodes_as_the_int4_kernel(root: Path, variant: str) -> None:
    """With the compiled kernel built and cpu_fast_kernel="gq4" (the default where the kernel is vectorized), every layer is a GQ4 block linear (AWQ's packing
    repacked), planned by the decode step as "ggml": greedy tokens equal torch's int4 path's (`cpu_fast_kernel="torch"`) and
    GPTQModel's, decode logits in tolerance."""
    path = root / "quantized" / variant
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    tokens, ids = ref["greedy_tokens"][0].tolist(), ref["input_ids"]
    gq4 = anyquant.load(path, backend="cpu-fast", cpu_fast_kernel="gq4")
    before = anyquant.load(path, backend="cpu-fast", cpu_fast_kernel="torch")
    assert gq4.info["cpu_fast"]["block_kernel"] == {"gq4_layers": 14, "int4_kernel": {}}
    assert sum(isinstance(m, GroupInt4BlockLinear) for m in gq4.module.modules()) == 14
    assert not any(isinstance(m, GroupInt4BlockLinear) for m in before.module.modules())
    got = gq4.generator.generate_ids(tokens[:8], gq4.params(max_new_tokens=8))
    assert got == before.generator.generate_ids(tokens[:8], before.params(max_new_tokens=8)) == tokens[8:]
    step = gq4.module.__dict__["_step"]
    assert all(function is step_module.compiled_layer("ggml") for function, _ in step.layers)
    reference = anyquant.load(path, backend="reference")
    with torch.no_grad():
        logits = stepwise_logits(gq4.module, ids)
        assert rel_error(logits, reference.module(ids).logits) < DECODE_TOL
        assert rel_error(logits, stepwise_logits(before.module, ids)) < DECODE_TOL


def test_backend_order_and_listing() -> None:
    loader = AWQLoader()
    # gptqmodel first: GPTQModel's kernels, CUDA only (auto on the CPU starts at cpu-fast)
    assert loader.preference() == ("gptqmodel", "cpu-fast", "dequantized", "reference")
    assert {b.name: b.available for b in loader.backends()}["cpu-fast"]


def _random_awq(layout: str, k: int, n: int, group: int, zero_point: bool) -> AWQLinear:
    gen = torch.Generator().manual_seed(3)
    groups = k // group
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).half()
    if layout == "gemm":
        qweight, qzeros, sc = pack_awq_gemm_cols(codes), pack_awq_gemm_cols(zeros), scales
    else:
        width = awq_gemv_zeros_width(k, group)
        qweight = pack_cols(codes.t().contiguous(), 4)
        padded = torch.zeros(n, width * 8, dtype=torch.int32)
        padded[:, :groups] = zeros.t()
        qzeros = pack_cols(padded, 4)
        sc = torch.zeros(n, width * 8, dtype=torch.float16)
        sc[:, :groups] = scales.t()
    return AWQLinear(
        qweight,
        qzeros if zero_point else None,
        sc,
        torch.randn(n),
        layout=layout,
        bits=4,
        group_size=group,
        in_features=k,
        out_features=n,
    )


@pytest.mark.parametrize("layout", ["gemm", "gemv"])
@pytest.mark.parametrize("zero_point", [True, False])
def test_layouts_convert_exactly(layout: str, zero_point: bool) -> None:
    awq = _random_awq(layout, 256, 128, 64, zero_point)
    fast = awq.to_fast_cpu(small_rows=2)
    assert torch.equal(fast.dequantize(), awq.dequantize())
    x = torch.randn(6, 256)
    with torch.no_grad():
        want = awq(x)
        assert rel_error(fast(x), want) < PREFILL_TOL
        assert rel_error(fast(x[:2]), want[:2]) < DECODE_TOL


def test_unsupported_group_is_reported() -> None:
    awq = _random_awq("gemm", 256, 128, 64, True)
    awq.group_size = 16
    assert "multiple of 32" in str(awq.fast_cpu_unsupported())
