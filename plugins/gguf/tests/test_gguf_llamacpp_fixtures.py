"""The newer GGUF types and a split file, judged by llama.cpp itself (issue #42 §1/§2).

``fixtures/llamacpp-types-a.gguf`` and the 3-part ``fixtures/llamacpp-types-b-0000K-of-00003.gguf`` are tiny random
Llamas (hidden 256, 2 layers, 4 heads / 2 KV heads, FFN 256, 320 tokens) that llama.cpp's own
``llama_model_quantize`` quantized from float32, one GGML type per tensor (its tensor-type overrides, with an
importance matrix for every linear, which IQ1/IQ2 need): between them IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4, Q5_0, Q5_1, Q2_K, Q3_K, Q4_1, Q4_K, Q6_K and Q8_0. The second
was written in 3 parts by llama.cpp itself (``keep_split``: its split keys and part names). ``llamacpp-mxfp4-moe.gguf``
is a one-layer Qwen3-MoE (4 experts of FFN 128, 2 per token, tied embeddings) quantized with llama.cpp's
``MXFP4_MOE`` file type: its 3-D expert tensors MXFP4, as gpt-oss ships them (the others overridden to small K/Q4_0
types). ``fixtures/<name>.json``
holds what llama.cpp (llama-cpp-python, version inside) computed: for every tensor the sha256 of ggml's own
``to_float`` dequantization (float32 bytes, stored row order), and the logits of every position of a fixed token
sequence (the split one loaded from its first part). ``make_llamacpp_fixtures.py`` wrote them; nothing here runs
llama.cpp.

anyquant's dequantizer (``dequantize_blocks_torch``, what the ``dequantized`` backend loads every weight with) must
equal ggml's bit for bit. The logits cannot: llama.cpp multiplies quantized weights with 8-bit activations (Q8_0 /
Q8_K, about 0.4-0.8% rounding noise on every quantized matmul's input) and keeps its KV cache in float16, anyquant's
dequantized backend computes in float32. Measured when the fixtures were written (``MEASURED``): max |difference|
0.9%, 0.8% and 0.75% of the largest |llama.cpp logit|, a fitted gain within 3e-4 of 1, every argmax equal. The tolerance
(``LOGIT_TOL`` 2e-2, the one ``test_gguf_families.py`` uses for the same reason) is about twice that; the argmax must
agree wherever llama.cpp's top-2 margin exceeds twice the tolerated difference; the gain of a least-squares fit of
anyquant's logits on llama.cpp's within ``GAIN_TOL``.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant_gguf.dequant import dequantize_blocks_torch
from anyquant_gguf.reader import field_value, get_tensor, load_raw, open_gguf

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ("llamacpp-types-a", "llamacpp-types-b", "llamacpp-mxfp4-moe")
#: the types these fixtures exist for (issue #42 §1): each must be in one of them, made by llama.cpp
REQUIRED_TYPES = {
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
}  # fmt: skip
#: max |anyquant - llama.cpp logit| / max |llama.cpp logit| (llama.cpp's 8-bit activations and float16 KV cache)
LOGIT_TOL = 2e-2
#: |g - 1| for g = <ours, ref> / <ref, ref>: a scale error (a wrong block scale, a missing factor) shows here
GAIN_TOL = 5e-3
#: what the dequantized backend measured against these records, for the record
MEASURED = {
    "llamacpp-types-a": (9.0e-3, 2.6e-4),
    "llamacpp-types-b": (7.7e-3, 1.4e-4),
    "llamacpp-mxfp4-moe": (7.5e-3, 0.9e-4),
}


@cache
def _record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    return data


def _parts(name: str) -> list[Path]:
    return [FIXTURES / f for f in _record(name)["files"]]


def _hash_mismatches(first: Path, tensors: dict[str, Any]) -> list[str]:
    """Every tensor of the model at ``first`` (every part of a split one) dequantized by anyquant vs llama.cpp's
    recorded sha256: one message per mismatch, naming the tensor, its type and the first differing element
    (against the recorded first values), or the part it was found in when that is not the recorded one."""
    reader = open_gguf(first)  # a split model's first part opens every part
    problems = [f"{n}: in llama.cpp's record, not in anyquant's reader" for n in set(tensors) - set(_names(reader))]
    for part in reader.parts:
        for name in _names(open_gguf(part.path, parts=())):  # this part's own tensors
            tensor = get_tensor(reader, name)  # dequantized through the whole model's reader
            problems += _tensor_mismatch(reader, Path(part.path).name, tensor, tensors.get(name))
    return problems


def _names(reader: Any) -> list[str]:
    return [t.name for t in reader.tensors]


def _tensor_mismatch(reader: Any, part: str, tensor: Any, want: dict[str, Any] | None) -> list[str]:
    if want is None:
        return [f"{tensor.name}: not in llama.cpp's record"]
    if want["part"] != part:
        return [f"{tensor.name}: read from {part}, llama.cpp's record has it in {want['part']}"]
    raw = load_raw(reader, tensor.name, unpermute=False)  # stored row order, as ggml dequantizes it
    if raw.qtype.name != want["type"] or [int(d) for d in tensor.shape] != want["shape"]:
        return [f"{tensor.name}: {raw.qtype.name} {list(tensor.shape)} != {want['type']} {want['shape']}"]
    values = dequantize_blocks_torch(raw.data, raw.qtype, raw.shape).contiguous()
    if hashlib.sha256(values.numpy().tobytes()).hexdigest() == want["sha256"]:
        return []
    flat, head = values.reshape(-1), torch.tensor(want["head"], dtype=torch.float32)
    bits = flat[: len(head)].view(torch.int32) != head.view(torch.int32)
    first = f"element {int(bits.nonzero()[0, 0])}" if bits.any() else f"after element {len(head) - 1}"
    return [
        f"{tensor.name} ({raw.qtype.name}): anyquant's float32 differs from ggml's to_float ({first}; "
        f"llama.cpp's first values {want['head'][:4]}, anyquant's {flat[:4].tolist()})"
    ]


def _compare_logits(ours: torch.Tensor, rec: dict[str, Any]) -> dict[str, float]:
    """Assert anyquant's logits agree with llama.cpp's record; returns the measured numbers."""
    ref = torch.tensor(rec["logits"], dtype=torch.float32)
    assert ours.shape == ref.shape, (tuple(ours.shape), tuple(ref.shape))
    scale = float(ref.abs().max())
    rel = float((ours - ref).abs().max()) / scale
    gain = float((ours * ref).sum() / (ref * ref).sum())
    margins = torch.tensor(rec["top2_margin"])
    clear = margins > 2 * LOGIT_TOL * scale  # no difference within the tolerance could flip these
    assert int(clear.sum()) >= len(margins) // 2, "too few clear positions for the argmax check to mean anything"
    agree = ours.argmax(-1) == ref.argmax(-1)
    assert rel < LOGIT_TOL, f"max |logit difference| {rel:.3e} of the largest |llama.cpp logit| (tolerance {LOGIT_TOL})"
    assert abs(gain - 1) < GAIN_TOL, f"fitted gain {gain:.6f} of anyquant's logits on llama.cpp's"
    bad = (~agree & clear).nonzero().reshape(-1).tolist()
    assert not bad, f"argmax differs at positions {bad} whose top-2 margin is clear"
    return {"rel": rel, "gain": gain}


@cache
def _model(name: str) -> Any:
    return anyquant.load(_parts(name)[0], backend="dequantized")


def _logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model.module(torch.tensor([tokens])).logits[0].float()
    return out


@pytest.fixture(scope="module", autouse=True)
def _drop_models() -> Any:
    yield
    _model.cache_clear()


@pytest.fixture(params=NAMES)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_fixture_records() -> None:
    """The fixtures are what the tests assume: llama.cpp's quantization, small, every required type present."""
    seen: set[str] = set()
    for fixture in NAMES:
        rec = _record(fixture)
        assert rec["llama_cpp_python"] and rec["tensors"] and len(rec["logits"]) == len(rec["tokens"])
        total = sum(p.stat().st_size for p in _parts(fixture))
        assert total < 600_000, total
        for tensor, type_name in rec["requested_types"].items():
            assert rec["tensors"][tensor]["type"] == type_name, tensor  # llama.cpp used the type asked for
        seen |= {t["type"] for t in rec["tensors"].values()}
    assert REQUIRED_TYPES <= seen, REQUIRED_TYPES - seen
    moe = _record("llamacpp-mxfp4-moe")
    assert (moe["arch"], moe["ftype"]) == ("qwen3moe", "MXFP4_MOE")
    experts = {n: t for n, t in moe["tensors"].items() if "_exps." in n}
    assert len(experts) == 3 and all(t["type"] == "MXFP4" and t["shape"][2] == 4 for t in experts.values())


def test_split_written_by_llama_cpp() -> None:
    """The split fixture's parts carry llama.cpp's split keys; every part holds some of the tensors."""
    rec = _record("llamacpp-types-b")
    parts = _parts("llamacpp-types-b")
    assert [p.name for p in parts] == [f"llamacpp-types-b-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    model = open_gguf(parts[0])  # the first part opens all three
    assert [Path(p.path).name for p in model.parts] == [p.name for p in parts]
    for k, part in enumerate(model.parts):
        assert field_value(part, "split.no") == k and field_value(part, "split.count") == 3
        alone = open_gguf(parts[k], parts=())  # this part by itself
        assert alone.tensors, part.path
        assert {t.name for t in alone.tensors} == {n for n, t in rec["tensors"].items() if t["part"] == parts[k].name}
    assert field_value(model, "split.tensors.count") == len(rec["tensors"]) == len(model.tensors)


def test_dequantization_bit_exact_with_ggml(name: str) -> None:
    """Every tensor, every part: anyquant's float32 dequantization has the sha256 of ggml's own to_float."""
    rec = _record(name)
    problems = _hash_mismatches(_parts(name)[0], rec["tensors"])
    assert not problems, "\n".join(problems)


def test_hash_mismatch_names_the_tensor() -> None:
    """The bit-exact check can fail: a record whose hash of one IQ1_M tensor is wrong is reported by name."""
    rec = _record("llamacpp-types-a")
    tensors = json.loads(json.dumps(rec["tensors"]))
    tensors["blk.0.ffn_down.weight"]["sha256"] = "0" * 64
    tensors["blk.1.ffn_up.weight"]["head"][3] += 1.0  # and a wrong value: its index is named
    tensors["blk.1.ffn_up.weight"]["sha256"] = "0" * 64
    problems = _hash_mismatches(_parts("llamacpp-types-a")[0], tensors)
    assert len(problems) == 2, problems
    assert problems[0].startswith("blk.0.ffn_down.weight (IQ1_M)") and "after element 7" in problems[0]
    assert problems[1].startswith("blk.1.ffn_up.weight (NVFP4)") and "(element 3;" in problems[1]


def test_dequantized_logits_match_llama_cpp(name: str) -> None:
    """sdk.load(first part, backend="dequantized"): logits within LOGIT_TOL of llama.cpp's, gain within GAIN_TOL,
    the argmax equal wherever the top-2 margin is clear (the split fixture loaded from its first part)."""
    rec = _record(name)
    model = _model(name)
    assert (model.format, model.backend) == ("gguf", "dequantized")
    measured = _compare_logits(_logits(model, rec["tokens"]), rec)
    assert measured["rel"] < 2 * MEASURED[name][0], measured  # no drift far from what was measured


def test_logit_check_can_fail() -> None:
    """The logit comparison rejects a different model: fixture a's logits against fixture b's record, and a
    model whose one NVFP4 tensor is scaled by 1.25 (a scale error of the kind a wrong E4M3 decode makes)."""
    rec_b = _record("llamacpp-types-b")
    with pytest.raises(AssertionError):
        _compare_logits(_logits(_model("llamacpp-types-a"), rec_b["tokens"]), rec_b)
    model = _model("llamacpp-types-b")
    v_proj = model.module.model.layers[1].self_attn.v_proj  # the NVFP4 tensor blk.1.attn_v
    hook = v_proj.register_forward_hook(lambda _module, _args, out: out * 1.25)
    try:
        with pytest.raises(AssertionError):
            _compare_logits(_logits(model, rec_b["tokens"]), rec_b)
    finally:
        hook.remove()
    _compare_logits(_logits(model, rec_b["tokens"]), rec_b)
