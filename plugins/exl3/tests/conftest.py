"""Fixtures shared by the EXL3 plugin's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from anyquant.testing.tiny import make_tiny_dense


@pytest.fixture(scope="session")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer tiny Llama (random weights, 128 wide, 259-token vocabulary), saved once per session."""
    return make_tiny_dense(tmp_path_factory.mktemp("d") / "tiny", num_hidden_layers=1)


def _rewrite(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture
def rewrite_checkpoint() -> Callable[[Path, Path, Callable[[dict], None]], Path]:
    """``rewrite_checkpoint(src, dst, edit)``: a copy of the checkpoint folder ``src`` at ``dst`` (config,
    tokenizer ...) whose ``model.safetensors`` holds ``src``'s tensors after ``edit(tensors)`` changed them."""
    return _rewrite
