"""The plugin registry: entry-point discovery, format specs, detection and its resolution.

``Registry()`` is isolated: tests and host applications build their own. Nothing is discovered
until first use, and nothing at all happens at ``import anyquant``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from . import hookspecs
from .backends import EXACT_BACKENDS
from .errors import (
    AmbiguousFormatError,
    AnyquantError,
    FormatConflictError,
    FormatMismatchError,
    MissingDependencyError,
    PluginError,
    UnknownFormatError,
    UnsupportedFormatError,
)
from .probe import Probe
from .protocols import BackendSpec, Claim, Detection, FormatSpec

__all__ = [
    "DETECT_SECONDS",
    "ENTRY_POINT_GROUP",
    "IMPORT_SECONDS",
    "FIRST_PARTY_PLUGINS",
    "PluginInfo",
    "Registry",
    "check_requirements",
    "import_object",
    "strict_plugins",
    "unknown_hooks",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "anyquant"
CORE_PLUGIN = "anyquant"

#: seconds a third-party plugin's ``anyquant_detect`` may take on one checkpoint before it is abandoned
DETECT_SECONDS = 10.0
#: seconds importing a third-party plugin's entry point may take before the plugin is skipped
IMPORT_SECONDS = 30.0


class _Late(Exception):
    """A third-party plugin's call did not return within its deadline (its thread is left running)."""


def _bounded(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()`` in a daemon thread, waited for ``seconds``: its result or exception, or :class:`_Late`.

    A hung plugin cannot be stopped from outside in Python; the daemon thread is left to finish (or not)
    on its own and never holds up the interpreter's exit."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread, where it is judged
            box.append((False, exc))

    worker = threading.Thread(target=run, name="anyquant-plugin", daemon=True)
    worker.start()
    worker.join(seconds)
    if not box:
        raise _Late(f"did not return within {seconds:g} s and was abandoned")
    ok, value = box[0]
    if ok:
        return value
    raise value


#: config ``quant_method`` spellings -> anyquant format ids.
QUANT_METHOD_ALIASES: dict[str, str] = {
    "gptq": "gptq",
    "awq": "awq",
    "exl3": "exl3",
    "exl2": "exl2",
    "gguf": "gguf",
    "compressed-tensors": "compressed-tensors",
    "compressed_tensors": "compressed-tensors",
    "bitsandbytes": "bnb",
    "bnb": "bnb",
    "fp8": "fp8",
    "fbgemm_fp8": "fp8",
    "modelopt": "fp8",  # NVIDIA ModelOpt: its FP8 algorithms are the fp8 plugin's (others refused there by name)
    "hqq": "hqq",
    "mxfp4": "mxfp4",
}

#: which distribution to install for a format nobody installed claims.
PLUGIN_FOR_FORMAT: dict[str, str] = {
    "gptq": "anyquant-gptq",
    "awq": "anyquant-awq",
    "exl3": "anyquant-exl3",
    "exl2": "anyquant-exl3",
    "gguf": "anyquant-gguf",
    "compressed-tensors": "anyquant-compressed-tensors",
    "fp8": "anyquant-fp8",
    "bnb": "anyquant-bnb",
    "mlx": "anyquant-mlx",
    "mxfp4": "anyquant-mxfp4",
}


@dataclass
class PluginInfo:
    name: str
    version: str | None
    formats: list[str] = field(default_factory=list)
    error: str | None = None
    module: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "formats": list(self.formats),
            "error": self.error,
            "module": self.module,
        }


def strict_plugins() -> bool:
    """``ANYQUANT_STRICT_PLUGINS`` set (anything but empty, ``0``, ``false``, ``no``): a broken plugin raises."""
    return _strict()


def _strict() -> bool:
    return os.environ.get("ANYQUANT_STRICT_PLUGINS", "") not in ("", "0", "false", "no")


def _disable_hint(name: str) -> str:
    return f"disable it with ANYQUANT_DISABLE_PLUGINS={name}"


def _disabled() -> set[str]:
    raw = os.environ.get("ANYQUANT_DISABLE_PLUGINS", "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def import_object(ref: str) -> Any:
    """Import ``"package.module:attr"``."""
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


#: the first-party distributions core reaches by module name only (never by import): package -> distribution
DISTRIBUTIONS = {"anyquant_runtime": "anyquant-runtime", "anyquant_tools": "anyquant-tools"}


def import_distribution_module(module: str, what: str) -> ModuleType:
    """Import ``module`` of another first-party distribution (:data:`DISTRIBUTIONS`); where that distribution is not
    installed, a :class:`MissingDependencyError` saying that ``what`` is in it (an import error inside an installed
    one is raised as it is)."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != package:
            raise
        dist = DISTRIBUTIONS[package]
        raise MissingDependencyError(f"{what} is in the {dist} distribution: pip install {dist}") from None


_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:(>=|==|<=|>|<|!=|~=)\s*([^\s;]+))?\s*$")


def check_requirements(requires: Iterable[str], *, what: str) -> None:
    """Raise :class:`MissingDependencyError` unless every ``"dist>=version"`` is installed."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    problems: list[str] = []
    for req in requires:
        m = _REQ.match(req)
        if not m:
            raise PluginError(f"{what}: requirement {req!r} is not of the form 'name>=version'")
        name, op, ver = m.groups()
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{name} is not installed")
            continue
        if op and Version(installed) not in SpecifierSet(f"{op}{ver}"):
            problems.append(f"{name} {installed} is installed, {op}{ver} is needed")
    if problems:
        pip = " ".join(f"'{r.strip()}'" for r in requires)
        raise MissingDependencyError(f"{what} needs: {'; '.join(problems)}. Run: pip install {pip}")


class Registry:
    """An isolated set of plugins.

    ``Registry()`` discovers the ``anyquant`` entry points on first use;
    ``Registry(entry_points=False, plugins=[...])`` holds exactly the given plugin modules (plus
    core's built-in one unless ``builtin=False``).
    """

    def __init__(
        self,
        *,
        entry_points: bool = True,
        plugins: Iterable[tuple[str, object] | object] = (),
        builtin: bool = True,
        disable: Iterable[str] | None = None,
    ) -> None:
        self._entry_points = entry_points
        self._initial = list(plugins)
        self._builtin = builtin
        self._disable = set(disable) if disable is not None else None
        self._pm: pluggy.PluginManager | None = None  # published only once every plugin is in it
        self._building: pluggy.PluginManager | None = None  # while the first use fills it (under _lock)
        self._lock = threading.RLock()
        self._infos: dict[str, PluginInfo] = {}
        self._formats: dict[str, tuple[FormatSpec, str]] = {}
        self._backends: dict[str, tuple[BackendSpec, str]] = {}

    # ------------------------------------------------------------------ plugins
    @property
    def pm(self) -> pluggy.PluginManager:
        pm = self._pm
        if pm is not None:
            return pm
        # the first use discovers the plugins; threads that arrive meanwhile wait for the full set (published
        # half-filled, a concurrent detect would see "Installed formats: []")
        with self._lock:
            if self._pm is not None:
                return self._pm
            if self._building is not None:  # this thread, re-entered from a plugin's import or hook
                return self._building
            building = pluggy.PluginManager("anyquant")
            building.add_hookspecs(hookspecs)
            self._building = building
            try:
                if self._builtin:
                    from . import builtin

                    self._add(CORE_PLUGIN, builtin, version=_dist_version("anyquant"))
                for item in self._initial:
                    name, obj = item if isinstance(item, tuple) else (_plugin_name(item), item)
                    self._add(name, obj, version=None)
                if self._entry_points:
                    self._load_entry_points()
            except BaseException:  # strict mode's PluginError, Ctrl-C: the next use starts again from empty
                self._infos.clear()
                self._formats.clear()
                self._backends.clear()
                raise
            else:
                self._pm = building
            finally:
                self._building = None
            return building

    def register(self, plugin: object, name: str | None = None) -> None:
        """Add a plugin object or module (tests and host applications)."""
        with self._lock:
            self._add(name or _plugin_name(plugin), plugin, version=None)

    def unregister(self, name: str) -> None:
        with self._lock:
            plugin = self.pm.get_plugin(name)
            if plugin is not None:
                self.pm.unregister(plugin)
            self._infos.pop(name, None)
            self._formats = {k: v for k, v in self._formats.items() if v[1] != name}
            self._backends = {k: v for k, v in self._backends.items() if v[1] != name}

    def _blocked(self, name: str) -> bool:
        disabled = self._disable if self._disable is not None else _disabled()
        return name in disabled

    def _add(self, name: str, plugin: object, *, version: str | None) -> None:
        pm = self.pm  # the published manager, or (inside the first use, this thread) the one being filled
        if self._blocked(name):
            log.info("plugin %s disabled by ANYQUANT_DISABLE_PLUGINS", name)
            self._infos[name] = PluginInfo(name, version, error="disabled")
            return
        info = PluginInfo(name, version, module=getattr(plugin, "__name__", type(plugin).__name__))
        self._infos[name] = info
        try:
            pm.register(plugin, name=name)
            self._collect_formats(name, plugin, info)
            self._collect_backends(name, plugin)
            notes = unknown_hooks(plugin)
            if notes and _strict():
                raise PluginError(f"plugin {name}: {'; '.join(notes)}")
            for note in notes:
                log.warning("anyquant plugin %s: %s", name, note)
        except Exception as exc:  # a broken plugin is logged and skipped (whole: none of its formats or backends)
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)
            self._formats = {k: v for k, v in self._formats.items() if v[1] != name}
            self._backends = {k: v for k, v in self._backends.items() if v[1] != name}
            info.formats.clear()
            info.error = f"{type(exc).__name__}: {exc}"
            if _strict():
                raise
            log.warning("anyquant plugin %s is broken and was skipped: %s", name, info.error)

    def _load_entry_points(self) -> None:
        # anyquant's own format plugins register first, so that a third party registering one of their
        # format ids is the one skipped, whatever the names sort as; then the others by name
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=_entry_point_order):
            if ep.name in self._infos:
                continue
            version = _ep_version(ep)
            if self._blocked(ep.name):
                self._infos[ep.name] = PluginInfo(ep.name, version, error="disabled")
                continue
            try:
                # anyquant's own plugins import inline; a third party's import (arbitrary code) is bounded
                module = ep.load() if _entry_point_order(ep)[0] == 0 else _bounded(ep.load, IMPORT_SECONDS)
            except _Late as exc:
                info = PluginInfo(ep.name, version, error=f"importing {ep.value} {exc} ({_disable_hint(ep.name)})")
                self._infos[ep.name] = info
                if _strict():
                    raise PluginError(f"anyquant plugin {ep.name}: {info.error}") from None
                log.warning("anyquant plugin %s was skipped: %s", ep.name, info.error)
                continue
            except Exception as exc:
                info = PluginInfo(ep.name, version, error=f"{type(exc).__name__}: {exc}")
                self._infos[ep.name] = info
                if _strict():
                    raise
                log.warning("anyquant plugin %s failed to import and was skipped: %s", ep.name, info.error)
                continue
            self._add(ep.name, module, version=version)

    def _collect_formats(self, name: str, plugin: object, info: PluginInfo) -> None:
        impl = getattr(plugin, "anyquant_register_formats", None)
        if impl is None:
            return
        specs: list[FormatSpec] = []
        impl(register=specs.append)
        for spec in specs:
            if not isinstance(spec, FormatSpec):
                raise PluginError(f"plugin {name} registered {spec!r}, not a FormatSpec")
            if spec.name in self._formats:
                owner = self._formats[spec.name][1]
                raise PluginError(f"plugin {name} registers format {spec.name!r}, already registered by {owner}")
        for spec in specs:
            self._formats[spec.name] = (spec, name)
            info.formats.append(spec.name)

    def _collect_backends(self, name: str, plugin: object) -> None:
        impl = getattr(plugin, "anyquant_register_backends", None)
        if impl is None:
            return
        specs: list[BackendSpec] = []
        impl(register=specs.append)
        for spec in specs:
            if not isinstance(spec, BackendSpec):
                raise PluginError(f"plugin {name} registered {spec!r}, not a BackendSpec")
            if spec.name in self._backends or spec.name in EXACT_BACKENDS:
                owner = self._backends[spec.name][1] if spec.name in self._backends else "every format loader"
                raise PluginError(f"plugin {name} registers backend {spec.name!r}, already registered by {owner}")
        for spec in specs:
            self._backends[spec.name] = (spec, name)

    def backends(self) -> dict[str, BackendSpec]:
        """The registered backends by name (``anyquant_register_backends``)."""
        self.pm  # noqa: B018 - discover
        return {k: v[0] for k, v in self._backends.items()}

    def backend_owner(self, name: str) -> str:
        """The plugin that registered backend ``name``."""
        self.pm  # noqa: B018
        return self._backends[name][1]

    def call_each(self, hook: str, what: str, **kwargs: Any) -> None:
        """Call every plugin's ``hook`` with ``kwargs``; one that raises is logged, marked in its
        :class:`PluginInfo` and skipped (``ANYQUANT_STRICT_PLUGINS`` re-raises; core's own always does)."""
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            try:
                impl.function(**kwargs)
            except Exception as exc:
                if _strict() or impl.plugin_name == CORE_PLUGIN:
                    raise
                log.warning("anyquant plugin %s failed to %s and was skipped: %s", impl.plugin_name, what, exc)
                self._infos.setdefault(
                    impl.plugin_name, PluginInfo(impl.plugin_name, None)
                ).error = f"{hook} raised {type(exc).__name__}: {exc}"

    def plugins(self) -> list[PluginInfo]:
        self.pm  # noqa: B018 - discover
        return list(self._infos.values())

    def formats(self) -> dict[str, FormatSpec]:
        self.pm  # noqa: B018
        return {k: v[0] for k, v in self._formats.items()}

    def format(self, name: str) -> FormatSpec:
        formats = self.formats()
        if name not in formats:
            raise UnsupportedFormatError(
                f"format {name!r} is not registered by any installed plugin "
                f"(registered: {sorted(formats)}). {_install_hint(name)}"
            )
        return formats[name]

    def format_owner(self, name: str) -> str:
        self.pm  # noqa: B018
        return self._formats[name][1]

    # ------------------------------------------------------------------ detection
    def claims(
        self,
        probe: Probe,
        failures: list[str] | None = None,
        broken: list[str] | None = None,
        verdicts: list[tuple[str, AnyquantError]] | None = None,
    ) -> list[tuple[str, Claim]]:
        """Ask every plugin; return ``(plugin name, claim)`` for each that claimed. A plugin whose hook raises
        is skipped for this checkpoint (logged, shown by :meth:`plugins` with the checkpoint's path, and
        collected in ``failures``, which the "unknown format" message quotes first); later checkpoints still
        ask it. A third-party plugin's hook runs under :data:`DETECT_SECONDS`; one that overruns is abandoned
        for this checkpoint like one that raised. A failure other than a typed :class:`AnyquantError` (the
        plugin's own bug, or a hang) is also collected in ``broken``: :meth:`detect` raises it as a
        :class:`PluginError` when no other plugin claimed the checkpoint. A typed :class:`AnyquantError` (the
        plugin's verdict that the checkpoint is its format but malformed) is also collected in ``verdicts``."""
        out: list[tuple[str, Claim]] = []
        for impl in self.pm.hook.anyquant_detect.get_hookimpls():
            name = impl.plugin_name
            try:
                if name == CORE_PLUGIN or name in FIRST_PARTY_PLUGINS:  # anyquant's own code: inline
                    claim = impl.function(probe=probe)
                else:
                    claim = _bounded(functools.partial(impl.function, probe=probe), DETECT_SECONDS)
            except Exception as exc:
                if _strict() or name == CORE_PLUGIN:
                    if isinstance(exc, _Late):
                        raise PluginError(f"anyquant plugin {name}'s anyquant_detect {exc}") from None
                    raise
                if isinstance(exc, _Late):
                    failure = f"anyquant_detect {exc} ({_disable_hint(name)})"
                elif isinstance(exc, AnyquantError):  # the plugin's own verdict on the checkpoint (a field it names)
                    failure = f"anyquant_detect raised {type(exc).__name__}: {exc}"
                else:
                    failure = (
                        f"anyquant_detect failed with {type(exc).__name__}: {exc} (a bug in the plugin, or input "
                        f"it does not check; {_disable_hint(name)})"
                    )
                log.warning("anyquant plugin %s failed in anyquant_detect and was skipped: %s", name, failure)
                self._infos.setdefault(name, PluginInfo(name, None)).error = f"{failure} (on {probe.path})"
                if failures is not None:
                    failures.append(f"{name}'s {failure}")
                if broken is not None and not isinstance(exc, AnyquantError):
                    broken.append(f"{name}'s {failure}")
                if verdicts is not None and isinstance(exc, AnyquantError):
                    verdicts.append((name, exc))
                continue
            if claim is None:
                continue
            if not isinstance(claim, Claim):
                log.warning("plugin %s returned %r from anyquant_detect, not a Claim; ignored", name, claim)
                continue
            out.append((name, claim))
        return out

    def detect(self, probe: Probe, *, format: str | None = None) -> Detection:
        """Resolve detection to exactly one format, or raise a typed error (see ARCHITECTURE.md)."""
        failures: list[str] = []
        broken: list[str] = []
        verdicts: list[tuple[str, AnyquantError]] = []
        claims = self.claims(probe, failures, broken, verdicts)
        declared = probe.quant_method
        declared_id = QUANT_METHOD_ALIASES.get(declared, declared) if declared else None
        if format is not None:
            format = format.lower()
            self.format(format)  # a format no plugin registers (a typo): say so, not what the tensors are
            matching = [c for c in claims if c[1].format == format]
            if not matching:
                seen = [c[1].format for c in claims] or ["nothing claimed it"]
                raise FormatMismatchError(
                    f"format={format!r} was asked for, but the checkpoint's tensors say {seen}. "
                    f"Seen: {probe.describe()}. Drop format= or pass the right one."
                )
            claims = matching
        if not claims and broken:  # a plugin crashed or hung where it might have claimed: it is named, first
            raise PluginError(
                f"on {probe.path}, plugin {'; plugin '.join(broken)}. Without it: "
                + self._unknown_message(probe, declared_id, [f for f in failures if f not in broken])
            )
        if not claims and format is None:
            _raise_verdict(verdicts, PLUGIN_FOR_FORMAT.get(declared_id or ""))
        if not claims:
            from .builtin import looks_dense

            if declared_id is not None and looks_dense(probe):
                raise FormatConflictError(
                    f"config declares quant_method={declared!r}, but every tensor is dense (float "
                    f"weights, no quantization tensors). Seen: {probe.describe()}. anyquant never "
                    "loads a checkpoint that says it is quantized as dense: remove the "
                    "quantization_config if the weights really are unquantized."
                )
            raise UnknownFormatError(self._unknown_message(probe, declared_id, failures))
        if len(claims) > 1:
            who = ", ".join(f"{plugin} -> {c.format}" for plugin, c in claims)
            names = sorted({c.format for _, c in claims})
            own = {CORE_PLUGIN, *FIRST_PARTY_PLUGINS}
            outsiders = [p for p, _ in claims if p not in own]
            if outsiders and len(outsiders) < len(claims):  # anyquant's own plugin claims it too: name the others
                many = len(outsiders) > 1
                disable = (
                    f"third-party plugin{'s' if many else ''} {', '.join(outsiders)} also claim{'' if many else 's'} "
                    f"what anyquant's own plugins recognise; if {'they are' if many else 'it is'} wrong, disable "
                    f"{'them' if many else 'it'} with ANYQUANT_DISABLE_PLUGINS={','.join(outsiders)}"
                )
            else:
                disable = f"disable all but one with ANYQUANT_DISABLE_PLUGINS ({', '.join(p for p, _ in claims)})"
            raise AmbiguousFormatError(
                f"{len(claims)} plugins claim {probe.path}: {who}. "
                + (
                    f"Pass format=<one of {names}> or {disable}."
                    if len(names) > 1
                    else f"They name the same format: {disable}."
                )
            )
        plugin, claim = claims[0]
        if declared_id is not None and claim.format != declared_id:
            raise FormatConflictError(
                f"config declares quant_method={declared!r}, but the tensors are {claim.format}"
                f"{f' ({claim.variant})' if claim.variant else ''}: {'; '.join(claim.evidence[:3])}. "
                "The tensors decide what a checkpoint is; fix or remove the quantization_config."
            )
        return Detection(
            format=claim.format,
            variant=claim.variant,
            evidence=tuple(claim.evidence),
            details=dict(claim.details),
            plugin=plugin,
            path=probe.path,
            notes=tuple(probe.notes),
        )

    def _unknown_message(self, probe: Probe, declared_id: str | None, failures: Sequence[str] = ()) -> str:
        installed = sorted(self.formats())
        lines = [f"no installed plugin recognises {probe.path}.", f"Seen: {probe.describe()}."]
        if failures:  # the likely cause: say it first (a plugin bug, or a config it could not read)
            lines.append(f"On this checkpoint {'; '.join(failures)}.")
        guess = declared_id or _guess_format(probe)
        if guess and guess not in installed:
            dist = PLUGIN_FOR_FORMAT.get(guess)
            off = self._infos.get(dist) if dist else None
            if off is not None and off.error == "disabled":
                lines.append(
                    f"It looks like {guess!r}; its plugin {dist} is installed but disabled (ANYQUANT_DISABLE_PLUGINS)."
                )
            elif off is not None and off.error:
                lines.append(f"It looks like {guess!r}; its plugin {dist} is installed but broken: {off.error}.")
            else:
                hint = f"pip install {dist}" if dist else "no anyquant plugin for it is known"
                lines.append(f"It looks like {guess!r}, which no installed plugin loads: {hint}.")
        elif guess and not failures:
            lines.append(f"It looks like {guess!r}, but its tensors do not match that format's signature.")
        elif not failures:
            from .builtin import integer_tensors

            codes = integer_tensors(probe)
            if codes:
                kinds = sorted({n.rsplit(".", 1)[-1] for n in codes})
                lines.append(
                    f"It holds {len(codes)} integer tensors (*.{', *.'.join(kinds[:5])}): quantized codes of a "
                    "format whose plugin is not installed, so it is not loaded as dense either."
                )
        lines.append(f"Installed formats: {installed}.")
        for note in probe.notes:
            lines.append(f"Note: {note}")
        return " ".join(lines)

    def plugin_modules(self) -> dict[str, ModuleType | object]:
        return {name: plugin for name, plugin in self.pm.list_name_plugin() if plugin is not None}


def _guess_format(probe: Probe) -> str | None:
    suffixes = probe.suffixes()
    if "trellis" in suffixes:
        return "exl3"
    if "q_weight" in suffixes and "q_invperm" in suffixes:
        return "exl2"
    if "qweight" in suffixes:
        return "gptq" if "g_idx" in suffixes else "awq"
    if "weight_packed" in suffixes:
        return "compressed-tensors"
    if "weight_scale_inv" in suffixes:
        return "fp8"
    if "absmax" in suffixes or "SCB" in suffixes:
        return "bnb"
    if "scales" in suffixes and any(
        (w := probe.tensors.get(f"{m}.weight")) is not None and w.dtype == "U32" for m in probe.modules_with("scales")
    ):
        return "mlx"
    if any(s.endswith("_blocks") for s in suffixes) and any(s.endswith("_scales") for s in suffixes):
        return "mxfp4"
    if probe.gguf:
        return "gguf"
    return None


def _install_hint(fmt: str) -> str:
    dist = PLUGIN_FOR_FORMAT.get(fmt)
    return f"Install it: pip install {dist}" if dist else ""


def _plugin_name(plugin: object) -> str:
    return str(getattr(plugin, "__name__", None) or type(plugin).__name__)


def _raise_verdict(verdicts: list[tuple[str, AnyquantError]], owner: str | None) -> None:
    """When no plugin claimed a checkpoint, the typed error of the plugin that found it to be its format but
    malformed (a field or tensor it names) is the error, not "no installed plugin recognises it": the declared
    format's plugin's, else the one plugin's that raised one."""
    mine = [v for v in verdicts if v[0] == owner] if owner else []
    chosen = mine or (verdicts if len(verdicts) == 1 else [])
    if len(chosen) != 1:
        return
    name, exc = chosen[0]
    try:
        typed = type(exc)(f"{exc} (found by {name}, which reads this format)")
    except Exception:  # an error class with another constructor: raised as it is
        raise exc from None
    raise typed from exc


#: the plugins anyquant itself ships (entry-point name = distribution name): the formats', and the server's
#: (registered before any third party's, so ``anyquant serve`` is anyquant-serve's)
FIRST_PARTY_PLUGINS = (
    "anyquant-runtime",
    "anyquant-gptq",
    "anyquant-awq",
    "anyquant-exl3",
    "anyquant-gguf",
    "anyquant-compressed-tensors",
    "anyquant-fp8",
    "anyquant-bnb",
    "anyquant-mlx",
    "anyquant-mxfp4",
    "anyquant-serve",
    "anyquant-cpu",
    "anyquant-tools",
)


def _ep_distribution(ep: md.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return str(dist.metadata["Name"]) if dist is not None and dist.metadata["Name"] else None


def _entry_point_order(ep: md.EntryPoint) -> tuple[int, str]:
    first = ep.name in FIRST_PARTY_PLUGINS and (_ep_distribution(ep) or ep.name).replace("_", "-") == ep.name
    return (0 if first else 1, ep.name)


def _ep_version(ep: md.EntryPoint) -> str | None:
    """The version of the distribution that declares ``ep`` (its name may differ from the entry point's)."""
    dist = getattr(ep, "dist", None)
    if dist is not None:
        try:
            return str(dist.version)
        except Exception:  # a malformed METADATA: no version rather than no plugin
            return None
    return _dist_version(ep.name)


def unknown_hooks(plugin: object) -> list[str]:
    """Notes on attributes of ``plugin`` named like a hook (``anyquant_*``) that no hook specification has:
    pluggy ignores them silently, so a misspelt hook would never be called."""
    import difflib

    known = [n for n in dir(hookspecs) if n.startswith("anyquant_")]
    notes = []
    for attr in dir(plugin):
        value = getattr(plugin, attr, None)
        if not attr.startswith("anyquant_") or not callable(value):
            continue
        if attr not in known:
            close = difflib.get_close_matches(attr, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            notes.append(f"{attr} is not an anyquant hook and is never called{hint}; hooks: {known}")
        elif not hasattr(value, f"{ENTRY_POINT_GROUP}_impl"):
            notes.append(f"{attr} is not marked with @anyquant.hookimpl and is never called")
    return notes


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def load_spec_object(spec: FormatSpec, attr: str, *, factory: Callable[[Any], Any] | None = None) -> Any:
    """Check ``spec.requires``, then import ``spec.<attr>`` ("module:Class") and instantiate it."""
    ref = getattr(spec, attr)
    if ref is None:
        raise UnsupportedFormatError(
            f"format {spec.name!r} is recognised but has no {attr}. {spec.install_hint}".strip()
        )
    check_requirements(spec.requires, what=f"format {spec.name!r}")
    try:
        cls = import_object(ref)
    except ImportError as exc:
        raise MissingDependencyError(
            f"format {spec.name!r}: importing {ref} failed ({exc}). {spec.install_hint}".strip()
        ) from exc
    return factory(cls) if factory else cls()
