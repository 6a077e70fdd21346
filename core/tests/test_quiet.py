"""Dependencies' import-time notices (torchao's "Failed to load ... .so", torch's ``_pytree`` enum notice,
AutoAWQ's deprecation banner) stay out of anyquant's CLI output, and nothing of that changes a library user's
warning filters or loggers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from anyquant.testing.fixtures import FIXTURES

NOISE = ("Failed to load", "is an Enum subclass", "AutoAWQ is officially deprecated", "final dev message")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed: nothing to leak")
def test_cli_output_has_no_dependency_notices(tmp_path: Path) -> None:
    """``anyquant export`` of an AWQ checkpoint imports transformers' model code, and with it torchao (which
    logged a "Failed to load" line per missing CUDA extension and made torch log an enum deprecation notice):
    its output is anyquant's own lines only. (The header-only fixture has no weights for every parameter:
    the command ends with anyquant's typed error after the imports, as intended here.)"""
    src = FIXTURES["awq_gemm"].build(tmp_path / "awq")
    code = (
        "import sys\n"
        "from anyquant.cli import main\n"
        f"code = main(['export', {str(src)!r}, {str(tmp_path / 'out')!r}])\n"
        "print('IMPORTED', 'torchao' in sys.modules, 'transformers.modeling_utils' in sys.modules, code)\n"
    )
    out = _python(code)
    assert "IMPORTED True True" in out.stdout, out.stderr  # the noisy imports did happen
    for text in NOISE:
        assert text not in out.stdout and text not in out.stderr, (text, out.stderr)
    assert "anyquant: " in out.stderr  # anyquant's own lines still show


@pytest.mark.skipif(importlib.util.find_spec("awq") is None, reason="AutoAWQ is not installed")
def test_autoawq_banner_is_dropped_and_the_filters_it_reset_are_restored() -> None:
    """``import awq`` puts its own filter in front of the host's and prints a deprecation banner: under
    ``quiet_dependencies`` the banner is not shown and the filters are the host's again afterwards."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('error', UserWarning)\n"  # the host's own filter
        "before = list(warnings.filters)\n"
        "from anyquant.quiet import quiet_dependencies\n"
        "with quiet_dependencies():\n"
        "    import awq\n"
        "print('SAME', list(warnings.filters) == before)\n"
    )
    out = _python(code)
    assert "SAME True" in out.stdout, out.stderr
    for text in NOISE:
        assert text not in out.stderr, (text, out.stderr)


def test_import_and_library_calls_leave_warning_filters_and_loggers_alone(tmp_path: Path) -> None:
    """``import anyquant``, its library calls and even ``anyquant.cli.main`` called by a host application change
    neither ``warnings.filters`` nor ``warnings.showwarning`` nor the filters of the dependencies' loggers
    (transformers' model code is imported first, so only anyquant's own doing is measured)."""
    src = FIXTURES["awq_gemm"].build(tmp_path / "awq")
    code = (
        "import logging, warnings\n"
        "import transformers.modeling_utils\n"
        "warnings.simplefilter('error', UserWarning)\n"
        "def state():\n"
        "    loggers = [logging.getLogger(n).filters[:] for n in ('torchao', 'torch.utils._pytree')]\n"
        "    return list(warnings.filters), warnings.showwarning, loggers\n"
        "before = state()\n"
        "import anyquant\n"
        f"anyquant.inspect({str(src)!r})\n"
        "from anyquant.cli import main\n"
        f"main(['export', {str(src)!r}, {str(tmp_path / 'out')!r}])\n"
        "from anyquant.quiet import quiet_dependencies\n"
        "with quiet_dependencies():\n"
        "    pass\n"
        "print('SAME', state() == before)\n"
    )
    out = _python(code)
    assert "SAME True" in out.stdout, out.stdout + out.stderr


def test_other_records_and_warnings_pass() -> None:
    """Only the listed notices are dropped: another torchao record, or a warning of the host's, still shows."""
    code = (
        "import logging, warnings\n"
        "logging.basicConfig(format='%(name)s %(message)s')\n"
        "from anyquant.quiet import quiet_dependencies\n"
        "with quiet_dependencies():\n"
        "    logging.getLogger('torchao').warning('Failed to load x.so')\n"
        "    logging.getLogger('torchao').warning('something else')\n"
        "    warnings.warn('the host speaks', UserWarning)\n"
    )
    out = _python(code)
    assert "something else" in out.stderr and "the host speaks" in out.stderr
    assert "x.so" not in out.stderr
