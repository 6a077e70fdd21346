"""The prepared GPU scripts on a machine without a GPU: they parse, say "no CUDA GPU: skipped" and exit 3
(what a CPU-only CI or a session without a device machine sees), and touch nothing in the tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


def _bench_module(name: str) -> ModuleType:
    """A bench script imported as a module (its ``main`` does not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_gptq_check_expects_the_marlin_refusal_on_asymmetric_weights() -> None:
    """GPTQModel's GPTQ Marlin runs symmetric weights only (seen on an H200): the explicit ``marlin`` row on an
    asymmetric checkpoint passes on anyquant's typed error and on nothing else; ``auto`` must still load."""
    g = _bench_module("gpu_gptq")
    ckpts = {
        "asym": {"path": "/x", "decode": False, "marlin_error": "UnsupportedBackendError"},
        "sym": {"path": "/y", "decode": True},
    }
    rows = g.plan_rows(ckpts, "marlin")
    expect = {(r["ckpt"], r["kernel"]): r.get("expect_error") for r in rows}
    assert expect == {
        ("asym", "marlin"): "UnsupportedBackendError",
        ("asym", "auto"): None,
        ("sym", "marlin"): None,
        ("sym", "auto"): None,
    }
    marlin_row = next(r for r in rows if r["ckpt"] == "asym" and r["kernel"] == "marlin")
    refused = {**marlin_row, "error": "UnsupportedBackendError: marlin: only supports symmetric"}
    crashed = {**marlin_row, "error": "RuntimeError: CUDA error"}
    loaded = {**marlin_row, "rel_diff": 0.0, "top1": 1.0}
    assert g.verdicts([refused], {"ok": True}) is True
    assert refused["verdict"].startswith("ok")
    for row in (crashed, loaded):
        assert g.verdicts([row], {"ok": True}) is False
        assert row["verdict"].startswith("FAIL")
    # without a Marlin build the row is not required
    assert g.verdicts([{**crashed}], {"ok": False}) is True


def test_gptq_check_allows_a_routing_flip_on_mixture_of_experts_rows(tmp_path: Path) -> None:
    """A mixture-of-experts checkpoint's row passes with up to MOE_FLIPS tokens past the tolerance (a near-tied router
    picks the other expert under a kernel's rounding: GPTQModel's torch kernel on bench/moe.py's checkpoint, CPU),
    and not with more; a dense checkpoint's row fails on one."""
    import torch

    g = _bench_module("gpu_gptq")
    ref = torch.randn(1, 64, 100, generator=torch.Generator().manual_seed(0))
    close = ref + 1e-4 * ref.abs().max()
    rows = {}
    for flips in (1, g.MOE_FLIPS, g.MOE_FLIPS + 1):
        got = close.clone()
        got[0, :flips] += 0.1 * ref.abs().max()
        torch.save(got, tmp_path / f"{flips}.pt")
    torch.save(ref, tmp_path / "ref.pt")
    for moe in (True, False):
        for flips in (1, g.MOE_FLIPS, g.MOE_FLIPS + 1):
            head = {"ckpt": "c", "dtype": "float16", "moe": moe}
            reference = {**head, "label": "reference", "logits": str(tmp_path / "ref.pt")}
            row = {**head, "label": "gptqmodel torch", "logits": str(tmp_path / f"{flips}.pt")}
            g.compare([reference, row])
            g.verdicts([row], {"ok": True})
            rows[(moe, flips)] = row["verdict"]
    assert rows[(True, 1)].startswith("ok (1 token") and rows[(True, g.MOE_FLIPS)].startswith("ok")
    assert rows[(True, g.MOE_FLIPS + 1)] == "FAIL"
    assert all(rows[(False, flips)] == "FAIL" for flips in (1, g.MOE_FLIPS, g.MOE_FLIPS + 1))


def test_gptq_check_budget_never_starves_a_step() -> None:
    g = _bench_module("gpu_gptq")
    clock = g.Clock(110.0)
    assert 50 < clock.share(100) <= 55  # half of what is left is kept, not the fixed 100 s
    assert 299 < g.Clock(400.0).share(100) <= 300  # the full 100 s kept when it is at most half
    assert g.Clock(-5.0).share(100) <= -5  # nothing kept once the budget is spent


def test_exl3_check_finds_a_stop_string_in_mostly_non_ascii_text() -> None:
    e = _bench_module("gpu_exl3")
    assert e.ascii_window("abcdef") == "de"
    assert e.ascii_window("\ufffd\ufffd-i\x05\ufffdW\n") == "i"  # the H200 run's greedy text: one ASCII char
    assert e.ascii_window("\ufffd\ufffd\ufffd\ufffd") == ""
