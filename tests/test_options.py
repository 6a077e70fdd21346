"""Keyword options: what each loader and quantizer declares is what its code reads, and anything else
is refused before any work (a misspelt option must not be a silent no-op)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_awq.loader import AWQLoader
from anyquant_awq.quantize import AWQQuantizer
from anyquant_cpu.options import OPTION_LAYOUTS
from anyquant_cpu.options import OPTIONS as CPU_FAST_OPTIONS
from anyquant_exl3.exl2.loader import EXL2Loader
from anyquant_exl3.loader import EXL3Loader
from anyquant_exl3.quantize import EXL3Quantizer
from anyquant_gguf.loader import GGUFLoader
from anyquant_gptq.loader import GPTQLoader
from anyquant_gptq.quantize import GPTQQuantizer
from anyquant_runtime.loaders import RUNTIME_OPTIONS
from anyquant_tools.quantize import CORE_QUANTIZE_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
#: what GPTQ and AWQ loaders share (core's int4 base and GPTQModel's kernels)
INT4 = (
    "plugins/runtime/src/anyquant_runtime/int4/loader.py",
    "plugins/runtime/src/anyquant_runtime/int4/gptqmodel_kernels.py",
)
#: ``options.get("name"``, ``extra.get("name"``, ``options["name"]``, ``"name" in spec.options``
READ = re.compile(r'(?:options|extra)(?:\.get\(|\[)"(\w+)"|"(\w+)" in (?:spec\.)?options\b')
#: a call of core's ``route_backend`` reads its ``key`` option, ``quantizer_backend`` unless given
ROUTE = re.compile(r'(?<!def )route_backend\((?:[^()]|\([^()]*\))*?(?:key="(\w+)"[^()]*)?\)')
#: set by quantize() itself from ``calibration=`` (a list of texts), never passed by the caller
#: read by core for every method, declared by no quantizer of its own: "texts" (a list given as calibration), and
#: "quantizer_backend", which core's resolve_method reads only to route a method to another format's quantizer
#: (awq with "llmcompressor" -> compressed-tensors); each quantizer that runs several backends declares it itself
INTERNAL = {"texts", "quantizer_backend"}


def _reads(*files: str) -> set[str]:
    names: set[str] = set()
    for f in files:
        text = (ROOT / f).read_text()
        for a, b in READ.findall(text):
            names.add(a or b)
        names.update(key or "quantizer_backend" for key in ROUTE.findall(text))
    return names


@pytest.mark.parametrize(
    ("declared", "files"),
    [
        (
            GPTQQuantizer.quantize_options,
            ["plugins/tools/src/anyquant_tools/gptqmodel_quantizer.py", "plugins/gptq/src/anyquant_gptq/quantize.py"],
        ),
        (
            AWQQuantizer.quantize_options,
            ["plugins/tools/src/anyquant_tools/gptqmodel_quantizer.py", "plugins/awq/src/anyquant_awq/quantize.py"],
        ),
        (
            EXL3Quantizer.quantize_options,
            [
                "plugins/exl3/src/anyquant_exl3/quantize.py",
                "plugins/exl3/src/anyquant_exl3/options.py",
                "plugins/exl3/src/anyquant_exl3/exllamav3_convert.py",
                "plugins/exl3/src/anyquant_exl3/hessian.py",
            ],
        ),
    ],
    ids=["gptq", "awq", "exl3"],
)
def test_quantizers_declare_what_they_read(declared, files) -> None:  # type: ignore[no-untyped-def]
    read = _reads(*files, "plugins/tools/src/anyquant_tools/quantize.py")
    assert read - INTERNAL <= set(declared) | set(CORE_QUANTIZE_OPTIONS)
    assert set(declared) <= read  # nothing declared that nobody reads


@pytest.mark.parametrize(
    ("loader", "files"),
    [
        (GPTQLoader, ["plugins/gptq/src/anyquant_gptq/loader.py", *INT4]),
        (AWQLoader, ["plugins/awq/src/anyquant_awq/loader.py", *INT4]),
        (GGUFLoader, ["plugins/gguf/src/anyquant_gguf/loader.py"]),
        (
            EXL3Loader,
            ["plugins/exl3/src/anyquant_exl3/loader.py", "plugins/exl3/src/anyquant_exl3/exllamav3_kernels.py"],
        ),
        (
            EXL2Loader,
            ["plugins/exl3/src/anyquant_exl3/exl2/loader.py", "plugins/exl3/src/anyquant_exl3/loader.py"],
        ),
    ],
    ids=lambda v: getattr(v, "__name__", "files"),
)
def test_loaders_declare_what_they_read(loader, files) -> None:  # type: ignore[no-untyped-def]
    read = _reads(*files, "plugins/runtime/src/anyquant_runtime/loaders.py", "plugins/cpu/src/anyquant_cpu/engine.py")
    declared = set(loader().load_options)
    # the CPU engine's options, offered with the backend (those of other layouts aside)
    assert set(RUNTIME_OPTIONS) | (set(CPU_FAST_OPTIONS) - set(OPTION_LAYOUTS)) <= declared
    # the gptqmodel kernels name their options by constants: the gptq test module checks those
    # the engine reads (and checks) its layout-scoped options for every load; a loader declares those of its layouts
    kinds = {k.kind for k in loader.layout_kinds}
    scoped_out = {name for name, layouts in OPTION_LAYOUTS.items() if not kinds & set(layouts)}
    assert scoped_out.isdisjoint(declared)
    unread = {"gptqmodel_kernel", "gptqmodel_compile", "_gptqmodel_cpu"} | scoped_out
    assert read - unread <= declared | _exl3_only(loader)


def _exl3_only(loader: type) -> set[str]:
    """EXL2's loader shares EXL3's loader.py (its cpu-fast base): the exllamav3 options read there are EXL3's alone."""
    return set(EXL3Loader().load_options) if loader is EXL2Loader else set()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("tiny") / "m")


@pytest.mark.parametrize("method", ["gptq", "awq", "exl3"])
def test_unknown_quantize_option_is_refused_before_any_work(tiny: Path, tmp_path: Path, method: str) -> None:
    with pytest.raises(anyquant.QuantizeError, match=r"unknown quantize option\(s\) \['group'\]"):
        anyquant.quantize(tiny, tmp_path / "out", method=method, group=64)  # group_size= is the argument
    assert not (tmp_path / "out").exists()
