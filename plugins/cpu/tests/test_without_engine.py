"""Without anyquant-cpu every format still loads and generates, on its exact backends (#41 §2): a process in which the
distribution cannot be imported (``sys.modules["anyquant_cpu"] = None``: any import of it fails, as after ``pip
uninstall anyquant-cpu``) and its entry point is disabled (``ANYQUANT_DISABLE_PLUGINS=anyquant-cpu``: no plugin
registers ``cpu-fast``) runs ``anyquant generate`` on the bundled model, and gives the greedy tokens this process
gives on the same exact backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import anyquant
from anyquant_runtime.cpu import MISSING

pytestmark = [pytest.mark.model]

#: the lines a process runs first: anyquant-cpu cannot be imported there
_HIDE = "import sys; sys.modules['anyquant_cpu'] = None; "
_ENV = {**os.environ, "ANYQUANT_DISABLE_PLUGINS": "anyquant-cpu"}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _HIDE + code], env=_ENV, capture_output=True, text=True, timeout=600, check=False
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _python(f"from anyquant.cli import main; sys.argv = ['anyquant', *{list(args)!r}]; sys.exit(main())")


def test_generate_runs_on_the_exact_backend_and_matches_it() -> None:
    proc = _cli("generate", "--prompt", "The capital of France is", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    backend = result["backend"]
    assert backend in ("packed", "dequantized", "reference"), result
    with anyquant.load(anyquant.default_model(), backend=backend) as model:
        want = model.generate("The capital of France is", max_new_tokens=8, temperature=0)
    assert result["text"] == want
    assert result["text"].strip(), "no text generated"


def test_cpu_fast_is_unavailable_and_says_what_to_install() -> None:
    proc = _cli("backends")
    assert proc.returncode == 0, proc.stderr[-3000:]
    gguf = proc.stdout.split("\ngguf\n", 1)[1].split("\n\n", 1)[0] if "\ngguf\n" in proc.stdout else proc.stdout
    line = next(x for x in gguf.splitlines() if x.strip().startswith("cpu-fast"))
    assert "not available" in line and "anyquant-cpu" in line, line
    asked = _python(
        "import anyquant\n"
        "try:\n"
        "    anyquant.load(anyquant.default_model(), backend='cpu-fast')\n"
        "except anyquant.UnsupportedBackendError as exc:\n"
        "    print('refused:', exc)\n"
    )
    assert asked.returncode == 0, asked.stderr[-3000:]
    assert asked.stdout.startswith("refused:") and MISSING in asked.stdout, asked.stdout
