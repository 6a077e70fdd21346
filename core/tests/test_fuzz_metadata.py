"""Property-based: mutated GGUF metadata of a small valid file, and config.json fields of every type, give
only typed errors (HeaderError, ConfigError), and a GGUF header read stays within its budget."""

from __future__ import annotations

import json
import math
import struct
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyquant import Probe
from anyquant.errors import AnyquantError, ConfigError, HeaderError
from anyquant.headers import MAX_GGUF_HEADER, _parse_gguf, _Reader
from anyquant.registry import Registry

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _small_gguf() -> bytes:
    """A valid GGUF v3: a string, a u32, a short string array, a long float array (summarised), one tensor."""
    kv = [
        _s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
        _s("llama.block_count") + struct.pack("<II", 4, 1),
        _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + _s("a") + _s("b") + _s("c"),
        _s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 100) + b"\0" * 400,
    ]
    tensor = _s("token_embd.weight") + struct.pack("<IQQIQ", 2, 4, 3, 0, 0)  # F32 4x3 at offset 0
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv)) + b"".join(kv) + tensor
    head += b"\0" * (-len(head) % 32)
    return head + b"\0" * 48


GGUF = _small_gguf()


class _Counting:
    def __init__(self, fh: Any) -> None:
        self.fh, self.bytes_read = fh, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        return int(self.fh.seek(pos, whence))

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.fh.read(n)
        self.bytes_read += len(data)
        return data


def test_the_seed_file_is_valid() -> None:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "m.gguf").write_bytes(GGUF)
        (g,) = Probe.open(Path(d)).gguf
        assert g.architecture == "llama" and g.array_lengths["tokenizer.ggml.scores"] == 100
        assert [t.name for t in g.tensors] == ["token_embd.weight"]


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(min_value=0, max_value=len(GGUF) - 1), st.integers(0, 255)), max_size=8),
    st.integers(min_value=4, max_value=len(GGUF)),
    st.integers(min_value=0, max_value=64 << 20),
)
def test_mutated_gguf_metadata(edits: list[tuple[int, int]], cut: int, sparse_tail: int) -> None:
    blob = bytearray(GGUF)
    for at, value in edits:
        blob[at] = value
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.gguf"
        path.write_bytes(bytes(blob[:cut]))
        with path.open("r+b") as fh:
            fh.truncate(cut + sparse_tail)  # room (a hole) for counts and lengths the edits made large
        size = path.stat().st_size
        with path.open("rb") as raw:
            fh = _Counting(raw)
            try:
                _parse_gguf(_Reader(fh, size, "m.gguf"), "m.gguf", size)  # type: ignore[arg-type]
            except HeaderError:
                pass
        # what is read is bounded by the header budget (plus one read-ahead), never by the file
        assert fh.bytes_read <= MAX_GGUF_HEADER + (1 << 20)
        try:
            Registry(entry_points=True).detect(Probe.open(Path(d)))
        except AnyquantError:
            pass


_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "quantization_config",
    "model_type",
    "torch_dtype",
    "tie_word_embeddings",
)
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(["factor", "rope_theta", "rope_type", "bits", "x"]), children, max_size=3)
    ),
    max_leaves=8,
)


@SETTINGS
@given(st.dictionaries(st.sampled_from(_CONFIG_KEYS), _values, max_size=6))
def test_config_fields(fields: dict[str, Any]) -> None:
    from anyquant_runtime.build import _SIZE_KEYS, check_config

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **fields}
    try:
        check_config(config, tensors=10)
    except ConfigError:
        pass
    else:  # accepted: every size is a positive int, every number finite
        for key in _SIZE_KEYS:
            assert config.get(key) is None or (type(config[key]) is int and config[key] >= 1)
        eps = config.get("rms_norm_eps")
        assert eps is None or isinstance(eps, dict) or (not isinstance(eps, bool) and math.isfinite(eps))
    with tempfile.TemporaryDirectory() as d:
        text = json.dumps(config, allow_nan=True)
        (Path(d) / "config.json").write_text(text)
        try:
            Registry(entry_points=True).detect(Probe.open(Path(d)))
        except AnyquantError:
            pass
