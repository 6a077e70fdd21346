"""Q4_K_M files on the compiled GGUF-block kernel (issue #42 §3): ``cpu-fast`` runs a Q4_K_M file's Q4_K and Q6_K
linears (and its Q6_K / Q4_K LM head) on anyquant's own kernel, reading the super-blocks llama.cpp's quantizer wrote
(144 and 210 bytes per 256 weights) in the kernel's interleaved form, where torch's int4 kernel took a repacked copy
of Q4_K and Q6_K a bfloat16 copy (2 bytes a weight).

Judged on the family fixtures (``fixtures/<family>.Q4_K_M.gguf``: tiny random models llama.cpp converted and quantized,
``make_gguf_fixtures.py``): every Q4_K / Q6_K tensor of the files through the kernel against the plugin's exact
dequantization (float64, within 1e-4 of the largest output with two activation passes), and the models' logits and
greedy tokens against the ``dequantized`` backend and llama.cpp's record.

Skipped where the kernel is not built (anyquant-cpu installed without it; ``make test`` requires it)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant_cpu import kernels
from anyquant_gguf.dequant import dequantize_blocks_torch
from anyquant_gguf.ggml import GGMLQuantizationType as Q
from anyquant_gguf.reader import load_raw, open_gguf
from tests.decoding import logits_after_prompt

pytestmark = pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")

FIXTURES = Path(__file__).parent / "fixtures"
ISAS = [i for i in range(len(kernels.ISA_NAMES)) if i <= max(kernels.isa(), 0)]
K_TYPES = {Q.Q4_K: "Q4_K", Q.Q6_K: "Q6_K"}


def _path(family: str) -> Path:
    return FIXTURES / f"{family}.Q4_K_M.gguf"


@cache
def _record(family: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{family}.json").read_text(encoding="utf-8"))
    return data


@cache
def _load(family: str, backend: str, **options: Any) -> Any:
    return anyquant.load(_path(family), backend=backend, **options)


@pytest.fixture(scope="module", autouse=True)
def _drop_models() -> Any:
    yield
    _load.cache_clear()


def _k_tensors(family: str) -> list[tuple[str, Any]]:
    """The file's Q4_K / Q6_K matrices as raw blocks (each expert of a 3-D expert tensor apart)."""
    reader = open_gguf(_path(family))
    out = []
    for tensor in reader.tensors:
        if tensor.tensor_type not in K_TYPES:
            continue
        experts = tensor.shape[2] if len(tensor.shape) == 3 else None
        for e in range(experts or 1):
            raw = load_raw(reader, tensor.name, expert=None if experts is None else e)
            out.append((tensor.name if experts is None else f"{tensor.name}[{e}]", raw))
    return out


@pytest.mark.parametrize("family", ["qwen3", "phi3", "qwen3moe"])
def test_llama_cpp_s_super_blocks_within_the_contract(family: str) -> None:
    """Every Q4_K / Q6_K matrix llama.cpp's quantizer wrote (weights, the embedding table, experts): the kernel within
    1e-4 of the largest output of the exact weight's product (the plugin's dequantization, float64) with two
    activation passes on every path this host has, 1 and 3 rows, stored and interleaved (bitwise alike); the kernel's
    own dequantization (the prompt path's weight) is the plugin's bit for bit."""
    tensors = _k_tensors(family)
    assert {raw.qtype for _, raw in tensors} == set(K_TYPES)
    gen = torch.Generator().manual_seed(0)
    for name, raw in tensors:
        rows, cols = raw.shape
        code = kernels.GGML_TYPES[K_TYPES[raw.qtype]][0]
        blocks = raw.data.reshape(-1).contiguous()
        exact = dequantize_blocks_torch(blocks, raw.qtype, (rows, cols))
        assert torch.equal(torch.ops.anyquant.ggml_dequantize(blocks, code, rows, cols, torch.float32), exact), name
        interleaved = torch.ops.anyquant.ggml_interleave(blocks, code, rows, cols, True, 0)
        x = torch.randn(3, cols, generator=gen)
        for m in (1, 3):
            want = x[:m].double() @ exact.double().T
            for isa in ISAS:
                got = torch.ops.anyquant.ggml_gemv(x[:m], blocks, code, rows, cols, isa, 2)
                err = float((got.double() - want).abs().max() / want.abs().max())
                assert err < 1e-4, (name, m, isa, err)
                il = torch.ops.anyquant.ggml_gemv(x[:m], interleaved, code + kernels.INTERLEAVED, rows, cols, isa, 2)
                assert torch.equal(il, got), (name, m, isa)


def _block_linears(model: Any) -> dict[str, Any]:
    from anyquant_cpu.kernels.linear import BlockLinear

    return {n: m for n, m in model.module.named_modules() if isinstance(m, BlockLinear)}


@pytest.mark.parametrize("family", ["qwen3", "qwen3moe", "mixtral"])
def test_cpu_fast_runs_q4_k_m_on_the_block_kernel(family: str) -> None:
    """cpu-fast on a Q4_K_M file: every Q4_K / Q6_K linear (and the head) on the GGUF-block kernel, interleaved at
    load, none on torch's int4 kernel or a bfloat16 copy (``info["cpu_fast"]``); prompts over ``small_rows`` exact
    (the ``dequantized`` backend's logits within 1e-5); decode within 2e-2 of the exact backend's logits, its top
    logit within 1e-4 (the head computes its top logits again exactly), the greedy tokens the exact backend's and
    llama.cpp's; the read-in-place form gives bitwise the same; Mixtral's permuted Q/K rows interleaved as HF's."""
    from anyquant_cpu.engine import FastInt4Linear, PrepackedBf16Linear

    fast = _load(family, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_prefill="float32")
    exact = _load(family, "dequantized")
    info = fast.info["cpu_fast"]
    assert not info["bf16"] and not info["dequantized"], info
    assert set(info["block_kernel"]) == {"Q4_K", "Q6_K"} and info["interleaved"] == info["converted"], info
    linears = _block_linears(fast)
    head = fast.module.get_output_embeddings()
    assert type(head).__name__ == "GGUFBlockHead" and head.block_type in {"Q4_K", "Q6_K"}
    # the exact rows (top logits, prompts): decoded from the stored blocks by the kernel, bit for bit the format's
    top = torch.tensor([[0, 5, head.out_features - 1], [7, 7, 1]])
    table = head.table
    assert table.decode_rows is not None
    want = dequantize_blocks_torch(table.qweight[top.reshape(-1)], table.qtype, (6, head.in_features))
    assert torch.equal(table.rows(top), want.reshape(2, 3, -1))
    by_type: dict[str, int] = {}
    tied = getattr(head, "tied_to_input_embedding", False)  # over the embedding's table: not one of the linears
    for kind in [m.type_name for m in linears.values()] + ([] if tied else [head.block_type]):
        by_type[kind] = by_type.get(kind, 0) + 1
    assert by_type == info["block_kernel"] and all(m.interleaved for m in linears.values())
    assert not any(isinstance(m, (FastInt4Linear, PrepackedBf16Linear)) for m in fast.module.modules())
    rec = _record(family)
    ids = torch.tensor([rec["prompt_ids"]])
    with torch.no_grad():  # 19 rows > small_rows: the exact weights, dequantized by the kernel from either form
        torch.testing.assert_close(fast.module(ids).logits, exact.module(ids).logits, rtol=1e-5, atol=1e-5)
    got = logits_after_prompt(fast, ids, 8)
    ref = logits_after_prompt(exact, ids, 8)
    assert float((got - ref).abs().max()) < 2e-2 * float(ref.abs().max())
    top = ref.argmax(-1, keepdim=True)
    assert torch.equal(got.argmax(-1, keepdim=True), top)
    assert float((got.gather(-1, top) - ref.gather(-1, top)).abs().max()) < 1e-4 * float(ref.abs().max())
    want = rec["greedy"]
    params = fast.params(max_new_tokens=len(want))
    assert fast.generator.generate_ids(rec["prompt_ids"], params) == want
    assert exact.generator.generate_ids(rec["prompt_ids"], exact.params(max_new_tokens=len(want))) == want
    in_place = _load(family, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_prefill="float32", cpu_fast_interleave=False)
    assert in_place.info["cpu_fast"]["in_place"] == info["converted"]
    assert torch.equal(logits_after_prompt(in_place, ids, 8), got)
    if family == "mixtral":  # a "llama" file: Q/K rows stored permuted, read in HF order by the interleaving copy
        reader = open_gguf(_path(family))
        q = linears["model.layers.0.self_attn.q_proj"]
        assert q.type_name == "Q4_K"
        hf = load_raw(reader, "blk.0.attn_q.weight").data.reshape(-1)
        assert torch.equal(q.raw_blocks(), hf)
        assert not torch.equal(load_raw(reader, "blk.0.attn_q.weight", unpermute=False).data.reshape(-1), hf)


@pytest.mark.parametrize("family", ["qwen3", "qwen3moe"])
def test_decode_step_runs_the_kernel_layers(family: str) -> None:
    """The compiled decode step plans every layer of a Q4_K_M file on the kernel (``ggml``; the MoE file's experts
    through ``anyquant::ggml_experts`` in ``mixed_moe``) and gives the module path's logits bit for bit."""
    from anyquant_cpu.step import DecodeStep, compiled_layer

    model = _load(family, "cpu-fast")
    ids = torch.tensor([_record(family)["prompt_ids"]])
    batch = torch.cat([ids, ids.flip(1)])
    model.module.__dict__.pop("_step", None)
    fast = logits_after_prompt(model, batch, 8)
    step = model.module.__dict__["_step"]
    assert isinstance(step, DecodeStep)
    kind = compiled_layer("mixed_moe" if family == "qwen3moe" else "ggml")
    assert all(function is kind for function, _ in step.layers)
    model.module.__dict__["_step"] = None  # the module path
    assert torch.equal(logits_after_prompt(model, batch, 8), fast)
    del model.module.__dict__["_step"]
