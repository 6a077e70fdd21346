"""The whole source type-checks under ``mypy --strict``: core and every in-repo plugin.

Hosts embed anyquant and type-check their code against it; plugin authors read these modules as the
reference. Before session 13, 38 errors in core's runtime (torch ``Module`` attributes typed as
``nn.Linear`` while loaders swap in quantized modules, untyped third-party calls) and 32 in the
plugins (among them the exllamav3 generator's ``token_steps`` override without core's ``ends``
parameter) hid any new mistake among them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "anyquant",
    "anyquant_runtime",
    "anyquant_tools",
    "anyquant_gptq",
    "anyquant_awq",
    "anyquant_exl3",
    "anyquant_gguf",
    "anyquant_ct",
    "anyquant_fp8",
    "anyquant_bnb",
    "anyquant_mlx",
    "anyquant_mxfp4",
    "anyquant_serve",
    "anyquant_cpu",
)


@pytest.mark.slow
def test_every_package_passes_mypy_strict() -> None:
    pytest.importorskip("mypy")
    srcs = [REPO / "core" / "src", *sorted((REPO / "plugins").glob("*/src"))]
    env = {**os.environ, "MYPYPATH": os.pathsep.join(map(str, srcs))}
    cmd = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    for package in PACKAGES:
        cmd += ["-p", package]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout
