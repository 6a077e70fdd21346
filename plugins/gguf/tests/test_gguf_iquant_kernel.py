"""IQ4_NL, IQ4_XS, MXFP4, Q5_0 and Q5_1 files on the compiled GGUF-block kernel (issue #42 §3): ``cpu-fast`` runs their
linears and LM head on anyquant's own kernel from the stored blocks (18, 136, 17, 22 and 24 bytes per 32 / 256 / 32 /
32 / 32 weights; interleaved at load, or read in place), where they had a bfloat16 copy (2 bytes a weight).

A tiny Llama written with ``gguf.GGUFWriter`` whose every linear, embedding and head is of these types (MXFP4, Q5_0 and
Q5_1 from gguf's quantizer, the IQ4 types random codes under one scale, as ``test_gguf_more_types.py`` writes them;
Q/K rows permuted as llama.cpp's converter stores them): its logits and greedy tokens against the ``dequantized``
backend.

Skipped where the kernel is not built (anyquant-cpu installed without it; ``make test`` requires it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from anyquant_cpu import kernels
from plugins.gguf.tests.test_gguf_more_types import _blocks, _llama_writer, _load, _permute
from tests.decoding import logits_after_prompt

pytestmark = pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")

_HIDDEN, _FFN, _VOCAB, _HEADS, _KV = 256, 512, 96, 4, 2
_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_NEW_TYPES = (Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4, Q.Q5_0, Q.Q5_1)
#: (layer, GGUF linear) -> type: the five types over the 14 linears of the two layers (each at least twice)
_TYPES = {(layer, name): _NEW_TYPES[(7 * layer + i) % 5] for layer in range(2) for i, name in enumerate(_LINEARS)}
_EMBED_TYPE, _HEAD_TYPE = Q.IQ4_NL, Q.IQ4_XS
_PROMPT = [1, 5, 9, 33, 70, 2, 11, 95, 40, 17, 3, 64]


@pytest.fixture(scope="module")
def tiny_iq4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("iq4") / "tiny-iq4.gguf"
    writer = _llama_writer(path, _FFN)
    rng = np.random.default_rng(0)
    seed = 0

    def packed(name: str, qtype: Q, shape: tuple[int, int], heads: int | None = None) -> None:
        nonlocal seed
        seed += 1
        std = 0.5 if "embd" in name else 0.06
        if qtype in (Q.Q5_0, Q.Q5_1):  # gguf's quantizer
            values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * std
            raw = quantize(values + (0.01 if qtype == Q.Q5_1 else 0.0), qtype)
        else:
            raw = _blocks(qtype, *shape, seed=seed, std=std)
        writer.add_tensor(name, raw if heads is None else _permute(raw, heads), raw_dtype=qtype)

    packed("token_embd.weight", _EMBED_TYPE, (_VOCAB, _HIDDEN))
    head_dim = _HIDDEN // _HEADS
    for (layer, linear), qtype in _TYPES.items():
        shape = {
            "attn_k": (_KV * head_dim, _HIDDEN),
            "attn_v": (_KV * head_dim, _HIDDEN),
            "ffn_gate": (_FFN, _HIDDEN),
            "ffn_up": (_FFN, _HIDDEN),
            "ffn_down": (_HIDDEN, _FFN),
        }.get(linear, (_HIDDEN, _HIDDEN))
        packed(f"blk.{layer}.{linear}.weight", qtype, shape, {"attn_q": _HEADS, "attn_k": _KV}.get(linear))
    for name in [f"blk.{i}.{n}_norm.weight" for i in range(2) for n in ("attn", "ffn")] + ["output_norm.weight"]:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(_HIDDEN)).astype(np.float32))
    packed("output.weight", _HEAD_TYPE, (_VOCAB, _HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _greedy(model: Any, steps: int) -> list[int]:
    """Greedy tokens after the prompt: the prompt in one forward, then one token at a time through the cache."""
    ids = list(_PROMPT)
    with torch.no_grad():
        out = model.module(torch.tensor([ids]), use_cache=True)
        for _ in range(steps):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model.module(torch.tensor([ids[-1:]]), use_cache=True, cache=out.cache)
    return ids[len(_PROMPT) :]


def test_cpu_fast_runs_iq4_mxfp4_q5_on_the_block_kernel(tiny_iq4: Path) -> None:
    """cpu-fast: every IQ4_NL / IQ4_XS / MXFP4 / Q5_0 / Q5_1 linear and the IQ4_XS head on the GGUF-block kernel, interleaved at load
    (Q/K from their permuted rows), none on a bfloat16 copy or dequantized; prompts over ``small_rows`` exact (the
    ``dequantized`` backend's logits within 1e-5); decode within 2e-2 of the exact backend's logits with its top logit
    within 1e-4 and its greedy tokens; the read-in-place form bitwise the same."""
    fastcpu = pytest.importorskip("anyquant_cpu.engine")
    ok, reason = fastcpu.fast_cpu_capable()
    if not ok:
        pytest.skip(reason)
    from anyquant_cpu.kernels.linear import BlockLinear

    fast = _load(tiny_iq4, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_prefill="float32")
    exact = _load(tiny_iq4, "dequantized")
    info = fast.info["cpu_fast"]
    assert not info["bf16"] and not info["dequantized"] and "lm_head" not in info, info
    want_counts: dict[str, int] = {}
    for qtype in [*_TYPES.values(), _HEAD_TYPE]:
        want_counts[qtype.name] = want_counts.get(qtype.name, 0) + 1
    assert info["block_kernel"] == want_counts and info["interleaved"] == info["converted"] == len(_TYPES) + 1, info
    linears = {n: m for n, m in fast.module.named_modules() if isinstance(m, BlockLinear)}
    assert len(linears) == len(_TYPES) and all(m.interleaved for m in linears.values())
    assert {m.type_name for m in linears.values()} == {"IQ4_NL", "IQ4_XS", "MXFP4", "Q5_0", "Q5_1"}
    head = fast.module.get_output_embeddings()
    assert type(head).__name__ == "GGUFBlockHead" and head.block_type == "IQ4_XS"

    ids = torch.tensor([_PROMPT])
    # 12 rows > small_rows: the exact weights, dequantized by the kernel from the interleaved form
    with torch.no_grad():
        torch.testing.assert_close(fast.module(ids).logits, exact.module(ids).logits, rtol=1e-5, atol=1e-5)
    got = logits_after_prompt(fast, ids, 6)
    ref = logits_after_prompt(exact, ids, 6)
    err = float((got - ref).abs().max()) / float(ref.abs().max())
    assert err < 2e-2, err
    top = ref.argmax(-1, keepdim=True)
    assert torch.equal(got.argmax(-1, keepdim=True), top)
    assert float((got.gather(-1, top) - ref.gather(-1, top)).abs().max()) < 1e-4 * float(ref.abs().max())
    assert _greedy(fast, 12) == _greedy(exact, 12)

    in_place = _load(tiny_iq4, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_prefill="float32", cpu_fast_interleave=False)
    assert in_place.info["cpu_fast"]["in_place"] == info["converted"]
    assert torch.equal(logits_after_prompt(in_place, ids, 6), got)
