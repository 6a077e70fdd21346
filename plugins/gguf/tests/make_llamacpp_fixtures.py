"""Write the llama.cpp-made fixtures of ``test_gguf_llamacpp_fixtures.py`` (issue #42 §1/§2).

Not run by the tests (they only read what this wrote into ``fixtures/``). Run it with a Python that has
``llama-cpp-python`` (and numpy; no torch needed)::

    /path/to/llvenv/bin/python plugins/gguf/tests/make_llamacpp_fixtures.py --llama-cpp /path/to/llama.cpp

``--llama-cpp`` is the llama.cpp source tree the ``llama-cpp-python`` build was made from (e.g. the
``vendor/llama.cpp`` of its sdist): its ``gguf-py`` writes the float32 input files and reads the results.

For each fixture it

1. writes a tiny random Llama in float32 with llama.cpp's ``gguf-py`` (hidden 256 so that every super-block type
   applies, 4 heads of 64, 2 KV heads, FFN 256, 2 layers, a 320-token byte-level vocabulary; the token embedding
   leads the residual stream, so that llama.cpp's 8-bit activations move the logits by about 1%, see
   ``make_gguf_fixtures.build_model``);
2. quantizes it with llama.cpp's own ``llama_model_quantize``, one GGML type per tensor chosen with the
   quantizer's tensor-type overrides (``tt_overrides``) and an importance matrix for every tensor (``imatrix``:
   random positive column weights, the mean of squared random activations), which the IQ1/IQ2 types require;
   so that the two files hold every type anyquant reads beyond Q4_0..Q6_K: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
   IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4, and Q5_0, Q5_1, Q2_K, Q3_K (plus Q4_1, Q4_K, Q6_K
   and Q8_0 in the free places);
3. a third, ``llamacpp-mxfp4-moe``, is a one-layer Qwen3-MoE (4 experts of FFN 128, 2 per token, tied
   embeddings) quantized with the ``MXFP4_MOE`` file type: its 3-D expert tensors MXFP4 by llama.cpp's own choice;
4. the second fixture is a split file: its float32 input is written in 3 parts (``gguf-py``'s split writer) and
   ``llama_model_quantize`` with ``keep_split`` writes the quantized model in 3 parts itself
   (``NAME-0000K-of-00003.gguf``, llama.cpp's split keys);
5. records, in ``fixtures/<name>.json``: every tensor's dequantized values as llama.cpp computes them (ggml's own
   ``to_float`` of the tensor's type, from ``ggml_get_type_traits`` in libggml-base, over the stored bytes: the
   sha256 of the float32 result, its first values and its shape), and llama.cpp's logits for every position of a
   fixed token sequence (``llama_cpp.Llama``, ``logits_all``, one thread, the split one loaded from its first part).

llama.cpp's AMX buffer type crashes on some hosts (ggml-org/llama.cpp#20824): the recording turns the extra
buffer types off. The output is deterministic for a given llama.cpp build.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 256, 4, 2, 2, 320
HEAD_DIM = HIDDEN // HEADS
N_CTX = 64
#: the token ids whose logits are recorded (no tokenizer involved)
TOKENS = [1, 5, 9, 33, 70, 120, 11, 300, 319, 4, 200, 150, 88, 17, 260, 42, 7, 99, 255, 64]
#: the Qwen3-MoE fixture: experts, experts per token, expert FFN (a multiple of MXFP4's block of 32), one layer
EXPERTS, EXPERTS_USED, EXPERT_FFN = 4, 2, 128

#: fixture -> (seed, {GGUF tensor name: GGML type name}, split parts or 0); every tensor is overridden to its
#: type, except in the MoE one, quantized by llama.cpp's MXFP4_MOE file type: its experts MXFP4 (what it chooses),
#: the other tensors overridden to small types (the file type would make them Q8_0)
FIXTURE_TYPES: dict[str, tuple[int, dict[str, str], int]] = {
    "llamacpp-types-a": (
        11,
        {
            "token_embd.weight": "Q5_1",
            "blk.0.attn_q.weight": "IQ2_XXS",
            "blk.0.attn_k.weight": "IQ2_XS",
            "blk.0.attn_v.weight": "IQ2_S",
            "blk.0.attn_output.weight": "IQ3_XXS",
            "blk.0.ffn_gate.weight": "IQ3_S",
            "blk.0.ffn_up.weight": "IQ1_S",
            "blk.0.ffn_down.weight": "IQ1_M",
            "blk.1.attn_q.weight": "IQ4_NL",
            "blk.1.attn_k.weight": "IQ4_XS",
            "blk.1.attn_v.weight": "TQ1_0",
            "blk.1.attn_output.weight": "TQ2_0",
            "blk.1.ffn_gate.weight": "MXFP4",
            "blk.1.ffn_up.weight": "NVFP4",
            "blk.1.ffn_down.weight": "Q5_0",
            "output.weight": "Q6_K",
        },
        0,
    ),
    "llamacpp-types-b": (
        12,
        {
            "token_embd.weight": "Q4_1",
            "blk.0.attn_q.weight": "IQ1_M",
            "blk.0.attn_k.weight": "IQ1_S",
            "blk.0.attn_v.weight": "IQ3_S",
            "blk.0.attn_output.weight": "IQ2_S",
            "blk.0.ffn_gate.weight": "Q2_K",
            "blk.0.ffn_up.weight": "Q3_K",
            "blk.0.ffn_down.weight": "IQ2_XXS",
            "blk.1.attn_q.weight": "MXFP4",
            "blk.1.attn_k.weight": "TQ2_0",
            "blk.1.attn_v.weight": "NVFP4",
            "blk.1.attn_output.weight": "IQ4_XS",
            "blk.1.ffn_gate.weight": "Q4_K",
            "blk.1.ffn_up.weight": "IQ4_NL",
            "blk.1.ffn_down.weight": "IQ3_XXS",
            "output.weight": "Q8_0",
        },
        3,
    ),
    "llamacpp-mxfp4-moe": (
        13,
        {
            "token_embd.weight": "Q6_K",
            "blk.0.attn_q.weight": "Q4_K",
            "blk.0.attn_k.weight": "Q5_K",
            "blk.0.attn_v.weight": "Q4_0",
            "blk.0.attn_output.weight": "Q4_K",
            "blk.0.ffn_gate_exps.weight": "MXFP4",
            "blk.0.ffn_up_exps.weight": "MXFP4",
            "blk.0.ffn_down_exps.weight": "MXFP4",
        },
        0,
    ),
}
#: the fixtures quantized by a llama.cpp file type (the rest: Q8_0, every tensor overridden)
FTYPES = {"llamacpp-mxfp4-moe": "MXFP4_MOE"}
ARCH = {"llamacpp-mxfp4-moe": "qwen3moe"}


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable-character table (``bytes_to_unicode``), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def model_tensors(seed: int) -> dict[str, np.ndarray]:
    """The tiny Llama's float32 tensors, GGUF names, numpy shape ``[out, in]`` (Q/K rows as llama.cpp's
    converter stores them: random weights, so no permutation is needed to make them so)."""
    rng = np.random.default_rng(seed)

    def linear(out: int, inp: int, std: float = 0.03) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * std).astype(np.float32)

    embed = (rng.standard_normal((VOCAB, HIDDEN)) * 0.6).astype(np.float32)
    tensors = {"token_embd.weight": embed}
    for layer in range(LAYERS):
        p = f"blk.{layer}."
        tensors[p + "attn_norm.weight"] = (1 + 0.3 * rng.standard_normal(HIDDEN)).astype(np.float32)
        tensors[p + "attn_q.weight"] = linear(HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "attn_k.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "attn_v.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "attn_output.weight"] = linear(HIDDEN, HEADS * HEAD_DIM)
        tensors[p + "ffn_norm.weight"] = (1 + 0.3 * rng.standard_normal(HIDDEN)).astype(np.float32)
        tensors[p + "ffn_gate.weight"] = linear(FFN, HIDDEN)
        tensors[p + "ffn_up.weight"] = linear(FFN, HIDDEN)
        tensors[p + "ffn_down.weight"] = linear(HIDDEN, FFN)
    signs = np.where(rng.random(HIDDEN) < 0.5, -1.0, 1.0)
    tensors["output_norm.weight"] = (signs * (0.8 + 0.4 * rng.random(HIDDEN))).astype(np.float32)
    tensors["output.weight"] = (embed + rng.standard_normal(embed.shape) * 0.3).astype(np.float32)
    return tensors


def moe_tensors(seed: int) -> dict[str, np.ndarray]:
    """A tiny Qwen3-MoE (one layer, tied embeddings, Q/K norms): 4 experts, 2 per token, a decisive router (its
    logits of about 4, so that no top-2 choice is a near tie llama.cpp's rounding could flip)."""
    rng = np.random.default_rng(seed)

    def linear(*shape: int, std: float = 0.03) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"token_embd.weight": (rng.standard_normal((VOCAB, HIDDEN)) * 0.6).astype(np.float32)}
    tensors |= {
        "blk.0.attn_norm.weight": norm(HIDDEN),
        "blk.0.attn_q.weight": linear(HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": linear(HIDDEN, HEADS * HEAD_DIM),
        "blk.0.attn_q_norm.weight": norm(HEAD_DIM),
        "blk.0.attn_k_norm.weight": norm(HEAD_DIM),
        "blk.0.ffn_norm.weight": norm(HIDDEN),
        "blk.0.ffn_gate_inp.weight": linear(EXPERTS, HIDDEN, std=0.25),
        "blk.0.ffn_gate_exps.weight": linear(EXPERTS, EXPERT_FFN, HIDDEN),
        "blk.0.ffn_up_exps.weight": linear(EXPERTS, EXPERT_FFN, HIDDEN),
        "blk.0.ffn_down_exps.weight": linear(EXPERTS, HIDDEN, EXPERT_FFN),
    }
    signs = np.where(rng.random(HIDDEN) < 0.5, -1.0, 1.0)
    tensors["output_norm.weight"] = (signs * (0.8 + 0.4 * rng.random(HIDDEN))).astype(np.float32)
    return tensors


def write_f32(path: Path, tensors: dict[str, np.ndarray], parts: int, arch: str = "llama") -> Path:
    """The float32 model with llama.cpp's gguf-py; ``parts``: written in that many parts (0: whole)."""
    import gguf

    split: dict[str, Any] = {}
    if parts:
        split = {"split_max_tensors": -(-len(tensors) // parts)}
    writer = gguf.GGUFWriter(str(path), arch, **split)
    writer.add_name("anyquant llama.cpp fixture")
    writer.add_block_count(1 if arch == "qwen3moe" else LAYERS)
    if arch == "qwen3moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(EXPERTS_USED)
        writer.add_expert_feed_forward_length(EXPERT_FFN)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(0)  # ALL_F32
    vocab = [*byte_alphabet(), *(f"x{i}" for i in range(VOCAB - 257)), "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if parts:
        return path.with_name(f"{path.stem}-00001-of-{parts:05d}.gguf")
    return path


def importance(tensors: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """An importance matrix: per linear, the mean of squared random activations of its input columns."""
    rng = np.random.default_rng(seed + 1000)
    out = {}
    for name, array in tensors.items():
        if array.ndim == 2 and name != "token_embd.weight":
            acts = rng.standard_normal((64, array.shape[1])) * rng.uniform(0.5, 2.0, array.shape[1])
            out[name] = np.ascontiguousarray((acts**2).mean(axis=0), dtype=np.float32)
    return out


# --------------------------------------------------------------------------- llama.cpp side


def _libs() -> tuple[ctypes.CDLL, Any]:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    return ctypes.CDLL(str(lib_dir / "libggml-base.so")), llama_cpp


class _TypeTraits(ctypes.Structure):  # ggml.h's struct ggml_type_traits of this llama.cpp
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


def ggml_to_float(ggml_base: ctypes.CDLL, type_id: int, raw: np.ndarray, n: int) -> np.ndarray:
    """ggml's own dequantization of ``raw`` (the stored bytes of ``n`` values of type ``type_id``)."""
    get = ggml_base.ggml_get_type_traits
    get.restype, get.argtypes = ctypes.POINTER(_TypeTraits), [ctypes.c_int]
    traits = get(type_id).contents
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    assert raw.size == n // traits.blck_size * traits.type_size, (type_id, raw.size, n)
    if type_id == 0:  # F32: ggml has no to_float, the bytes are the values
        return raw.view(np.float32).copy()
    out = np.empty(n, dtype=np.float32)
    _TO_FLOAT(traits.to_float)(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
    return out


def quantize(
    f32_first: Path, out: Path, types: dict[str, str], imatrix: dict[str, np.ndarray], split: bool, ftype: str
) -> None:
    import gguf

    _, llama_cpp = _libs()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    params.keep_split = split
    overrides = (llama_cpp.llama_model_tensor_override * (len(types) + 1))()
    for i, (name, type_name) in enumerate(types.items()):
        overrides[i].pattern = ("^" + name.replace(".", r"\.") + "$").encode()
        overrides[i].type = int(gguf.GGMLQuantizationType[type_name])
    overrides[len(types)].pattern = None
    params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
    for i, (name, values) in enumerate(imatrix.items()):
        entries[i].name = name.encode()
        entries[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = values.size
    entries[len(imatrix)].name = None
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(str(f32_first).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")


def dequant_record(paths: list[Path]) -> dict[str, Any]:
    """Per tensor (every part): type, GGUF shape, sha256 of ggml's float32 dequantization, its first values."""
    import gguf

    ggml_base, _ = _libs()
    record = {}
    for path in paths:
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:
            values = ggml_to_float(ggml_base, int(t.tensor_type), np.asarray(t.data), int(t.n_elements))
            record[t.name] = {
                "part": path.name,
                "type": t.tensor_type.name,
                "shape": [int(d) for d in t.shape],
                "sha256": hashlib.sha256(values.tobytes()).hexdigest(),
                "head": [float(v) for v in values[:8]],
                "absmax": float(np.abs(values).max()),
            }
    return record


def llama_logits(first: Path) -> np.ndarray:
    _, llama_cpp = _libs()
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def no_extra_bufts() -> Any:  # the AMX buffer type crashes (ggml-org/llama.cpp#20824)
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = no_extra_bufts
    llm = llama_cpp.Llama(
        str(first),
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=1,
        n_threads_batch=1,
        logits_all=True,
        seed=0,
        verbose=False,
    )
    llm.reset()
    llm.eval(TOKENS)
    logits = np.array(llm.scores[: len(TOKENS)], dtype=np.float32)
    llm.close()
    return logits


def make(name: str, work: Path) -> None:
    import llama_cpp

    seed, types, parts = FIXTURE_TYPES[name]
    arch = ARCH.get(name, "llama")
    tensors = moe_tensors(seed) if arch == "qwen3moe" else model_tensors(seed)
    f32_dir = work / name
    f32_dir.mkdir(parents=True, exist_ok=True)
    f32_first = write_f32(f32_dir / f"{name}.f32.gguf", tensors, parts, arch)
    out_dir = work / f"{name}-out"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / (name if parts else f"{name}.gguf")  # a split's parts: llama.cpp's PREFIX-0000K-of-0000N.gguf
    ftype = FTYPES.get(name, "Q8_0")
    overrides = {n: t for n, t in types.items() if not (ftype == "MXFP4_MOE" and "_exps." in n)}
    quantize(f32_first, out, overrides, importance(tensors, seed), bool(parts), ftype)
    if parts:
        written = sorted(out_dir.glob(f"{name}-*-of-*.gguf"))
        assert len(written) == parts, written
    else:
        written = [out]
    FIXTURES.mkdir(exist_ok=True)
    finals = []
    for path in written:
        final = FIXTURES / path.name
        shutil.copyfile(path, final)
        finals.append(final)
    tensors_record = dequant_record(finals)
    got = {n: r["type"] for n, r in tensors_record.items() if n in types}
    if got != types:
        raise RuntimeError(f"llama.cpp chose other types than asked: {set(got.items()) ^ set(types.items())}")
    logits = llama_logits(finals[0])
    top2 = np.sort(logits, axis=1)[:, -2:]
    data = {
        "fixture": name,
        "files": [p.name for p in finals],
        "llama_cpp_python": llama_cpp.__version__,
        "ggml_library": sorted(p.name for p in (Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.so.*.*")),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "arch": arch,
        "ftype": ftype,
        "n_ctx": N_CTX,
        "tokens": TOKENS,
        "requested_types": types,
        "tensors": tensors_record,
        "logits": [[round(float(v), 5) for v in row] for row in logits],
        "argmax": [int(i) for i in logits.argmax(axis=1)],
        "top2_margin": [round(float(m), 5) for m in (top2[:, 1] - top2[:, 0])],
    }
    (FIXTURES / f"{name}.json").write_text(json.dumps(data) + "\n")
    sizes = ", ".join(f"{p.name} {p.stat().st_size / 1e3:.0f} KB" for p in finals)
    print(f"{name}: {sizes}; argmax {data['argmax']}; margins {data['top2_margin']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (its gguf-py)")
    parser.add_argument("--fixtures", nargs="*", default=list(FIXTURE_TYPES), choices=list(FIXTURE_TYPES))
    args = parser.parse_args()
    sys.path.insert(0, str(args.llama_cpp.resolve() / "gguf-py"))
    if "yaml" not in sys.modules:  # gguf-py imports PyYAML for model cards only, which this does not read
        try:
            import yaml  # noqa: F401
        except ImportError:
            import types

            sys.modules["yaml"] = types.ModuleType("yaml")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.fixtures:
            make(name, Path(tmp))


if __name__ == "__main__":
    main()
