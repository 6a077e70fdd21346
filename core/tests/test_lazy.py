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


def test_all_is_a_literal_list_of_every_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Type checkers read ``__all__`` only as a literal; `mypy --strict` refused `sdk.load` ("does not
    explicitly export") when it was built from _EXPORTS."""
    import os
    import subprocess
    import sys

    import anyquant

    assert anyquant.__all__ == ["__version__", *anyquant._EXPORTS]
    user = tmp_path / "user.py"
    user.write_text(
        "import anyquant as sdk\nfrom anyquant import CheckpointError, Registry, load\n\n\n"
        "def main(path: str) -> str:\n    model = sdk.load(path)\n    return model.generate('Hi')\n"
    )
    env = {**os.environ, "MYPYPATH": ""}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--follow-imports=silent", str(user)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert "does not explicitly export" not in out.stdout, out.stdout
