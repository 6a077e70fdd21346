"""The quantize quality gate compares perplexities on held-out text and refuses far-worse results."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from anyquant.errors import QuantizeError
from anyquant.testing.tiny import make_tiny_dense
from anyquant_tools.quantize import eval_text, quality_check


def _sharpened(src: Path, dst: Path, factor: float) -> Path:
    """A copy of ``src`` whose head is multiplied: confident, wrong predictions (finite logits)."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * factor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_gate_passes_an_identical_model_and_refuses_a_much_worse_one(tmp_path: Path) -> None:
    src = make_tiny_dense(tmp_path / "src")
    same = quality_check(src, src, max_ratio=1.0)
    assert same.ratio == pytest.approx(1.0) and same.tokens > 100
    worse = _sharpened(src, tmp_path / "worse", 40.0)
    with pytest.raises(QuantizeError, match="far worse"):
        quality_check(src, worse, max_ratio=3.0)
    mild = _sharpened(src, tmp_path / "mild", 1.05)
    assert quality_check(src, mild, max_ratio=3.0).ratio < 3.0


def test_gate_text_is_held_out_from_calibration() -> None:
    from anyquant_tools.calibration import check_overlap, sample

    texts = sample("wiki", n_samples=16, seq_len=256, seed=0)
    assert check_overlap(texts, eval_text()).fraction < 0.02
