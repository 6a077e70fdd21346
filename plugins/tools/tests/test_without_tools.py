"""Without anyquant-tools (or the runtime) core still detects, and without the tools every format still loads and
generates (#41 §3): a process in which ``anyquant_tools`` cannot be imported (``sys.modules[...] = None``, as after
``pip uninstall anyquant-tools``) and its entry point is disabled gets the tools' commands and names as a
``MissingDependencyError`` naming the distribution, and ``anyquant generate`` as before; one without the runtime and
torch still detects a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import anyquant

_ENV = {**os.environ, "ANYQUANT_DISABLE_PLUGINS": "anyquant-tools"}


def _python(code: str, hide: tuple[str, ...] = ("anyquant_tools",)) -> subprocess.CompletedProcess[str]:
    first = "import sys; " + "".join(f"sys.modules[{m!r}] = None; " for m in hide)
    return subprocess.run(
        [sys.executable, "-c", first + code], env=_ENV, capture_output=True, text=True, timeout=600, check=False
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _python(f"from anyquant.cli import main; sys.argv = ['anyquant', *{list(args)!r}]; sys.exit(main())")


def test_the_tools_commands_name_their_distribution() -> None:
    for argv in (("quantize", "a", "b"), ("estimate", "--help"), ("eval", "x")):
        proc = _cli(*argv)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr[-2000:])
        assert "MissingDependencyError" in proc.stderr and "pip install anyquant-tools" in proc.stderr, proc.stderr
    shown = _cli("--help")
    assert shown.returncode == 0 and "not installed: pip install anyquant-tools" in " ".join(shown.stdout.split())


def test_the_tools_names_name_their_distribution() -> None:
    proc = _python(
        "import anyquant\n"
        "for name in ('quantize', 'compare', 'estimate', 'advise', 'export_dense', 'perplexity'):\n"
        "    try:\n"
        "        getattr(anyquant, name)\n"
        "    except anyquant.MissingDependencyError as exc:\n"
        "        print(name, exc)\n"
        "print(anyquant.SizingError.__module__)\n"  # core's own: no tool needed
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 7 and all("pip install anyquant-tools" in x for x in lines[:6]), lines
    assert lines[6] == "anyquant.shape"


@pytest.mark.model
def test_generate_runs_without_the_tools_and_check_names_them() -> None:
    proc = _cli("generate", "--prompt", "The capital of France is", "--max-new-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    with anyquant.load(anyquant.default_model(), backend=result["backend"]) as model:
        assert result["text"] == model.generate("The capital of France is", max_new_tokens=6, temperature=0)
    checked = _python(
        "import anyquant\n"
        "try:\n"
        "    anyquant.load(anyquant.default_model(), check=True)\n"
        "except anyquant.MissingDependencyError as exc:\n"
        "    print('refused:', exc)\n"
    )
    assert checked.returncode == 0 and "pip install anyquant-tools" in checked.stdout, checked.stderr[-2000:]


def test_core_detects_without_the_runtime_or_torch() -> None:
    proc = _python(
        "import anyquant\n"
        "d = anyquant.detect(anyquant.default_model())\n"
        "print(d.format, 'torch' in sys.modules, 'anyquant_runtime' in sys.modules and sys.modules['anyquant_runtime'])",
        hide=("anyquant_tools", "anyquant_runtime", "torch"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["gguf", "True", "None"], proc.stdout
