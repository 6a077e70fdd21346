"""Base test class every format plugin subclasses. Needs pytest."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest

from ..probe import Probe
from ..protocols import Claim, FormatSpec, Loader
from ..registry import Registry, check_requirements, import_object, unknown_hooks
from .fixtures import FIXTURES, Fixture

__all__ = ["PluginConformance"]


class PluginConformance:
    """Subclass it in the plugin's tests and set the class attributes (see docs/plugins.md, "Testing")."""

    entry_point: ClassVar[str]
    package: ClassVar[str]
    formats: ClassVar[tuple[str, ...]]
    #: names in the kit's :data:`~anyquant.testing.fixtures.FIXTURES` that this plugin must claim
    own_fixtures: ClassVar[tuple[str, ...]] = ()
    #: the plugin's own header-only fixtures (a third party's format has none in the kit): each must be claimed
    #: by this plugin alone and resolve to it in the full registry
    extra_fixtures: ClassVar[Mapping[str, Fixture]] = {}
    #: formats registered only as "recognised" (no loader yet); listed so the kit knows.
    recognised_only: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ helpers
    def _module(self) -> object:
        eps = [ep for ep in md.entry_points(group="anyquant") if ep.name == self.entry_point]
        assert eps, f"entry point {self.entry_point!r} not found in group 'anyquant' (is the plugin installed?)"
        return eps[0].load()

    def _registry(self) -> Registry:
        return Registry(entry_points=False, builtin=False, plugins=[(self.entry_point, self._module())])

    def _claims(self, path: Path) -> list[Claim]:
        probe = Probe.open(path)
        return [c for _, c in self._registry().claims(probe)]

    # ------------------------------------------------------------------ tests
    def test_entry_point_found(self) -> None:
        module = self._module()
        assert getattr(module, "anyquant_detect", None) is not None, "the plugin module has no anyquant_detect hook"

    def test_fixtures_exist(self) -> None:
        """Every named own fixture exists (a misspelt name used to skip the claim checks silently), and the
        plugin has at least one fixture to be checked against."""
        missing = [name for name in self.own_fixtures if name not in FIXTURES]
        assert not missing, (
            f"own_fixtures {missing} are not in anyquant.testing.fixtures.FIXTURES; add them to extra_fixtures"
        )
        assert self.own_fixtures or self.extra_fixtures, "no fixture: set own_fixtures or extra_fixtures"

    def test_extra_fixtures_claimed_and_resolved(self, tmp_path: Path) -> None:
        for name, fx in self.extra_fixtures.items():
            path = fx.build(tmp_path / name)
            claims = self._claims(path)
            assert len(claims) == 1 and claims[0].format == fx.format, (
                f"{name}: expected one {fx.format} claim, got {claims}"
            )
            assert claims[0].evidence, "a claim must say why"
            detection = Registry().detect(Probe.open(path))
            assert (detection.format, detection.plugin) == (fx.format, self.entry_point), f"{name}: {detection}"

    def test_no_misspelt_hooks(self) -> None:
        notes = unknown_hooks(self._module())
        assert not notes, notes

    def test_import_leaves_torch_out(self) -> None:
        """Importing the package and the entry point's module (what discovery imports) loads no heavy library."""
        eps = [ep for ep in md.entry_points(group="anyquant") if ep.name == self.entry_point]
        module = eps[0].value.split(":")[0] if eps else f"{self.package}.plugin"
        code = (
            f"import sys, {self.package}, importlib\n"
            f"importlib.import_module({module!r})\n"
            "heavy = [m for m in ('torch', 'transformers', 'gptqmodel', 'awq', 'exllamav3', 'numpy') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"importing {self.package} imported heavy modules: {result.stderr[-2000:]}"

    def test_registers_its_formats(self) -> None:
        formats = self._registry().formats()
        assert set(self.formats) <= set(formats), f"registered {sorted(formats)}, expected {self.formats}"
        for name in self.formats:
            spec = formats[name]
            assert isinstance(spec, FormatSpec)
            for ref in (spec.loader, spec.quantizer):
                assert ref is None or (":" in ref and ref.split(":")[0]), f"{name}: {ref!r} is not 'module:attr'"

    def test_requirements_declared_and_checked(self) -> None:
        for name, spec in self._registry().formats().items():
            if spec.loader is None:
                continue
            assert spec.requires, f"format {name} declares no requirements"
            check_requirements(spec.requires, what=f"format {name}")  # installed in the test env

    def test_loaders_satisfy_protocol(self) -> None:
        for name, spec in self._registry().formats().items():
            if spec.loader is None or name in self.recognised_only:
                continue
            loader = import_object(spec.loader)()
            assert isinstance(loader, Loader), f"{spec.loader} does not satisfy anyquant.Loader"
            assert loader.format == name
            assert loader.backends(), f"{spec.loader}.backends() is empty"

    @pytest.mark.parametrize("fixture", sorted(FIXTURES))
    def test_detection_claims_own_and_rejects_others(self, fixture: str, tmp_path: Path) -> None:
        fx = FIXTURES[fixture]
        path = fx.build(tmp_path / fixture)
        claims = self._claims(path)
        if fixture in self.own_fixtures:
            assert len(claims) == 1, f"{fixture}: expected one claim, got {claims}"
            assert claims[0].format == fx.format
            assert claims[0].evidence, "a claim must say why"
        else:
            assert not claims, f"{self.entry_point} claims the {fixture} fixture ({fx.format}): {claims}"

    @pytest.mark.parametrize("fixture", sorted(FIXTURES))
    def test_full_registry_resolves(self, fixture: str, tmp_path: Path) -> None:
        if fixture not in self.own_fixtures:
            pytest.skip("another plugin's fixture")
        fx = FIXTURES[fixture]
        path = fx.build(tmp_path / fixture)
        detection = Registry().detect(Probe.open(path))
        assert detection.format == fx.format
        assert detection.plugin == self.entry_point

    def test_package_is_typed(self) -> None:
        pkg = importlib.import_module(self.package)
        assert pkg.__file__ is not None
        assert (Path(pkg.__file__).parent / "py.typed").is_file(), "ship py.typed"
