"""Property-based: malformed headers, configs, indexes and GGUF headers give only AnyquantError."""

from __future__ import annotations

import json
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyquant import Probe
from anyquant.errors import AnyquantError
from anyquant.registry import Registry

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(root: Path) -> None:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        probe = Probe.open(root)
        Registry(entry_points=True).detect(probe)
    except AnyquantError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0
    assert peak < 64 * 1024 * 1024


@SETTINGS
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=2**64 - 1) | st.none())
def test_random_safetensors_bytes(blob: bytes, length: int | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        raw = (struct.pack("<Q", length) if length is not None else b"") + blob
        (Path(d) / "model.safetensors").write_bytes(raw)
        _check(Path(d))


@SETTINGS
@given(json_values, st.binary(max_size=64))
def test_random_json_headers(value: object, data: bytes) -> None:
    header = json.dumps(value).encode()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
        _check(Path(d))


tensor_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F16", "BF16", "I32", "I16", "F32", "U8", "XX"]),
        "shape": st.lists(st.integers(min_value=-2, max_value=70), max_size=3),
        "data_offsets": st.lists(st.integers(min_value=-5, max_value=5000), min_size=0, max_size=3),
    }
)
names = st.sampled_from(
    ["a.qweight", "a.qzeros", "a.scales", "a.g_idx", "a.trellis", "a.suh", "a.svh", "a.weight", "b.q_weight", "x"]
)


@SETTINGS
@given(st.dictionaries(names, tensor_entry, max_size=6), json_values, st.booleans())
def test_structured_headers_and_configs(tensors: dict, config: object, index: bool) -> None:
    header = json.dumps(tensors).encode()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 5000)
        (root / "config.json").write_text(
            json.dumps(config if not isinstance(config, dict) else {"quantization_config": config})
        )
        if index:
            (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": config}))
        _check(root)


@SETTINGS
@given(st.binary(max_size=400))
def test_random_gguf_bytes(tail: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "m.gguf").write_bytes(b"GGUF" + tail)
        _check(Path(d))


@SETTINGS
@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=0, max_value=13),
    st.binary(max_size=64),
)
def test_gguf_counts(n_tensors: int, n_kv: int, vtype: int, rest: bytes) -> None:
    blob = (
        b"GGUF"
        + struct.pack("<IQQ", 3, n_tensors, n_kv)
        + struct.pack("<Q", 3)
        + b"key"
        + struct.pack("<I", vtype)
        + rest
    )
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "m.gguf").write_bytes(blob)
        _check(Path(d))
