"""Backend ``gptqmodel`` for AWQ GEMM checkpoints: GPTQModel's AWQ kernel modules behind anyquant.

No GPU here: GPTQModel's torch AWQ kernel runs the same path on the CPU (load option
``_gptqmodel_cpu``), in a subprocess (the GPTQ plugin's worker), against anyquant's reference.
bench/gpu_gptq.sh runs the CUDA kernels (AWQ Marlin, Triton).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant.testing.fixtures import awq_gemm, awq_gemv
from anyquant_awq.loader import AWQLoader

WORKER = Path(__file__).resolve().parents[2] / "gptq" / "tests" / "gptqmodel_backend_worker.py"
#: fp16 logits of two paths whose GEMMs sum in different orders (measured: 5e-4 to 8e-4)
FP16_TOL = 2e-3
HAS_GPTQMODEL = importlib.util.find_spec("gptqmodel") is not None
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")


@no_cuda
def test_backend_is_listed_and_says_why_not() -> None:
    info = {b.name: b for b in AWQLoader().backends()}["gptqmodel"]
    assert not info.available
    assert "CUDA" in info.reason or "not installed" in info.reason


@no_cuda
def test_load_on_cpu_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(anyquant.UnsupportedBackendError, match="awq backend 'gptqmodel' cannot run here"):
        anyquant.load(awq_gemm(tmp_path / "ckpt"), backend="gptqmodel")


@pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed")
def test_gemv_layout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(anyquant.UnsupportedBackendError, match="GEMM"):
        anyquant.load(awq_gemv(tmp_path / "ckpt"), backend="gptqmodel", device="cpu", _gptqmodel_cpu=True)


@pytest.mark.peer
@pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed")
def test_gptqmodel_torch_awq_kernels_match_the_reference() -> None:
    from tests.peers.catalog import GPTQMODEL_AWQ_VARIANTS, gptqmodel_awq_quantized_dir

    root = gptqmodel_awq_quantized_dir()
    names = [v["name"] for v in GPTQMODEL_AWQ_VARIANTS]
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(root), *names], capture_output=True, text=True, timeout=1200, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows: dict[str, dict[str, Any]] = {
        r["variant"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    }
    assert set(rows) == set(names)
    for name, r in rows.items():
        assert r["backend"] == "gptqmodel", name
        assert r["kernels"] == {"AwqTorchLinear": 14}, (name, r["kernels"])
        assert r["weights_exact"], name
        # weights bitwise; logits within fp16 rounding (bitwise on some CPUs only: see the worker)
        assert r["fp16_rel"] < FP16_TOL and r["judge_rel"] < FP16_TOL, (name, r["fp16_rel"], r["judge_rel"])
        assert r["greedy_equal"], name
        assert r["fp32_rel"] < 1e-2, (name, r["fp32_rel"])
    assert rows[names[0]]["export_equal"]  # export_dense: backend == reference
