"""A backend registered by a third party gets every format whose layers offer its layouts, with no format code.

A toy backend (``toy-cpu``: it runs ``int4-groups``, its engine holds each layer's exact weight in an ``nn.Linear``)
is registered through the hook, as a plugin would: the GPTQ and compressed-tensors loaders list it, accept its load
option, make its plan before anything is read, hand it their reference linears and let it finish the model; its
logits are the exact backend's. Formats whose layers offer other layouts (EXL3, GGUF) do not list it."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import anyquant
import anyquant.api
from anyquant.plugin import BackendSpec, ParameterError, hookimpl
from anyquant.registry import Registry
from anyquant_runtime import cpu as runtime_cpu
from anyquant_runtime.layouts import Int4Groups
from tests.peers.catalog import GPTQ_BF16_VARIANT, gptqmodel_gptq_quantized_dir

ENGINE = "anyquant_test_toy_engine"
CT_W4A16 = Path(__file__).resolve().parents[1] / "plugins" / "compressed_tensors" / "tests" / "fixtures" / "llama_gptq"


class ToyPlan:
    """One load on the toy backend: each layer that offers ``Int4Groups`` becomes an ``nn.Linear`` of its exact
    weight; the others stay on their exact path (as an engine's fallback does)."""

    def __init__(self, extra: Mapping[str, Any]) -> None:
        self.scale = float(extra.get("toy_scale", 1.0))
        self.converted: list[str] = []
        self.finished = False

    def convert(self, name: str, layer: Any, **kwargs: Any) -> nn.Module:
        offered = layer.packed_layouts()
        if isinstance(offered, str) or not any(isinstance(lay, Int4Groups) for lay in offered):
            layer.mode = "dequantized"
            return layer.finalize()  # type: ignore[no-any-return]
        weight = layer.dequantize().float() * self.scale
        out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        out.weight = nn.Parameter(weight, requires_grad=False)
        if layer.bias is not None:
            out.bias = nn.Parameter(layer.bias.float(), requires_grad=False)
        self.converted.append(name)
        return out

    def finish(self, module: nn.Module, compute_dtype: torch.dtype, *, tables: Any = None) -> None:
        assert not tables  # the toy reads no table from the file: the base asked file_tables() first
        self.finished = True

    def summary(self) -> dict[str, Any]:
        return {"converted": len(self.converted), "finished": self.finished}

    def kv_cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype | None:
        return None

    def keeps_embedding_dtype(self) -> bool:
        return False

    def file_tables(self) -> bool:
        return False


def _engine_module() -> types.ModuleType:
    module = types.ModuleType(ENGINE)
    module.plan = ToyPlan  # type: ignore[attr-defined]
    module.layout_kinds_run = lambda *kinds: (True, "")  # type: ignore[attr-defined]
    module.layouts_run = lambda layers: sum(1 for x in layers if not isinstance(x, str))  # type: ignore[attr-defined]
    return module


class _ToyPlugin:
    @staticmethod
    @hookimpl
    def anyquant_register_backends(register):  # type: ignore[no-untyped-def]
        register(
            BackendSpec(
                "toy-cpu",
                "a toy: int4 groups as exact nn.Linear weights",
                devices=("cpu",),
                layouts=("int4-groups",),
                engine=ENGINE,
                options={"toy_scale": "a factor on every converted weight (default 1.0)"},
            )
        )


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterable[None]:
    monkeypatch.setitem(sys.modules, ENGINE, _engine_module())
    monkeypatch.setattr(anyquant.api, "_default", Registry(entry_points=True, plugins=[("toy", _ToyPlugin())]))
    runtime_cpu.engine_of.cache_clear()
    yield
    runtime_cpu.engine_of.cache_clear()


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.module(ids).logits.float()  # type: ignore[no-any-return]


@pytest.mark.peer
@pytest.mark.parametrize("which", ["gptq", "compressed-tensors"])
def test_a_registered_backend_runs_every_format_of_its_layouts(toy: None, which: str) -> None:
    path = gptqmodel_gptq_quantized_dir() / "quantized" / GPTQ_BF16_VARIANT if which == "gptq" else CT_W4A16
    if not (path / "config.json").is_file():
        pytest.skip(f"{path} is not here")
    exact = anyquant.load(path, backend="dequantized")
    fast = anyquant.load(path, backend="toy-cpu")
    assert fast.backend == "toy-cpu" and fast.info["toy_cpu"]["finished"]
    assert fast.info["toy_cpu"]["converted"] > 0
    ids = torch.tensor([[1, 42, 7, 30, 11, 5]])
    ref = _logits(exact, ids)
    assert torch.allclose(_logits(fast, ids), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    # its option reaches its plan (and only loaders offered the backend accept it)
    scaled = anyquant.load(path, backend="toy-cpu", toy_scale=0.0)
    assert not torch.allclose(_logits(scaled, ids), ref)


def test_backends_follow_layouts_not_formats(toy: None) -> None:
    from anyquant_ct.loader import CTLoader
    from anyquant_exl3.loader import EXL3Loader
    from anyquant_gguf.loader import GGUFLoader
    from anyquant_gptq.loader import GPTQLoader

    for loader in (GPTQLoader(), CTLoader()):
        names = [b.name for b in loader.backends()]
        assert "toy-cpu" in names and "toy_scale" in loader.load_options
        # auto's order: the format's accelerator backends, the fast ones in registration order, the exact ones
        order = loader.preference()
        assert order.index("toy-cpu") < order.index("dequantized")
    for loader in (EXL3Loader(), GGUFLoader()):
        assert "toy-cpu" not in [b.name for b in loader.backends()] and "toy_scale" not in loader.load_options
        with pytest.raises(anyquant.UnsupportedBackendError, match=r"not an? \w+ backend"):
            loader.choose_backend("toy-cpu", torch.device("cpu"))


def test_a_backends_options_are_checked_for_the_formats_of_its_layouts(toy: None) -> None:
    """``cpu-fast``'s layout-scoped options: a GGUF file's loader takes ``cpu_fast_activation_passes`` (its blocks)
    and not ``cpu_fast_weights`` (no rounded int8 blocks), EXL3's the other way round, GPTQ's neither."""
    from anyquant_exl3.loader import EXL3Loader
    from anyquant_gguf.loader import GGUFLoader
    from anyquant_gptq.loader import GPTQLoader

    if "cpu-fast" not in anyquant.api.default_registry().backends():
        pytest.skip("anyquant-cpu is not installed")
    gguf, exl3, gptq = GGUFLoader().load_options, EXL3Loader().load_options, GPTQLoader().load_options
    assert "cpu_fast_activation_passes" in gguf and "cpu_fast_weights" not in gguf
    assert "cpu_fast_weights" in exl3 and "cpu_fast_activation_passes" not in exl3
    assert not {"cpu_fast_weights", "cpu_fast_activation_passes"} & set(gptq)
    assert {"cpu_fast_prefill", "cpu_fast_head"} <= set(gguf) & set(exl3) & set(gptq)
    with pytest.raises(ParameterError, match="cpu_fast_activation_passes"):
        anyquant.api._check_options(GPTQLoader(), {"cpu_fast_activation_passes": 1}, "gptq")
