"""``anyquant check`` / ``load(check=True)``: passes on the real bundled model (on its fast and exact backends) and
fails on the same file mis-decoded (its 4-bit codes' nibbles swapped, as a loader with the wrong nibble order would
read them), with the figure and what to try."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import anyquant as sdk
from anyquant_tools.check import BROKEN_FROM, OK_BELOW, ModelCheckError, check

pytestmark = pytest.mark.model
CLI = [sys.executable, "-c", "import sys; from anyquant.cli import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def swapped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled SmolLM2 Q4_1 GGUF with the two 4-bit codes of every byte of every Q4_1 block swapped."""
    from gguf import GGMLQuantizationType, GGUFReader

    src = Path(sdk.default_model())
    dst = tmp_path_factory.mktemp("check") / src.name
    shutil.copyfile(src, dst)
    tensors = [
        (t.data_offset, t.n_bytes) for t in GGUFReader(src).tensors if t.tensor_type == GGMLQuantizationType.Q4_1
    ]
    assert tensors
    data = np.memmap(dst, dtype=np.uint8, mode="r+")
    for offset, size in tensors:
        blocks = data[offset : offset + size].reshape(-1, 20)  # Q4_1: fp16 d, fp16 m, 16 bytes of codes
        codes = blocks[:, 4:]
        blocks[:, 4:] = (codes << 4) | (codes >> 4)
    data.flush()
    del data
    return dst


@pytest.mark.parametrize("backend", ["auto", "dequantized"])
def test_the_real_model_is_ok(backend: str) -> None:
    model = sdk.load(sdk.default_model(), backend=backend, check=True)
    report = model.info["check"]
    assert report["verdict"] == "ok" and report["uniform_fraction"] < OK_BELOW
    assert 5 < report["perplexity"] < 100 and "Paris" in report["answer"]


def test_a_mis_decoded_model_fails(swapped: Path) -> None:
    model = sdk.load(swapped, backend="dequantized")
    report = check(model)
    assert report.verdict == "broken" and report.uniform_fraction >= BROKEN_FROM, report.summary()
    assert any("dequantized" in a or "re-download" in a for a in report.advice)
    with pytest.raises(ModelCheckError, match="does NOT behave like a language model") as info:
        sdk.load(swapped, check=True)
    assert info.value.report.verdict == "broken"


def test_the_command_says_so_and_exits_3(swapped: Path) -> None:
    ok = subprocess.run([*CLI, "check", "--json"], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout.strip().splitlines()[-1])["verdict"] == "ok"
    bad = subprocess.run([*CLI, "check", str(swapped)], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 3 and "BROKEN" in bad.stdout and "perplexity" in bad.stdout, bad.stdout + bad.stderr
