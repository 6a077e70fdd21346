"""SafetensorsSource: tensors read with pread at the probe's offsets, equal to safetensors' own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from anyquant import Probe
from anyquant.errors import CheckpointError, MissingTensorError
from anyquant_runtime.tensors import SafetensorsSource

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _write(root: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        x = torch.randn(3, 5, 7, generator=g) * 50
        tensors[f"t{i}.{str(dtype).split('.')[-1]}"] = x.to(dtype) if dtype != torch.bool else x > 0
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    save_file({k: v for k, v in tensors.items() if k.startswith(("t0", "t1", "t2", "scalar"))}, root / "a.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith(("t0", "t1", "t2", "scalar"))}, root / "b.safetensors"
    )
    return tensors


def test_every_dtype_equals_safetensors(tmp_path: Path) -> None:
    tensors = _write(tmp_path)
    source = SafetensorsSource(Probe.open(tmp_path))
    assert set(source.keys()) == set(tensors)
    for name, expected in tensors.items():
        got = source.get(name)
        file = "a.safetensors" if name.startswith(("t0", "t1", "t2", "scalar")) else "b.safetensors"
        with safe_open(tmp_path / file, framework="pt") as fh:
            theirs = fh.get_tensor(name)
        assert got.dtype == theirs.dtype == expected.dtype and got.shape == theirs.shape == expected.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8))  # the bytes
    assert source.unused() == []
    source.close()
    assert torch.equal(source.get("t8.float32"), tensors["t8.float32"])  # reopens after close
    source.close()
    with pytest.raises(MissingTensorError):
        source.get("nope")


def test_file_truncated_after_probe_is_a_typed_error(tmp_path: Path) -> None:
    _write(tmp_path)
    probe = Probe.open(tmp_path)
    f = tmp_path / "b.safetensors"
    f.write_bytes(f.read_bytes()[:-40])
    source = SafetensorsSource(probe)
    with pytest.raises(CheckpointError, match="truncated"):
        for name in source.keys():
            source.get(name)
    source.close()


def test_reading_does_not_map_the_file(tmp_path: Path) -> None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    _write(tmp_path)
    source = SafetensorsSource(Probe.open(tmp_path))
    for name in source.keys():
        source.get(name)
    assert str(tmp_path) not in maps.read_text()
    source.close()
