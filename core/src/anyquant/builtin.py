"""Core's built-in plugin: the ``dense`` format (detected here; its loader is anyquant-runtime's, named by its
FormatSpec and imported only when a dense checkpoint loads), and formats anyquant recognises but loads nowhere.

Recognising HQQ checkpoints here means they get a clear
"recognised, not loadable" error instead of a dense load (transformers' random-weights failure).
"""

from __future__ import annotations

from collections.abc import Callable

from .hookspecs import hookimpl
from .probe import Probe
from .protocols import Claim, FormatSpec

#: tensor name suffixes that mark some quantization scheme (never seen in a dense checkpoint).
QUANT_SUFFIXES = frozenset(
    {
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "trellis",
        "suh",
        "svh",
        "su",
        "sv",
        "mcg",
        "mul1",
        "q_weight",
        "q_scale",
        "q_scale_max",
        "q_groups",
        "q_invperm",
        "q_perm",
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_global_scale",
        "weight_scale_inv",
        "absmax",
        "quant_map",
        "SCB",
        "weight_format",
        "W_q",
    }
)

UNLOADABLE = {
    "hqq": ("HQQ checkpoints", "anyquant has no HQQ loader; load it with transformers + hqq"),
}


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name="dense",
            loader="anyquant_runtime.dense:DenseLoader",  # imported when a dense checkpoint loads (anyquant-runtime)
            requires=("torch>=2.4", "transformers>=4.56"),
            description="unquantized fp32/fp16/bf16 safetensors",
            install_hint="the dense format's loader is anyquant-runtime's: pip install anyquant-runtime",
        )
    )
    for name, (description, hint) in UNLOADABLE.items():
        register(FormatSpec(name=name, loader=None, description=description, install_hint=hint))


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    return _detect_unloadable(probe) or _detect_dense(probe)


def _detect_dense(probe: Probe) -> Claim | None:
    if probe.quant_method is not None or probe.gguf:
        return None
    if not probe.safetensors:
        if probe.pickle_files and probe.config is not None:
            return Claim(
                "dense",
                variant="pickle",
                evidence=(f"only pickle weight files: {list(probe.pickle_files)[:3]}", "no quantization_config"),
            )
        return None
    if not looks_dense(probe):
        return None
    dtypes = sorted({t.dtype for t in probe.tensors.values() if t.name.endswith(".weight")})
    return Claim(
        "dense",
        variant=dtypes[0].lower() if len(dtypes) == 1 else "mixed",
        evidence=(
            "no quantization_config",
            f"{len(probe.tensors)} tensors, every .weight in {dtypes}, no integer tensors, no quantization suffixes",
        ),
        details={"dtypes": dtypes},
    )


#: integer tensors a dense checkpoint may hold: buffers, never weights
DENSE_INT_BUFFERS = frozenset({"position_ids", "token_type_ids", "num_batches_tracked"})


def looks_dense(probe: Probe) -> bool:
    """True when the safetensors hold no quantization markers and every tensor is float (or boolean, or one
    of the integer buffers :data:`DENSE_INT_BUFFERS`). Integer tensors of any other name are some
    quantization's codes, known or not (a third party's format whose plugin is not installed): never dense."""
    if not probe.tensors or set(probe.suffixes()) & QUANT_SUFFIXES:
        return False
    return not integer_tensors(probe)


def integer_tensors(probe: Probe) -> list[str]:
    """Names of the tensors that are neither float, boolean nor an integer buffer of dense checkpoints."""
    return [
        t.name
        for t in probe.tensors.values()
        if not (t.is_float or t.dtype == "BOOL" or t.name.rsplit(".", 1)[-1] in DENSE_INT_BUFFERS)
    ]


def _detect_unloadable(probe: Probe) -> Claim | None:
    qm = probe.quant_method
    suffixes = probe.suffixes()
    if qm in ("compressed-tensors", "compressed_tensors") or "weight_packed" in suffixes:
        return None  # compressed-tensors: its plugin claims it (installed or not: never dense, see looks_dense)
    if qm == "hqq" or "W_q" in suffixes:
        return Claim("hqq", evidence=(f"quant_method={qm!r}", f"{suffixes.get('W_q', 0)} *.W_q tensors"))
    return None
