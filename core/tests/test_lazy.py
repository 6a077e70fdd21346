"""``import anyquant`` does nothing: no torch, no plugin discovery, no logging config."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_is_light() -> None:
    r = _run(
        "import sys, logging, anyquant\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "assert 'anyquant.registry' not in sys.modules\n"
        "assert not logging.getLogger().handlers\n"
        "anyquant.Claim; anyquant.AnyquantError\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert r.returncode == 0, r.stderr


def test_detect_does_not_import_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from anyquant.testing.fixtures import FIXTURES

    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    r = _run(
        f"import sys, anyquant\nd = anyquant.detect({str(root)!r})\nassert d.format == 'gptq'\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'gptqmodel') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert r.returncode == 0, r.stderr


def test_cli_help_is_fast_and_light() -> None:
    r = _run(
        "import sys; from anyquant.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules"
    )
    assert r.returncode == 0, r.stderr
