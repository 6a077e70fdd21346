"""docs/architecture.md's map of the packages matches them: every module of core, of anyquant-runtime (the torch
runtime), of anyquant-tools (the tools), of anyquant-serve (the server) and of anyquant-cpu (the CPU engine), each its
own distribution, is named in its package's box of the parts diagram, every module named there exists, the
contract's stated size holds, and core stays small (issue #41: at most 7,000 lines of Python, no compiled code)."""

from __future__ import annotations

import re
from pathlib import Path

import anyquant

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
PACKAGE = Path(anyquant.__file__).resolve().parent
#: the other distributions' packages, beside core in this checkout
RUNTIME = REPO / "plugins" / "runtime" / "src" / "anyquant_runtime"
TOOLS = REPO / "plugins" / "tools" / "src" / "anyquant_tools"
SERVE = REPO / "plugins" / "serve" / "src" / "anyquant_serve"
CPU = REPO / "plugins" / "cpu" / "src" / "anyquant_cpu"
#: a box's title -> the package directory it maps (relative to the anyquant package, or another package's own)
BOXES = {
    "core: the contract": ".",
    "core: the commands": "commands",
    "core: the plugin test kit": "testing",
    "anyquant-runtime: the runtime": str(RUNTIME),
    "anyquant-runtime: int4": str(RUNTIME / "int4"),
    "anyquant-tools: the tools": str(TOOLS),
    "anyquant-tools: the commands": str(TOOLS / "commands"),
    "anyquant-serve: the server": str(SERVE),
    "anyquant-cpu: the CPU engine": str(CPU),
}
#: modules named in a box other than their own package's (with the package they live in)
ELSEWHERE = {
    ("core: the commands", "cli.py"): ".",
    ("core: the commands", "console.py"): ".",
}
#: issue #41's bound on core
CORE_MAX_LINES = 7000


def _diagram() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## The parts")
    return text[text.index("```", start) : text.index("```", text.index("```", start) + 3)]


def _boxes() -> dict[str, str]:
    """Box title -> the box's text (from its title line to the next rule)."""
    boxes: dict[str, str] = {}
    title = None
    for line in _diagram().splitlines():
        found = next((t for t in BOXES if t in line), None)
        if found:
            title = found
            boxes[title] = ""
        elif line.lstrip().startswith("+--"):
            title = None
        elif title:
            boxes[title] += line + "\n"
    return boxes


def _named(box: str) -> set[str]:
    return set(re.findall(r"\b(\w+\.py)\b", box))


def test_every_box_is_in_the_diagram() -> None:
    assert set(_boxes()) == set(BOXES)


def test_core_has_no_server_package() -> None:
    """The server, the runtime and the tools left core for their own distributions (issue #41): none comes back."""
    # (a checkout from before the move may keep their __pycache__ folders: the modules are what counts)
    assert not any(any((PACKAGE / name).glob("*.py")) for name in ("serve", "runtime", "tools", "int4"))
    assert SERVE.is_dir() and RUNTIME.is_dir() and TOOLS.is_dir()


def test_core_is_small_and_pure_python() -> None:
    """Core holds the contract, the CLI's skeleton and the conformance kit: at most 7,000 lines of Python and no
    compiled code (the kernel is anyquant-cpu's), as docs/architecture.md says."""
    files = [f for f in PACKAGE.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    lines = sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files if f.suffix == ".py")
    assert lines <= CORE_MAX_LINES, f"core is {lines} lines of Python (at most {CORE_MAX_LINES})"
    compiled = [f.name for f in files if f.suffix in {".c", ".cc", ".cpp", ".cu", ".h", ".so", ".pyd", ".dll"}]
    assert not compiled, compiled
    stated = re.search(r"torch-free, no compiled code, ([\d,]+) lines", DOC.read_text(encoding="utf-8"))
    assert stated, "docs/architecture.md must state core's size ('torch-free, no compiled code, N lines')"
    assert abs(int(stated.group(1).replace(",", "")) - lines) <= 0.1 * lines, (stated.group(1), lines)


def test_every_module_is_named_in_its_box() -> None:
    boxes = _boxes()
    named = {(folder, name) for title, folder in BOXES.items() for name in _named(boxes[title])}
    named |= {(folder, name) for (title, name), folder in ELSEWHERE.items() if name in _named(boxes[title])}
    missing = [
        f"{folder}/{module.name}"
        for folder in BOXES.values()
        for module in sorted((PACKAGE / folder).glob("*.py"))
        if (folder, module.name) not in named and not (module.name == "__init__.py" and folder != ".")
    ]
    assert not missing, f"modules docs/architecture.md does not name in their package's box: {missing}"


def test_every_named_module_exists() -> None:
    ghosts = []
    for title, box in _boxes().items():
        for name in _named(box):
            folder = ELSEWHERE.get((title, name), BOXES[title])
            if not (PACKAGE / folder / name).is_file():
                ghosts.append(f"{title}: {name}")
    assert not ghosts, f"docs/architecture.md names modules that do not exist: {ghosts}"


def test_the_contracts_stated_size() -> None:
    """The doc says how many lines the contract wing is; the figure must stay within 15 % of the code."""
    match = re.search(r"The contract is ([\d,]+) lines in (\d+) modules", DOC.read_text(encoding="utf-8"))
    assert match, "docs/architecture.md must state the contract's size ('The contract is N lines in M modules')"
    stated, count = int(match.group(1).replace(",", "")), int(match.group(2))
    modules = [PACKAGE / name for name in _named(_boxes()["core: the contract"])]
    lines = sum(len(m.read_text(encoding="utf-8").splitlines()) for m in modules)
    assert count == len(modules), (count, len(modules))
    assert abs(lines - stated) <= 0.15 * lines, f"the contract is {lines} lines, the doc says {stated}"
