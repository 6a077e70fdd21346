"""Backends: the one backend choice (:func:`anyquant.backends.choose_backend`), the ``anyquant_register_backends``
hook, and every loader deciding through the one function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import anyquant
from anyquant import BackendInfo, BackendSpec, Registry, hookimpl
from anyquant.backends import EXACT_BACKENDS, backend_status, choose_backend, runs_on
from anyquant.errors import ParameterError, UnsupportedBackendError

CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
INFOS = [
    BackendInfo("gpu-kernels", True, devices=("cuda",)),
    BackendInfo("cpu-fast", True, devices=("cpu",)),
    BackendInfo("dequantized", True),
    BackendInfo("reference", True),
]
ORDER = ("gpu-kernels", "cpu-fast", "dequantized", "reference")


def test_auto_takes_the_first_backend_that_runs_on_the_device() -> None:
    assert choose_backend("toy", INFOS, ORDER, "auto", CUDA) == "gpu-kernels"
    assert choose_backend("toy", INFOS, ORDER, "auto", CPU) == "cpu-fast"
    assert choose_backend("toy", INFOS, ORDER, "auto", META) == "dequantized"


def test_auto_passes_by_what_the_checkpoint_rules_out_and_unavailable_backends() -> None:
    skip = {"cpu-fast": "no layer takes its kernels", "dequantized": "too big"}
    assert choose_backend("toy", INFOS, ORDER, "auto", CPU, skip=skip) == "reference"
    down = [BackendInfo("cpu-fast", False, "no AVX2", devices=("cpu",)), *INFOS[2:]]
    assert choose_backend("toy", down, ORDER, "auto", CPU) == "dequantized"
    with pytest.raises(UnsupportedBackendError, match="no toy backend can run here: cpu-fast: no AVX2; dequantized: x"):
        choose_backend("toy", down[:2], ORDER, "auto", CPU, skip={"dequantized": "x"})


def test_a_backend_asked_for_by_name_is_checked() -> None:
    assert choose_backend("toy", INFOS, ORDER, "reference", CUDA) == "reference"
    # the checkpoint's skips are for auto only: asked for by name, it runs
    assert choose_backend("toy", INFOS, ORDER, "cpu-fast", CPU, skip={"cpu-fast": "x"}) == "cpu-fast"
    with pytest.raises(UnsupportedBackendError, match=r"'packed' is not a toy backend; choose one of \["):
        choose_backend("toy", INFOS, ORDER, "packed", CPU)
    with pytest.raises(UnsupportedBackendError, match="'cpu-fast' runs on the CPU, not on cuda"):
        choose_backend("toy", INFOS, ORDER, "cpu-fast", CUDA)
    with pytest.raises(UnsupportedBackendError, match="'gpu-kernels' runs on CUDA GPUs only, not on cpu"):
        choose_backend("toy", INFOS, ORDER, "gpu-kernels", CPU)
    down = [BackendInfo("cpu-fast", False, "no AVX2", devices=("cpu",))]
    with pytest.raises(UnsupportedBackendError, match="toy backend 'cpu-fast' cannot run here: no AVX2"):
        choose_backend("toy", down, ORDER, "cpu-fast", CPU)
    with pytest.raises(UnsupportedBackendError, match="use vLLM"):
        choose_backend("toy", INFOS, ORDER, "gptqmodel", CUDA, refuse={"gptqmodel": "toy has none: use vLLM"})


def test_runs_on() -> None:
    assert runs_on(INFOS[0], CUDA) and not runs_on(INFOS[0], CPU) and runs_on(INFOS[0], "cuda")
    assert runs_on(INFOS[2], META)


def test_every_first_party_loader_decides_through_the_one_function() -> None:
    """No loader keeps a backend choice of its own: a ``choose_backend`` a loader defines ends in
    :func:`anyquant.backends.choose_backend` or its base's (the int4 base adds GPTQModel's request checks)."""
    root = Path(__file__).resolve().parents[2]
    paths = sorted(root.glob("plugins/*/src/**/loader.py"))  # the runtime's int4 base among them
    bodies = []
    for path in paths:
        for chunk in path.read_text().split("    def choose_backend(")[1:]:
            body = chunk.split("\n    def ", 1)[0]
            bodies.append(body)
            assert "return choose_backend(" in body or "super().choose_backend(" in body, path
            assert "for name in" not in body and "backend_order" not in body.replace("self.backend_order", ""), path
    assert len(bodies) == 3  # the int4 base, its packed-format base, GGUF's (which counts the linears its kernels take)


def test_first_party_loaders_on_devices() -> None:
    from anyquant_exl3.loader import EXL3Loader
    from anyquant_gguf.loader import GGUFLoader
    from anyquant_mxfp4.loader import MXFP4Loader

    for loader in (EXL3Loader(), MXFP4Loader()):
        with pytest.raises(UnsupportedBackendError, match="runs on the CPU"):
            loader.choose_backend("cpu-fast", CUDA)
        assert loader.choose_backend("auto", META) == "dequantized"
    gguf = GGUFLoader()
    assert gguf.choose_backend("auto", META, kernel_linears=3) == "dequantized"
    assert gguf.choose_backend("auto", CPU, kernel_linears=0) == "dequantized"
    with pytest.raises(UnsupportedBackendError, match="runs on the CPU"):
        gguf.choose_backend("cpu-fast", CUDA)


class _Toy:
    @staticmethod
    @hookimpl
    def anyquant_register_backends(register):  # type: ignore[no-untyped-def]
        register(BackendSpec("toy-npu", "a toy", devices=("npu",), layouts=("int4-groups",), status=None))


def test_registered_backends(capsys: pytest.CaptureFixture[str]) -> None:
    reg = Registry(entry_points=True, plugins=[("toy", _Toy())])
    backends = reg.backends()
    assert {"cpu-fast", "gptqmodel", "exllamav3", "toy-npu"} <= set(backends)
    assert reg.backend_owner("toy-npu") == "toy" and reg.backend_owner("cpu-fast") == "anyquant-cpu"
    assert reg.backend_owner("gptqmodel") == "anyquant-runtime"
    assert backends["cpu-fast"].engine == "anyquant_cpu.backend"
    assert backends["cpu-fast"].devices == ("cpu",) and "gguf-blocks" in backends["cpu-fast"].layouts
    assert backend_status(None) == (True, "")
    ok, reason = backend_status("no_such_module_anyquant:status")
    assert not ok and "ModuleNotFoundError" in reason


def test_a_backend_name_is_registered_once(caplog: pytest.LogCaptureFixture) -> None:
    class Again:
        @staticmethod
        @hookimpl
        def anyquant_register_backends(register):  # type: ignore[no-untyped-def]
            register(BackendSpec("gptqmodel", "mine"))

    class Exact:
        @staticmethod
        @hookimpl
        def anyquant_register_backends(register):  # type: ignore[no-untyped-def]
            register(BackendSpec(EXACT_BACKENDS[0], "mine"))

    class First:
        @staticmethod
        @hookimpl
        def anyquant_register_backends(register):  # type: ignore[no-untyped-def]
            register(BackendSpec("gptqmodel", "the first"))

    reg = Registry(entry_points=False, plugins=[("first", First()), ("again", Again()), ("exact", Exact())])
    info = {p.name: p for p in reg.plugins()}
    assert "already registered by first" in (info["again"].error or "")
    assert "already registered by every format loader" in (info["exact"].error or "")
    assert reg.backend_owner("gptqmodel") == "first" and reg.backends()["gptqmodel"].description == "the first"

    class Half:  # its format registers, its backend does not: the plugin is skipped whole
        @staticmethod
        @hookimpl
        def anyquant_register_formats(register):  # type: ignore[no-untyped-def]
            register(anyquant.FormatSpec(name="halfq", loader=None))

        @staticmethod
        @hookimpl
        def anyquant_register_backends(register):  # type: ignore[no-untyped-def]
            register("not a spec")

    reg = Registry(entry_points=False, plugins=[("half", Half())])
    assert "halfq" not in reg.formats() and "not a BackendSpec" in (reg.plugins()[-1].error or "")


def test_a_backend_spec_names_known_layouts() -> None:
    with pytest.raises(ParameterError, match="not among"):
        BackendSpec("x", layouts=("int3-magic",))


def test_the_backends_command_lists_registered_backends(capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.cli import main

    assert main(["backends", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    fast = payload["backends"]["cpu-fast"]
    assert fast["plugin"] == "anyquant-cpu" and fast["devices"] == ["cpu"] and isinstance(fast["available"], bool)
    assert payload["backends"]["exllamav3"]["plugin"] == "anyquant-exl3"
    assert "gptq" in payload["formats"]
