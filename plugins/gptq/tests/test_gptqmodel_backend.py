"""Backend ``gptqmodel``: GPTQModel's kernel modules behind anyquant's loader.

No GPU here: the kernel path (tensors -> GPTQModel kernel module -> post_init -> wrapper) runs on
the CPU with GPTQModel's torch kernel (load option ``_gptqmodel_cpu``), in a subprocess, against
anyquant's reference on the 16 GPTQModel-made checkpoints. The kernel choice and fallback logic is
tested with stand-in kernel classes. bench/gpu_gptq.sh runs the CUDA kernels (Marlin, Triton).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import anyquant
from anyquant.testing.fixtures import gptq_v1
from anyquant_gptq.dequant import gptq_kernel_tensors
from anyquant_gptq.loader import GPTQLoader
from anyquant_runtime.int4.gptqmodel_kernels import GPTQModelLinear, KernelPlan
from anyquant_runtime.int4.loader import Int4State
from anyquant_runtime.packing import pack_cols

WORKER = Path(__file__).resolve().parent / "gptqmodel_backend_worker.py"
#: fp16 logits of two paths whose GEMMs sum in different orders (measured: 5e-4 to 8e-4)
FP16_TOL = 2e-3
HAS_GPTQMODEL = importlib.util.find_spec("gptqmodel") is not None
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")


def run_worker(root: Path, variants: list[str]) -> dict[str, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(root), *variants], capture_output=True, text=True, timeout=1200, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["variant"]: r for r in rows}


# ---------------------------------------------------------------- without a GPU: typed answers


@no_cuda
def test_backend_is_listed_and_says_why_not() -> None:
    info = {b.name: b for b in GPTQLoader().backends()}["gptqmodel"]
    assert not info.available
    assert "CUDA" in info.reason or "not installed" in info.reason


@no_cuda
def test_load_on_cpu_is_a_typed_error(tmp_path: Path) -> None:
    path = gptq_v1(tmp_path / "ckpt")
    with pytest.raises(anyquant.UnsupportedBackendError, match="gptq backend 'gptqmodel' cannot run here"):
        anyquant.load(path, backend="gptqmodel")


@pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed")
def test_device_cpu_is_refused_without_the_test_option(tmp_path: Path) -> None:
    path = gptq_v1(tmp_path / "ckpt")
    with pytest.raises(anyquant.UnsupportedBackendError, match="gptqmodel"):
        anyquant.load(path, backend="gptqmodel", device="cpu")


@pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed")
@pytest.mark.parametrize(("kernel", "match"), [("marlin", "needs CUDA"), ("nope", "not one of")])
def test_kernel_option_is_checked_before_gptqmodel_is_imported(tmp_path: Path, kernel: str, match: str) -> None:
    path = gptq_v1(tmp_path / "ckpt")
    with pytest.raises(anyquant.UnsupportedBackendError, match=match):
        anyquant.load(path, backend="gptqmodel", device="cpu", _gptqmodel_cpu=True, gptqmodel_kernel=kernel)


HOST_SIDE_EFFECTS = """
import json, logging, os, sys
import torch
from anyquant_runtime.int4.gptqmodel_kernels import KernelPlan
env = dict(os.environ)
root = logging.getLogger()
handlers, level = root.handlers[:], root.level
# what backend="gptqmodel" does first at load: choose the kernels, importing GPTQModel
plan = KernelPlan.create(sys.argv[1], torch.device("cpu"), torch.float16, {})
assert "gptqmodel" in sys.modules and plan._candidates
changed = sorted(k for k in set(os.environ) | set(env) if os.environ.get(k) != env.get(k))
print(json.dumps({"env": changed, "handlers": root.handlers == handlers, "level": root.level == level}))
"""


@pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed")
def test_gptqmodel_import_leaves_the_host_as_it_was() -> None:
    """Importing GPTQModel moved HF_HOME and the hub caches under /tmp, set PYTORCH_ALLOC_CONF and
    CUDA_DEVICE_ORDER, put an INFO handler on the root logger and printed a banner on stdout (a CLI's
    --json output broke). The backend now puts all of that back; only JSON reaches stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "PYTORCH_ALLOC_CONF", "CUDA_DEVICE_ORDER")}
    for method in ("gptq", "awq"):
        proc = subprocess.run(
            [sys.executable, "-c", HOST_SIDE_EFFECTS, method], capture_output=True, text=True, timeout=600, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(proc.stdout.splitlines()) == 1, proc.stdout[-2000:]  # the banner went to stderr
        assert json.loads(proc.stdout) == {"env": [], "handlers": True, "level": True}


def test_declared_options_are_the_ones_read() -> None:
    """load() accepts exactly the option names the gptqmodel backend reads (GPTQ and AWQ)."""
    from anyquant_awq.loader import AWQLoader
    from anyquant_runtime.int4 import GPTQMODEL_OPTIONS
    from anyquant_runtime.int4 import gptqmodel_kernels as gk

    assert set(GPTQMODEL_OPTIONS) == {gk.KERNEL_OPTION, gk.COMPILE_OPTION, gk.CPU_TEST_OPTION}
    assert (
        set(GPTQMODEL_OPTIONS) <= set(GPTQLoader().load_options)
        and AWQLoader().load_options == GPTQLoader().load_options
    )


@no_cuda
def test_auto_on_cpu_never_picks_gptqmodel(tmp_path: Path) -> None:
    loader = GPTQLoader()
    assert loader.choose_backend("auto", torch.device("cpu")) != "gptqmodel"


# ---------------------------------------------------------------- what the tensors decide


def _words(value: int, rows: int, cols: int) -> torch.Tensor:
    return torch.full((rows, cols), value, dtype=torch.int64).to(torch.int32)


def test_v1_symmetric_zeros_become_v2_and_sym() -> None:
    t = gptq_kernel_tensors(
        _words(0x77777777, 4, 8),
        None,
        bits=4,
        in_features=256,
        out_features=64,
        groups=4,
        checkpoint_format="gptq",
        sym=True,
        group_size=64,
    )
    assert t["sym"] and not t["desc_act"] and t["group_size"] == 64
    assert torch.equal(t["qzeros_v2"], _words(0x88888888, 4, 8))
    assert torch.equal(t["qzeros_v1"], _words(0x77777777, 4, 8))
    assert torch.equal(t["g_idx"], torch.arange(256, dtype=torch.int32) // 64)


def test_asymmetric_zeros_and_act_order_are_seen() -> None:
    torch.manual_seed(0)
    zeros = torch.randint(0, 16, (2, 64), dtype=torch.int32)
    g_idx = (torch.arange(128, dtype=torch.int32) // 64)[torch.randperm(128)]
    t = gptq_kernel_tensors(
        pack_cols(zeros, 4),
        g_idx,
        bits=4,
        in_features=128,
        out_features=64,
        groups=2,
        checkpoint_format="gptq_v2",
        sym=None,
        group_size=None,
    )
    assert not t["sym"] and t["desc_act"] and t["group_size"] == 64
    assert torch.equal(t["qzeros_v2"], pack_cols(zeros, 4))
    assert torch.equal(t["qzeros_v1"], pack_cols((zeros - 1) & 15, 4))


def test_one_group_is_group_size_minus_one() -> None:
    t = gptq_kernel_tensors(
        _words(0x88888888, 1, 8),
        torch.zeros(96, dtype=torch.int32),
        bits=4,
        in_features=96,
        out_features=64,
        groups=1,
        checkpoint_format="gptq_v2",
        sym=True,
        group_size=128,
    )
    assert t["group_size"] == -1 and not t["desc_act"]


# ---------------------------------------------------------------- kernel choice and fallback


class FakeKernel(nn.Module):
    """Stands in for a GPTQModel AWQ kernel class: y = x @ W.T with W from ``scales`` ([K, N])."""

    calls: ClassVar[list[str]] = []
    validate_ok = True
    post_init_error: type[Exception] | None = None

    def __init__(self, *, in_features: int, out_features: int, **kwargs: Any) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.zeros(in_features, out_features // 8, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(1, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(in_features, out_features, dtype=torch.float16))
        self.optimized = False

    @classmethod
    def validate(cls, **kwargs: Any) -> tuple[bool, Exception | None]:
        return (True, None) if cls.validate_ok else (False, NotImplementedError(f"{cls.__name__} says no"))

    def post_init(self) -> None:
        type(self).calls.append(type(self).__name__)
        if self.post_init_error is not None:
            raise self.post_init_error("runtime missing")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float16
        return x @ self.scales


class NoValidate(FakeKernel):
    validate_ok = False


class BrokenRuntime(FakeKernel):
    post_init_error = RuntimeError


class Works(FakeKernel):
    pass


def _plan(*kernels: type[FakeKernel], requested: str = "auto") -> KernelPlan:
    plan = KernelPlan("awq", requested, torch.device("cpu"), torch.float16)
    plan._candidates = [(k.__name__.lower(), k, None) for k in kernels]
    return plan


def _build(plan: KernelPlan, name: str, weight_kn: torch.Tensor, bias: torch.Tensor | None = None) -> GPTQModelLinear:
    k, n = weight_kn.shape
    tensors = {
        "qweight": torch.zeros(k, n // 8, dtype=torch.int32),
        "qzeros": torch.zeros(1, n // 8, dtype=torch.int32),
        "scales": weight_kn,
    }
    return plan.build(
        name, tensors, bias, bits=4, group_size=-1, sym=False, desc_act=False, in_features=k, out_features=n
    )


def test_auto_falls_back_per_layer_and_records_why() -> None:
    FakeKernel.calls.clear()
    plan = _plan(NoValidate, BrokenRuntime, Works)
    w = torch.randn(32, 16).to(torch.float16)
    first = _build(plan, "a", w)
    second = _build(plan, "b", w)
    assert first.kernel_name == second.kernel_name == "Works"
    # a runtime failure in post_init is not retried for the next layer; a validation "no" is per layer
    assert FakeKernel.calls == ["BrokenRuntime", "Works", "Works"]
    summary = plan.summary()
    assert summary["kernels"] == {"Works": 2}
    assert "brokenruntime" in summary["unavailable"]
    assert any("says no" in why for why in summary["fallbacks"].values())


def test_named_kernel_that_cannot_run_is_an_error() -> None:
    plan = _plan(NoValidate, requested="novalidate")
    with pytest.raises(anyquant.UnsupportedBackendError, match="no GPTQModel kernel runs this layer"):
        _build(plan, "a", torch.zeros(32, 16, dtype=torch.float16))


def test_wrapper_casts_adds_bias_and_dequantizes_exactly() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 16).to(torch.float16)  # [in, out]
    bias = torch.randn(16)
    layer = _build(_plan(Works), "a", w, bias)
    assert torch.equal(layer.dequantize(), w.t())
    x = torch.randn(3, 32)
    y = layer(x)
    assert y.dtype == torch.float32
    want = (x.to(torch.float16) @ w).float() + bias.to(torch.float16).float()
    assert torch.allclose(y, want, atol=1e-2)


def test_compile_stays_off() -> None:
    layer = _build(_plan(Works), "a", torch.zeros(32, 16, dtype=torch.float16))
    assert layer.kernel.optimized is True


# ---------------------------------------------------------------- GPTQModel's torch kernel, on CPU


@pytest.mark.peer
@pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed")
def test_gptqmodel_torch_kernels_match_the_reference() -> None:
    """All 16 GPTQModel checkpoints (2/3/4/8-bit, sym/asym, act-order, v1/v2, four group sizes)."""
    from tests.peers.catalog import GPTQ_QUANT_VARIANTS, gptqmodel_gptq_quantized_dir

    root = gptqmodel_gptq_quantized_dir()
    rows = run_worker(root, [v["name"] for v in GPTQ_QUANT_VARIANTS])
    assert set(rows) == {v["name"] for v in GPTQ_QUANT_VARIANTS}
    for name, r in rows.items():
        assert r["backend"] == "gptqmodel" and r["dtype32"] == "float32", name
        assert r["kernels"] == {"TorchLinear": 14}, (name, r["kernels"])
        assert r["weights_exact"], name
        # weights bitwise; logits within fp16 rounding (bitwise on some CPUs only: see the worker)
        assert r["fp16_rel"] < FP16_TOL and r["judge_rel"] < FP16_TOL, (name, r["fp16_rel"], r["judge_rel"])
        assert r["greedy_equal"], name
        assert r["fp32_rel"] < 1e-2, (name, r["fp32_rel"])
        assert r["info"]["kernel_dtype"] == "float16" and r["info"]["requested_kernel"] == "auto"
    assert rows[GPTQ_QUANT_VARIANTS[0]["name"]]["export_equal"]  # export_dense: backend == reference


# ---------------------------------------------------------------- backend choice, as on a CUDA machine


@pytest.fixture
def gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend GPTQModel and a CUDA GPU are there (nothing is loaded in these tests)."""
    from anyquant.protocols import BackendInfo
    from anyquant_runtime.int4 import gptqmodel_kernels
    from anyquant_runtime.int4 import loader as int4_loader

    info = BackendInfo("gptqmodel", True, devices=("cuda",))  # as the real one: CUDA only
    monkeypatch.setattr(int4_loader, "gptqmodel_backend", lambda: info)  # GPTQ's and AWQ's (their base's)
    monkeypatch.setattr(gptqmodel_kernels, "gptqmodel_backend_info", lambda: info)


def test_auto_picks_gptqmodel_on_cuda_only(gpu_visible: None) -> None:
    from anyquant_awq.loader import AWQLoader

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    gptq, awq = GPTQLoader(), AWQLoader()
    assert gptq.choose_backend("auto", cuda) == "gptqmodel"
    assert gptq.choose_backend("auto", cpu) != "gptqmodel"
    gemm, gemv = Int4State(layout="gemm"), Int4State(layout="gemv")  # the facts of an AWQ load
    assert awq.choose_backend("auto", cuda, gemm) == "gptqmodel"
    assert awq.choose_backend("auto", cpu, gemm) in ("cpu-fast", "dequantized")
    assert awq.choose_backend("auto", cuda, gemv) == "dequantized"


def test_explicit_gptqmodel_on_cuda_and_cpu(gpu_visible: None) -> None:
    from anyquant_awq.loader import AWQLoader

    gptq, awq = GPTQLoader(), AWQLoader()
    assert gptq.choose_backend("gptqmodel", torch.device("cuda")) == "gptqmodel"
    with pytest.raises(anyquant.UnsupportedBackendError, match="runs on CUDA, not on cpu"):
        gptq.choose_backend("gptqmodel", torch.device("cpu"))
    with pytest.raises(anyquant.UnsupportedBackendError, match="GEMM layout"):
        awq.choose_backend("gptqmodel", torch.device("cuda"), Int4State(layout="gemv"))
