"""The ``gptqmodel`` backend: GPTQModel's CUDA kernels run anyquant's GPTQ and AWQ layers.

Per quantized linear, the loader builds one GPTQModel kernel module (``MarlinLinear``,
``TritonV2Linear``, ``TorchLinear``; ``AwqMarlinLinear``, ``AwqGEMMTritonLinear``,
``AwqTorchLinear``) from the checkpoint's tensors, moves it to the device, calls its
``post_init()`` (where Marlin repacks) and wraps it in :class:`GPTQModelLinear`, the module that
replaces the ``nn.Linear``. Everything else (skeleton, embeddings, norms, tying, generation) stays
anyquant's.

What this module decides, so the kernels see exactly what anyquant's reference decodes:

- zero points: GPTQ ``qzeros`` are decoded by anyquant's own rules (v1/v2 label checked against
  the tensors, GPTQModel's packed-word ``+1``) and handed over re-packed as v2 (true zeros), which
  is what GPTQModel's ``REQUIRES_FORMAT_V2`` kernels compute with; v1 ones get ``z - 1`` (the GPTQ
  plugin's ``anyquant_gptq.dequant.gptq_kernel_tensors``); AWQ GEMM tensors go over as stored;
- ``sym`` and ``desc_act`` per layer come from the tensors (all zeros ``2**(b-1)``; ``g_idx`` not
  ``k // group_size``), not from the config, so Marlin never runs a layer it would decode wrong;
- the bias stays in the wrapper (added after the kernel), so :meth:`GPTQModelLinear.dequantize`
  (the kernel applied to an identity) is the exact weight for every kernel;
- torch.compile stays off (``optimized=True`` before ``post_init``) unless ``gptqmodel_compile=True``.

Kernel choice (load option ``gptqmodel_kernel``): ``"auto"`` tries Marlin, then Triton, then torch,
per layer, and falls back with the reason recorded (``LoadedModel.info["gptqmodel"]``); a named
kernel (``"marlin"``, ``"triton"``, ``"torch"``; AWQ also ``"gemm"``) is used for every layer or the
load fails. Marlin and AWQ GEMM are CUDA extensions GPTQModel JIT-compiles on first use (minutes;
cached under ``~/.cache/gptqmodel``); Triton compiles in seconds.

Test-only: ``_gptqmodel_cpu=True`` lets ``backend="gptqmodel"`` run on the CPU with GPTQModel's
torch kernel, so the whole path above is exercised without a GPU.

Importing GPTQModel changes the host process: it sets environment variables (``HF_HOME`` and the hub caches
moved under /tmp, ``PYTORCH_ALLOC_CONF``, ``CUDA_DEVICE_ORDER``, ...), configures the root logger (a stderr
handler, level INFO), prints a banner on stdout and patches transformers. It happens when this backend is
used, not before, and :func:`import_gptqmodel` undoes what can be undone: the environment and the root
logger are put back as they were and the banner goes to stderr. transformers' patches stay.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from anyquant.errors import UnsupportedBackendError
from anyquant.protocols import BackendInfo

from . import COMPILE_OPTION, CPU_TEST_OPTION, KERNEL_OPTION

__all__ = [
    "AUTO_KERNELS",
    "BACKEND_NAME",
    "COMPILE_OPTION",
    "CPU_TEST_OPTION",
    "GPTQModelLinear",
    "KERNEL_OPTION",
    "KERNELS",
    "KernelPlan",
    "check_gptqmodel_request",
    "gptqmodel_backend_info",
]

log = logging.getLogger(__name__)

BACKEND_NAME = "gptqmodel"

#: kernel name -> GPTQModel ``BACKEND`` member, per method
KERNELS: dict[str, dict[str, str]] = {
    "gptq": {"marlin": "GPTQ_MARLIN", "triton": "GPTQ_TRITON", "torch": "GPTQ_TORCH"},
    "awq": {"marlin": "AWQ_MARLIN", "triton": "AWQ_GEMM_TRITON", "gemm": "AWQ_GEMM", "torch": "AWQ_TORCH"},
}
#: ``gptqmodel_kernel="auto"``: tried in this order for every layer
AUTO_KERNELS: dict[str, tuple[str, ...]] = {"gptq": ("marlin", "triton", "torch"), "awq": ("marlin", "triton", "torch")}
#: a failure of these in ``post_init`` means the kernel cannot run here at all (a JIT build failed,
#: a runtime is missing): it is not tried again for the other layers
_RUNTIME_ERRORS = (ImportError, RuntimeError, OSError)

DESCRIPTION = (
    "GPTQModel's CUDA kernels (Marlin, Triton or torch, chosen per layer; option gptqmodel_kernel); packed memory"
)


_IMPORT_LOCK = threading.Lock()


def import_gptqmodel() -> None:
    """Import GPTQModel (once per process) and put back what its import changed in the host: environment
    variables it set or changed, handlers it added to the root logger and the root's level. Its banner is
    written to stderr, never to the host's stdout (a CLI's JSON output stays parseable)."""
    if "gptqmodel" in sys.modules:
        return
    with _IMPORT_LOCK:
        if "gptqmodel" in sys.modules:
            return
        env = dict(os.environ)
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        try:
            with contextlib.redirect_stdout(sys.stderr):
                import gptqmodel  # noqa: F401
        finally:
            undone = sorted(k for k in set(os.environ) | set(env) if os.environ.get(k) != env.get(k))
            for key in undone:
                if key in env:
                    os.environ[key] = env[key]
                else:
                    os.environ.pop(key, None)
            for handler in root.handlers[:]:
                if handler not in handlers:
                    root.removeHandler(handler)
            root.setLevel(level)
            if undone:
                log.debug("environment variables set by importing gptqmodel, put back: %s", ", ".join(undone))


def gptqmodel_backend_info() -> BackendInfo:
    """Whether backend ``gptqmodel`` can run here. Imports torch, never gptqmodel."""
    if importlib.util.find_spec("gptqmodel") is None:
        return BackendInfo(BACKEND_NAME, False, "gptqmodel is not installed (pip install gptqmodel)", devices=("cuda",))
    if not torch.cuda.is_available():
        return BackendInfo(
            BACKEND_NAME,
            False,
            "needs a CUDA GPU (GPTQModel's kernels run on CUDA); none is visible",
            devices=("cuda",),
        )
    return BackendInfo(BACKEND_NAME, True, description=DESCRIPTION, devices=("cuda",))


def check_gptqmodel_request(fmt: str, device: torch.device, extra: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedBackendError` unless ``backend="gptqmodel"`` can run on ``device``."""
    if device.type == "cpu" and extra.get(CPU_TEST_OPTION):
        if importlib.util.find_spec("gptqmodel") is None:
            raise UnsupportedBackendError(f"{fmt} backend 'gptqmodel' cannot run here: gptqmodel is not installed")
        return
    info = gptqmodel_backend_info()
    if not info.available:
        raise UnsupportedBackendError(f"{fmt} backend 'gptqmodel' cannot run here: {info.reason}")
    if device.type != "cuda":
        raise UnsupportedBackendError(f"{fmt} backend 'gptqmodel' runs on CUDA, not on {device}")


class GPTQModelLinear(nn.Module):
    """A linear layer computed by a GPTQModel kernel module (``self.kernel``).

    The kernel computes in ``kernel_dtype`` (fp16 or bf16): inputs of another dtype are cast in and
    the output is cast back. The bias, if any, is added here, after the kernel.
    """

    def __init__(
        self,
        kernel: nn.Module,
        bias: torch.Tensor | None,
        *,
        in_features: int,
        out_features: int,
        kernel_dtype: torch.dtype,
        kernel_name: str,
    ) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features, self.out_features = in_features, out_features
        self.kernel_dtype = kernel_dtype
        self.kernel_name = kernel_name
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out: torch.Tensor = self.kernel(x if dtype == self.kernel_dtype else x.to(self.kernel_dtype))
        if out.dtype != dtype:
            out = out.to(dtype)
        bias: torch.Tensor | None = self._buffers.get("bias")
        if bias is not None:
            out = out + (bias if bias.dtype == dtype else bias.to(dtype))
        return out

    def _device(self) -> torch.device:
        for t in self.kernel.buffers():
            return t.device
        for p in self.kernel.parameters():
            return p.device
        return torch.device("cpu")

    @torch.no_grad()
    def dequantize(self, block: int = 4096) -> torch.Tensor:
        """The weight the kernel computes with, ``[out, in]`` in ``kernel_dtype``: the kernel applied
        to identity rows (exact: one nonzero product per output)."""
        device = self._device()
        cols = []
        for start in range(0, self.in_features, block):
            rows = min(block, self.in_features - start)
            eye = torch.zeros(rows, self.in_features, dtype=self.kernel_dtype, device=device)
            eye[:, start : start + rows].fill_diagonal_(1)
            cols.append(self.kernel(eye).to(self.kernel_dtype).t())
        return torch.cat(cols, dim=1).contiguous()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel_name}, "
            f"dtype={str(self.kernel_dtype).replace('torch.', '')}, bias={self._buffers.get('bias') is not None}"
        )


@dataclass
class KernelPlan:
    """Builds the GPTQModel kernel module of every quantized layer of one load, and records which
    kernel ran each (``summary()`` goes to ``LoadedModel.info["gptqmodel"]``)."""

    method: str
    requested: str
    device: torch.device
    kernel_dtype: torch.dtype
    compile: bool = False
    counts: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)  # "layer: kernel" -> why not
    disabled: dict[str, str] = field(default_factory=dict)  # kernel -> why it cannot run here
    _candidates: list[tuple[str, Any, Any]] = field(default_factory=list)

    @classmethod
    def create(cls, method: str, device: torch.device, dtype: torch.dtype, extra: Mapping[str, Any]) -> KernelPlan:
        requested = str(extra.get(KERNEL_OPTION, "auto")).lower()
        names = KERNELS[method]
        if requested != "auto" and requested not in names:
            raise UnsupportedBackendError(
                f"{KERNEL_OPTION}={requested!r} is not one of {['auto', *names]} for {method.upper()}"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        kernel_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
        if kernel_dtype != dtype:
            log.info("gptqmodel kernels compute in float16; activations are cast from %s around each layer", dtype)
        plan = cls(method, requested, device, kernel_dtype, compile=bool(extra.get(COMPILE_OPTION, False)))
        order: tuple[str, ...] = AUTO_KERNELS[method] if requested == "auto" else (requested,)
        if device.type == "cpu":  # tests only (CPU_TEST_OPTION): the torch kernel is the one that runs there
            if requested not in ("auto", "torch"):
                raise UnsupportedBackendError(
                    f"gptqmodel kernel {requested!r} needs CUDA; on the CPU only 'torch' runs"
                )
            order = ("torch",)
        plan._resolve(order)
        return plan

    def _resolve(self, order: tuple[str, ...]) -> None:
        import_gptqmodel()
        from gptqmodel.quantization import FORMAT, METHOD
        from gptqmodel.utils.backend import BACKEND
        from gptqmodel.utils.importer import get_kernel_for_backend

        method = METHOD.GPTQ if self.method == "gptq" else METHOD.AWQ
        fmt = FORMAT.GPTQ_V2 if self.method == "gptq" else FORMAT.GEMM
        for name in order:
            backend = getattr(BACKEND, KERNELS[self.method][name])
            try:
                cls = get_kernel_for_backend(backend, method, fmt)
            except (ValueError, ImportError) as exc:
                self.disabled[name] = str(exc)
                continue
            # GPTQModel's AUTO semantics for the constructor (e.g. Marlin declines tile-misaligned
            # shapes instead of padding them) unless the user named the kernel
            self._candidates.append((name, cls, BACKEND.AUTO if self.requested == "auto" else backend))
        if not self._candidates:
            raise UnsupportedBackendError(
                f"no GPTQModel {self.method.upper()} kernel is available: "
                + "; ".join(f"{k}: {v}" for k, v in self.disabled.items())
            )

    def build(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        bias: torch.Tensor | None,
        *,
        bits: int,
        group_size: int,
        sym: bool,
        desc_act: bool,
        in_features: int,
        out_features: int,
    ) -> GPTQModelLinear:
        """The layer ``name`` on the first candidate kernel that accepts it.

        ``tensors``: ``qweight``, ``scales`` and, for GPTQ, ``g_idx`` plus ``qzeros_v2`` /
        ``qzeros_v1`` (the kernel's ``REQUIRES_FORMAT_V2`` picks one); for AWQ ``qzeros``.
        """
        reasons: list[str] = []
        for kname, cls, backend in self._candidates:
            if kname in self.disabled:
                reasons.append(f"{kname}: {self.disabled[kname]}")
                continue
            why = self._why_not(cls, bits, group_size, sym, desc_act, in_features, out_features)
            kernel = None
            if why is None:
                try:
                    made = self._construct(
                        cls, backend, name, bits, group_size, sym, desc_act, in_features, out_features
                    )
                    self._fill(made, tensors)
                    kernel = self._post_init(made)
                except (NotImplementedError, ValueError) as exc:
                    why = f"{type(exc).__name__}: {exc}"
                except _RUNTIME_ERRORS as exc:
                    why = f"{type(exc).__name__}: {exc}"
                    self.disabled[kname] = why
                    log.warning("gptqmodel kernel %s cannot run here (%s)", kname, why)
            if kernel is not None:
                self.counts[type(kernel).__name__] += 1
                return GPTQModelLinear(
                    kernel,
                    None if bias is None else bias.to(device=self.device, dtype=self.kernel_dtype),
                    in_features=in_features,
                    out_features=out_features,
                    kernel_dtype=self.kernel_dtype,
                    kernel_name=type(kernel).__name__,
                )
            self.skipped[f"{name}: {kname}"] = str(why)
            reasons.append(f"{kname}: {why}")
        raise UnsupportedBackendError(
            f"{name}: no GPTQModel kernel runs this layer ({self.method}, bits={bits}, group_size={group_size}, "
            f"sym={sym}, desc_act={desc_act}, {in_features}x{out_features}, {self.kernel_dtype}): " + "; ".join(reasons)
        )

    def _why_not(self, cls: Any, bits: int, group_size: int, sym: bool, desc_act: bool, k: int, n: int) -> str | None:
        once = getattr(cls, "cached_validate_once", None)  # runtime imports (Triton): some validate() skip it
        if once is not None:
            ok, err = once()
            if not ok:
                return str(err or "its runtime is not available")
        ok, err = cls.validate(
            bits=bits,
            group_size=group_size,
            desc_act=desc_act,
            sym=sym,
            in_features=k,
            out_features=n,
            pack_dtype=torch.int32,
            dtype=self.kernel_dtype,
            device=self.device,
        )
        return None if ok else str(err or "not supported")

    def _construct(
        self, cls: Any, backend: Any, name: str, bits: int, group_size: int, sym: bool, desc_act: bool, k: int, n: int
    ) -> Any:
        kwargs: dict[str, Any] = {}
        if self.method == "gptq":
            from gptqmodel.quantization import FORMAT

            kwargs["format"] = FORMAT.GPTQ_V2
        return cls(
            bits=bits,
            group_size=group_size,
            desc_act=desc_act,
            sym=sym,
            in_features=k,
            out_features=n,
            bias=False,  # added by GPTQModelLinear
            pack_dtype=torch.int32,
            backend=backend,
            adapter=None,
            register_buffers=True,
            dtype=self.kernel_dtype,
            name=name,
            **kwargs,
        )

    def _fill(self, kernel: Any, tensors: Mapping[str, torch.Tensor]) -> None:
        wanted = {"qweight": tensors["qweight"], "scales": tensors["scales"]}
        if self.method == "gptq":
            v2 = bool(getattr(kernel, "REQUIRES_FORMAT_V2", False))
            wanted["qzeros"] = tensors["qzeros_v2" if v2 else "qzeros_v1"]
            wanted["g_idx"] = tensors["g_idx"]
        else:
            wanted["qzeros"] = tensors["qzeros"]
        for key, value in wanted.items():
            current = getattr(kernel, key, None)
            if not isinstance(current, torch.Tensor):
                raise ValueError(f"{type(kernel).__name__} has no {key} tensor to fill")
            if tuple(current.shape) != tuple(value.shape):
                raise ValueError(
                    f"{type(kernel).__name__}.{key} is {tuple(current.shape)}, the checkpoint's is {tuple(value.shape)}"
                )
            value = value.to(dtype=current.dtype).contiguous()
            if key in kernel._parameters:
                kernel._parameters[key] = nn.Parameter(value, requires_grad=False)
            else:
                kernel._buffers[key] = value
        if self.method == "gptq" and hasattr(kernel, "qzero_format"):
            kernel.qzero_format(format=2 if getattr(kernel, "REQUIRES_FORMAT_V2", False) else 1)

    def _post_init(self, kernel: Any) -> Any:
        kernel = kernel.to(self.device)
        if not self.compile:
            kernel.optimized = True  # BaseQuantLinear.optimize() returns early: no torch.compile
        kernel.post_init()
        kernel.eval()
        kernel.requires_grad_(False)
        return kernel

    def summary(self) -> dict[str, Any]:
        """For ``LoadedModel.info["gptqmodel"]``; logs the fallbacks once."""
        if self.skipped and self.requested == "auto":
            log.info("gptqmodel: kernels %s; %d layer/kernel fallbacks", dict(self.counts), len(self.skipped))
        return {
            "requested_kernel": self.requested,
            "kernels": dict(self.counts),
            "kernel_dtype": str(self.kernel_dtype).replace("torch.", ""),
            "device": str(self.device),
            "fallbacks": dict(self.skipped),
            "unavailable": dict(self.disabled),
        }
