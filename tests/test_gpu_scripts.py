"""The prepared GPU scripts on a machine without a GPU: they parse, say "no CUDA GPU: skipped" and exit 3
(what a CPU-only CI or a session without a device machine sees), and touch nothing in the tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "bench").glob("*.sh"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_every_bench_shell_script_parses() -> None:
    assert {s.name for s in SCRIPTS} >= {"gpu_exl3.sh", "gpu_gptq.sh", "cuda_toolchain.sh"}
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"


@pytest.mark.skipif(_has_cuda(), reason="a CUDA GPU is visible: the scripts would run their checks")
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="nvidia-smi present: gpu_gptq.sh exits 4 instead")
@pytest.mark.parametrize("script", ["gpu_exl3.sh", "gpu_gptq.sh"])
def test_gpu_script_skips_without_a_gpu(script: str) -> None:
    before = sorted(p.name for p in (REPO / "bench").iterdir())
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / script)], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "no CUDA GPU: skipped"
    assert sorted(p.name for p in (REPO / "bench").iterdir()) == before
