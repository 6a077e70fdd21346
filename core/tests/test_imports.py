"""The import graph: no circles in core or the first-party distributions, imports run one way (core <- runtime <-
tools <- formats, the engine and the server; issue #41), plugins import only the declared APIs, and the plugin API
(``anyquant.plugin``) is exactly what it declares.

Every import counts, module-level and function-level (lazy) alike, and those under ``if TYPE_CHECKING:``: a
lazy import is still a dependency, and a circle through one is a circle (issue #29 counted them). ``from
package import name`` is an edge to the submodule when ``name`` is one, else to the package's ``__init__``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
FIRST_PARTY_PLUGINS = (
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
#: what of core a plugin may import: the plugin API and the test kit (the runtime's modules and the tools' declared
#: names are checked below)
PLUGIN_MAY_IMPORT = ("anyquant.plugin", "anyquant.testing")
#: the distributions above core, in import order: each may import those before it, never one after it
WINGS = ("anyquant", "anyquant_runtime", "anyquant_tools")
#: the distributions that are applications of anyquant rather than formats (the server): they may also use the
#: public top-level API (``anyquant.load``, ``anyquant.detect``, ``anyquant.default_model``: ``anyquant.__all__``)
#: as any app does; a format plugin may not (its loader runs inside ``load``)
APPLICATIONS = ("anyquant_serve",)


def _modules(package: str) -> dict[str, Path]:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    root = Path(next(iter(spec.submodule_search_locations)))
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> list[str]:
    """What ``module`` imports, as absolute dotted names: ``import x.y`` gives ``x.y``, ``from x import y``
    gives ``x.y`` (a submodule, or a name defined in ``x``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found += [f"{source}.{a.name}" for a in node.names]
    return found


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports: each imported name resolved to the longest module name it
    starts with (``anyquant.errors.QuantizeError`` -> ``anyquant.errors``; ``anyquant.__version__`` ->
    ``anyquant``, the package's ``__init__``)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in _imports(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package: str) -> None:
    graph = _graph(package)
    cycles = _cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in cycles]
    assert not cycles, f"import circles in {package}: {detail}"


def test_the_circle_finder_finds_circles() -> None:
    """The test above would pass on a graph it cannot read: a known circle is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", FIRST_PARTY_PLUGINS)
def test_plugins_import_only_the_plugin_api(package: str) -> None:
    """A plugin imports core through ``anyquant.plugin`` (plus the test kit), the runtime through its modules, and the
    tools through the names ``anyquant_tools`` declares: never a tool module (sizing, calibration, evaluate, cli
    ...), whose internals may change. An application (:data:`APPLICATIONS`: the server) may also import the
    top-level public API, ``from anyquant import load``."""
    import anyquant
    import anyquant_tools

    public = {f"anyquant.{n}" for n in anyquant.__all__} if package in APPLICATIONS else set()
    tools = {f"anyquant_tools.{n}" for n in anyquant_tools.__all__}
    bad = []
    for module, path in _modules(package).items():
        for name in _imports(module, path):
            core = name == "anyquant" or name.startswith("anyquant.")
            if core and not any(name.startswith(a + ".") for a in PLUGIN_MAY_IMPORT) and name not in public:
                bad.append(f"{module}: {name}")
            if name.startswith("anyquant_tools") and name not in tools:
                bad.append(f"{module}: {name}")
    assert not bad, bad


@pytest.mark.parametrize("wing", WINGS)
def test_imports_run_one_way(wing: str) -> None:
    """Core imports neither the runtime, the tools nor any plugin; the runtime imports core alone; the tools core and
    the runtime (a name under ``if TYPE_CHECKING:`` aside: core's ``__init__`` annotates the names it forwards)."""
    later = [w for w in WINGS[WINGS.index(wing) + 1 :]] + list(FIRST_PARTY_PLUGINS)
    bad = [
        f"{module}: {n}"
        for module, path in _modules(wing).items()
        for n in _unguarded_absolute_imports(path)
        if n.split(".")[0] in later
    ]
    assert not bad, bad


def _unguarded_absolute_imports(path: Path) -> list[str]:
    """The modules ``path`` imports by absolute name (``import x.y``, ``from x.y import z``: ``x.y``), but those
    under ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guarded = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and id(node) not in guarded:
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and id(node) not in guarded and not node.level:
            found.append(node.module or "")
    return found


@pytest.mark.parametrize("package", FIRST_PARTY_PLUGINS)
def test_plugins_do_not_import_each_other(package: str) -> None:
    """Each plugin is its own distribution: what two formats share lives in core (``anyquant_runtime.int4`` for GPTQ and
    AWQ), so none imports a sibling (the AWQ plugin once imported eight names from ``anyquant_gptq.loader``), the CPU
    engine's distribution included: a format reaches it through ``anyquant_runtime.cpu`` (GGUF's and EXL3's engine
    code moved into it, #41 §1)."""
    siblings = [p for p in FIRST_PARTY_PLUGINS if p != package]
    bad = [
        f"{module}: {name}"
        for module, path in _modules(package).items()
        for name in _imports(module, path)
        if any(name == s or name.startswith(s + ".") for s in siblings)
    ]
    assert not bad, bad


def test_core_names_the_engine_in_one_place() -> None:
    """Core and the runtime reach the CPU engine through the registered ``cpu-fast`` backend
    (:mod:`anyquant_runtime.cpu`), never by importing anyquant-cpu (a type annotation aside): without it installed
    every format still loads."""
    bad = [
        f"{module}: {n}"
        for module, path in {**_modules("anyquant"), **_modules("anyquant_runtime")}.items()
        for n in _unguarded_absolute_imports(path)
        if n.split(".")[0] == "anyquant_cpu"
    ]
    assert not bad, bad


@pytest.mark.parametrize("wing", WINGS[1:])
def test_wings_use_only_declared_core_names(wing: str) -> None:
    """The runtime and the tools are distributions of their own: each name they import from core is declared (the
    plugin API, :mod:`anyquant.plugin`, or the public API, ``anyquant.__all__``), from whichever core module they
    import it (its home module spares a lazy hop), never a core internal (a leading underscore, a helper of one
    command) that core may change."""
    import anyquant
    import anyquant.plugin

    declared = set(anyquant.plugin.__all__) | set(anyquant.__all__)
    bad = []
    for module, path in _modules(wing).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "anyquant":
                bad += [f"{module}: {node.module}.{a.name}" for a in node.names if a.name not in declared]
            elif isinstance(node, ast.Import):
                bad += [f"{module}: import {a.name}" for a in node.names if a.name.startswith("anyquant.")]
    assert not bad, bad


#: the format plugins (each owns formats; none owns a backend with an engine): the first-party plugins but the
#: server and the CPU engine
FORMAT_PACKAGES = tuple(p for p in FIRST_PARTY_PLUGINS if p not in (*APPLICATIONS, "anyquant_cpu"))


@pytest.mark.parametrize("package", FORMAT_PACKAGES)
def test_format_plugins_name_no_shared_backend(package: str) -> None:
    """#41 §1: a format supplies its reference decode and the layouts its layers offer; the runtime's loader base
    offers it every registered backend that runs one of them (their options, plans and records included), so a format
    plugin's source never names one (``cpu-fast``, its ``cpu_fast_*`` options), not even in a docstring."""
    bad = [
        f"{module}:{n}: {line.strip()}"
        for module, path in _modules(package).items()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"cpu[_-]fast", line)
    ]
    assert not bad, bad


PLUGIN_API = [
    "AnyquantError",
    "BackendInfo",
    "BackendSpec",
    "CalibrationRegistrar",
    "Cap",
    "CheckpointError",
    "Claim",
    "CommandRegistrar",
    "ConfigError",
    "Detection",
    "EXACT_BACKENDS",
    "FormatConflictError",
    "FormatSpec",
    "GGUFHeader",
    "GGUFSkippedArray",
    "GGUFTensorInfo",
    "GGUF_TYPE_SIZES",
    "GenerationParams",
    "GenerationResult",
    "Generator",
    "JSON_HELP",
    "LAYOUT_KINDS",
    "LoadOptions",
    "LoadedModel",
    "Loader",
    "MIN_TEMPERATURE",
    "MissingDependencyError",
    "MissingTensorError",
    "ModelClosedError",
    "ModelShape",
    "ModuleInfo",
    "NumericalError",
    "ParameterError",
    "PickleRefusedError",
    "Probe",
    "Prompt",
    "QuantizeError",
    "QuantizeFlag",
    "QuantizeSpec",
    "Quantizer",
    "SAFETENSORS_DTYPE_BITS",
    "SizingError",
    "StreamChunk",
    "TOKENIZER_FILES",
    "TensorInfo",
    "Timings",
    "TokenLogprob",
    "UnsupportedBackendError",
    "UnsupportedFormatError",
    "Usage",
    "__version__",
    "add_load_flags",
    "add_option_flag",
    "bits_per_weight",
    "choose_backend",
    "collect",
    "dense_rows",
    "display_name",
    "emit",
    "hookimpl",
    "import_object",
    "json_line",
    "load_spec_object",
    "loads_json",
    "looks_dense",
    "model_shape",
    "on_off",
    "options_from",
    "parse_model_id",
    "progress_bar",
    "read_checkpoint_json",
    "read_gguf_header",
    "release_free_heap",
    "report_of",
    "require_inside",
    "resolve_checkpoint",
    "strict_plugins",
    "tensors_by_module",
    "thaw",
    "undeclared_options",
    "with_revision",
]


def test_plugin_api_is_pinned() -> None:
    """``anyquant.plugin.__all__`` is the plugin API: adding or removing a name is a decision, made here."""
    import anyquant.plugin

    assert anyquant.plugin.__all__ == PLUGIN_API
    assert sorted(anyquant.plugin.__all__) == anyquant.plugin.__all__
    assert set(anyquant.plugin._EXPORTS) | {"__version__"} == set(PLUGIN_API)


def test_plugin_api_imports_without_torch() -> None:
    """Every name of the plugin API resolves without importing torch (a plugin's hook module is imported at
    discovery), and each is the object its home module defines."""
    code = (
        "import importlib, sys\n"
        "import anyquant.plugin as api\n"
        "for name in api.__all__:\n"
        "    value = getattr(api, name)\n"
        "    if name != '__version__':\n"
        "        assert value is getattr(importlib.import_module('anyquant.' + api._EXPORTS[name]), name), name\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_plugins_md_imports_what_the_plugin_api_has() -> None:
    """docs/plugins.md sends plugin authors to ``anyquant.plugin``: every name its examples import from it is
    there."""
    import re

    import anyquant.plugin

    doc = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
    if not doc.is_file():
        pytest.skip("no docs/plugins.md beside this checkout's tests")
    text = doc.read_text(encoding="utf-8")
    imported = [n.strip() for m in re.findall(r"from anyquant\.plugin import ([\w, ]+)", text) for n in m.split(",")]
    assert imported and set(imported) <= set(anyquant.plugin.__all__), set(imported) - set(anyquant.plugin.__all__)
