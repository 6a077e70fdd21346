"""The conformance kit for format plugins (langchain standard-tests style).

A plugin's test module subclasses :class:`PluginConformance` and sets a few attributes::

    from . import PluginConformance

    class TestConformance(PluginConformance):
        entry_point = "anyquant-gptq"          # name in the ``anyquant`` entry-point group
        package = "anyquant_gptq"              # import name
        formats = ("gptq",)                    # format ids it registers
        own_fixtures = ("gptq_v1", "gptq_v2")  # header-only fixtures it must claim

Every fixture in :data:`anyquant.testing.fixtures.FIXTURES` not listed in ``own_fixtures`` must be
rejected. Overriding a test to skip it needs ``pytest.mark.xfail(reason=...)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .fixtures import FIXTURES, Fixture

if TYPE_CHECKING:
    from .conformance import PluginConformance

__all__ = ["FIXTURES", "Fixture", "PluginConformance"]


def __getattr__(name: str) -> Any:
    """``PluginConformance`` imports pytest: only when asked for, so ``anyquant.testing.fixtures`` and
    ``anyquant.testing.tiny`` work where pytest is not installed."""
    if name == "PluginConformance":
        from .conformance import PluginConformance

        return PluginConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
