"""Fixtures shared by the EXL3 plugin's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from anyquant.testing.tiny import make_tiny_dense


@pytest.fixture(scope="session")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer tiny Llama (random weights, 128 wide, 259-token vocabulary), saved once per session."""
    return make_tiny_dense(tmp_path_factory.mktemp("d") / "tiny", num_hidden_layers=1)
