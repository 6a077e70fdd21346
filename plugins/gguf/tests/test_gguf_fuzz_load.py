"""Mutated GGUF files through the whole path (issue #44, "done when"): a tiny Llama written with ``gguf.GGUFWriter``
(Q8_0 and Q4_0 linears, an F16 embedding, F32 norms, a byte-level tokenizer) gets a few bytes changed in its header
(metadata values, tensor infos) or its data (block scales, codes, floats), or is cut short; each mutant goes through
``anyquant.load`` on a backend and ``generate`` of two tokens. Only an :class:`~anyquant.errors.AnyquantError` may
come out (a typed refusal), or text: never another exception, a crash or a hang. Hypothesis runs it derandomized
(the same mutants on every run), bounded in examples and time.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import anyquant
from anyquant.errors import AnyquantError
from anyquant.headers import read_gguf_header
from anyquant_gguf.tokenizer import byte_alphabet

HIDDEN, FFN, VOCAB = 64, 128, 288
Q = GGMLQuantizationType


def _write(path: Path) -> Path:
    writer = GGUFWriter(str(path), "llama")
    for key, method, value in (
        ("block_count", "uint32", 1),
        ("context_length", "uint32", 64),
        ("embedding_length", "uint32", HIDDEN),
        ("feed_forward_length", "uint32", FFN),
        ("attention.head_count", "uint32", 4),
        ("attention.head_count_kv", "uint32", 2),
        ("attention.layer_norm_rms_epsilon", "float32", 1e-5),
        ("rope.freq_base", "float32", 10000.0),
    ):
        getattr(writer, f"add_{method}")(f"llama.{key}", value)
    vocab = [*byte_alphabet(), *(f"x{i}" for i in range(VOCAB - 257)), "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges(["Ġ t"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    rng = np.random.default_rng(0)

    def tensor(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType = Q.F32) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, data)
        elif qtype == Q.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (VOCAB, HIDDEN), Q.F16)
    tensor("output_norm.weight", (HIDDEN,))
    tensor("output.weight", (VOCAB, HIDDEN), Q.Q8_0)
    tensor("blk.0.attn_norm.weight", (HIDDEN,))
    tensor("blk.0.ffn_norm.weight", (HIDDEN,))
    for name, shape, qtype in (
        ("attn_q", (HIDDEN, HIDDEN), Q.Q4_0),
        ("attn_k", (HIDDEN // 2, HIDDEN), Q.Q8_0),
        ("attn_v", (HIDDEN // 2, HIDDEN), Q.Q8_0),
        ("attn_output", (HIDDEN, HIDDEN), Q.Q4_0),
        ("ffn_gate", (FFN, HIDDEN), Q.Q4_0),
        ("ffn_up", (FFN, HIDDEN), Q.Q8_0),
        ("ffn_down", (HIDDEN, FFN), Q.Q4_0),
    ):
        tensor(f"blk.0.{name}.weight", shape, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """The valid file's bytes and where its tensor data starts (header and data are mutated alike)."""
    path = _write(tmp_path_factory.mktemp("fuzz") / "base.gguf")
    model = anyquant.load(path, backend="dequantized")
    assert isinstance(model.generate(" t", max_new_tokens=2), str)  # the unmutated file loads and generates
    return path.read_bytes(), read_gguf_header(path, path.name).data_offset


#: (in the header rather than the data: one in three, where in that region, the new byte)
mutation = st.tuples(st.sampled_from([True, False, False]), st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255))


@settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    changes=st.lists(mutation, min_size=1, max_size=6),
    cut=st.sampled_from([None, None, None, 0.2, 0.5, 0.9, 0.999]),
    backend=st.sampled_from(["dequantized", "packed", "cpu-fast"]),
)
def test_mutated_files_load_and_generate_or_refuse(
    original: tuple[bytes, int],
    tmp_path: Path,
    changes: list[tuple[bool, float, int]],
    cut: float | None,
    backend: str,
) -> None:
    raw, data_offset = original
    blob = bytearray(raw)
    for in_header, where, value in changes:
        start, end = (8, data_offset) if in_header else (data_offset, len(raw))  # past the magic and version
        blob[start + int(where * (end - start))] = value
    if cut is not None:
        blob = blob[: int(cut * len(blob))]
    path = tmp_path / f"m{time.monotonic_ns()}.gguf"
    path.write_bytes(bytes(blob))
    t0 = time.perf_counter()
    try:
        model = anyquant.load(path, backend=backend)
        text = model.generate(" t", max_new_tokens=2)
        assert isinstance(text, str)
    except AnyquantError:
        pass
    finally:
        path.unlink(missing_ok=True)
    assert time.perf_counter() - t0 < 30  # bounded work (a generous bound, not a timing)
