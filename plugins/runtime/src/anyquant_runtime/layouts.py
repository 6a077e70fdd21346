"""How a format's quantized linear describes its packed weight to the CPU engine: a small typed vocabulary.

A format plugin's linear (a :class:`~anyquant_runtime.qlinear.QuantLinearBase`) supplies the exact reference decode
(``dequantize()``) and, with :meth:`~anyquant_runtime.qlinear.QuantLinearBase.packed_layouts`, the layouts its weight
can be run from, in the format's order of preference: each a frozen dataclass below that states exactly which weight
it is, with the metadata the engine checks (shapes, group, dtypes) and the tensors. The engine (``cpu-fast``,
:meth:`anyquant_cpu.engine.FastCPUPlan.convert`) checks each offered layout against what runs here (the
compiled kernels built and vectorized, the shapes they take, float16-exact block scales ...) and builds its module
from the first that runs; a format writes no backend code.

A tensor field holds the tensor, or a zero-argument callable that forms it (unpacking the codes is work: it is done
only for the layout that runs). Weights are ``w[o, i]`` for output ``o`` and input ``i``; ``bias`` is the layer's
(``None``: none). Importing this module does not import torch.

A loader describes its checkpoint's layers in the same vocabulary from the headers alone, before any tensor is read:
the metadata (shapes, group, bits, dtypes) set, the tensor fields ``None`` (``Decoded``'s ``source`` too), and
:func:`anyquant_cpu.engine.layouts_run` counts the layers the engine would take here (what ``auto`` decides
from). Such a description is never built: forming one of its tensors raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

if TYPE_CHECKING:
    import torch

    #: a tensor, or a zero-argument callable that forms it
    TensorOr: TypeAlias = torch.Tensor | Callable[[], torch.Tensor]

__all__ = [
    "Affine4Blocks",
    "Decoded",
    "E4M3Groups",
    "GGUFBlocks",
    "Int4Groups",
    "Int8Blocks",
    "Layout",
    "Table4",
    "tensor",
]


def tensor(value: TensorOr | None) -> torch.Tensor:
    """A layout's tensor field as a tensor (the callable called); ``ValueError`` for a field a metadata-only
    description left ``None``."""
    if value is None:
        raise ValueError("a layout described from metadata alone has no tensors to build from")
    return value() if callable(value) else value


@dataclass(frozen=True, eq=False)
class Int4Groups:
    """4-bit integer codes with a scale and a zero point per group of inputs (GPTQ, AWQ, compressed-tensors' int4):
    ``w[o, i] = round_to(scales.dtype, (codes[i, o] - zeros[g(i), o]) * scales[g(i), o])`` (float32 arithmetic, one
    rounding to the scales' dtype).

    ``codes``: ``[in, out]``, 0..15, any integer dtype; ``zeros``: ``[G, out]`` integers (0..255); ``scales``:
    ``[G, out]``. ``g(i)`` is ``g_idx[i]`` where ``g_idx`` is given (``[in]``; the engine sorts the columns by group
    and needs groups of equal size), else ``i // group_size``; ``group_size=None`` with no ``g_idx``: ``in / G``.
    ``bits``: the codes' width (the engine refuses anything but 4; a format with other widths may still say so).
    A metadata-only description gives ``group_size`` (the size a ``g_idx``'s groups would have).
    """

    #: its name among :data:`anyquant.protocols.LAYOUT_KINDS` (what a registered backend says it runs)
    kind: ClassVar[str] = "int4-groups"

    in_features: int
    out_features: int
    codes: TensorOr | None
    zeros: TensorOr | None
    scales: TensorOr | None
    bits: int = 4
    group_size: int | None = None
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Affine4Blocks:
    """4-bit codes with a scale and an offset per group of inputs, computed in the scales' dtype (mlx's ``affine``):
    ``w[o, i] = scales[o, i // group] * codes[o, i] + biases[o, i // group]``, rounded to the scales' dtype after the
    product and after the sum (no fused multiply-add).

    ``codes``: ``[out, in]``, 0..15; ``scales`` and ``biases``: ``[out, in / group]``, one dtype."""

    #: its name among :data:`anyquant.protocols.LAYOUT_KINDS` (what a registered backend says it runs)
    kind: ClassVar[str] = "affine4-blocks"

    in_features: int
    out_features: int
    group: int
    codes: TensorOr | None
    scales: TensorOr | None
    biases: TensorOr | None
    bias: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Int8Blocks:
    """Symmetric 8-bit integer codes with a scale per group of inputs (compressed-tensors' int8):
    ``w[o, i] = round_to(float32(codes[o, i]) * float32(scales[o, i // group]))``.

    ``codes``: ``[out, in]``, int8 values; ``scales``: ``[out, in / group]`` (a per-channel scale: ``group = in``).
    ``q8_0``: where the format already holds the weight as GGML Q8_0 blocks (group 32, float16 scales: uint8
    ``[out, in / 32, 34]``, each block's scale then its 32 codes), those blocks, which an engine that runs Q8_0 takes
    as they are instead of packing the codes and scales again. ``rounded``: the codes are a second, lossy rounding of
    a weight the format holds otherwise (EXL3's decoded trellis as Q8_0), which the format accepts and a backend's
    option may refuse (``cpu-fast``'s ``cpu_fast_weights``)."""

    #: its name among :data:`anyquant.protocols.LAYOUT_KINDS` (what a registered backend says it runs)
    kind: ClassVar[str] = "int8-blocks"

    in_features: int
    out_features: int
    group: int
    codes: TensorOr | None
    scales: TensorOr | None
    round_to: torch.dtype
    bias: torch.Tensor | None = None
    q8_0: TensorOr | None = None
    rounded: bool = False


@dataclass(frozen=True, eq=False)
class Table4:
    """4-bit codes into a 16-entry float table with a float scale per group of inputs (bitsandbytes' nf4/fp4, FP4
    E2M1 with E8M0 or E4M3 scales): ``w[o, i] = round_to(float32(table[codes[o, i]]) * float32(scales[o, i // group]))``.

    ``codes``: ``[out, in]``, 0..15; ``scales``: ``[out, in / group]``; ``table``: the 16 values."""

    #: its name among :data:`anyquant.protocols.LAYOUT_KINDS` (what a registered backend says it runs)
    kind: ClassVar[str] = "table4"

    in_features: int
    out_features: int
    group: int
    codes: TensorOr | None
    scales: TensorOr | None
    table: TensorOr | None
    round_to: torch.dtype
    bias: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class E4M3Groups:
    """FP8 E4M3 weights with a float scale per block of ``rows`` outputs by ``group`` inputs (FP8 checkpoints,
    compressed-tensors' fp8): ``w[o, i] = round_to(float32(weight[o, i]) * float32(scales[o // rows, i // group]))``.

    ``weight``: ``[out, in]`` ``float8_e4m3fn`` (or its bytes as uint8); ``scales``: ``[ceil(out / rows), in / group]``
    (per tensor: ``rows = out``, ``group = in``, ``[1, 1]``; per output channel: ``rows = 1``, ``group = in``)."""

    #: its name among :data:`anyquant.protocols.LAYOUT_KINDS` (what a registered backend says it runs)
    kind: ClassVar[str] = "e4m3-groups"

    in_features: int
    out_features: int
    group: int
    weight: TensorOr | None
    scales: TensorOr | None
    round_to: torch.dtype
    rows: int = 1
    bias: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class GGUFBlocks:
    """The weight as GGML blocks, exactly as a GGUF file stores them (llama.cpp's types: Q4_0, Q8_0, the K-quants,
    IQ4_XS, MXFP4 ...): ``w`` is the type's own dequantization of the blocks.

    ``blocks``: uint8, the ``[out, in]`` weight's blocks row after row (``in`` a multiple of the type's block; a
    zero-copy view of the mapped file is fine: an engine that reads them in place keeps the view); ``type_name`` and
    ``type_id``: GGML's name and number of the type. ``qk_heads``: the rows are permuted as llama.cpp's converter
    permutes a "llama" file's Q/K weights, in that many heads (``None``: in the model's order): the engine puts them
    back in the model's order. ``as_stored``: whether the blocks may run as they are stored, on a kernel that reads
    GGML blocks (``False``: only repacked, as torch's int4 kernel takes Q4_0/Q4_1/Q4_K)."""

    #: its name among :data:`anyquant.protocols.LAYOUT_KINDS` (what a registered backend says it runs)
    kind: ClassVar[str] = "gguf-blocks"

    in_features: int
    out_features: int
    type_name: str
    type_id: int
    blocks: TensorOr | None
    qk_heads: int | None = None
    as_stored: bool = True
    bias: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Decoded:
    """A bfloat16 copy of ``source.dequantize()`` is within the format's tolerance (its weights have no packed layout
    the engine runs, and the format accepts bfloat16 rounding of them). ``source``: the format's module
    (``dequantize()``, ``in_features``, ``out_features``, ``bias``), kept for its exact weight (``None`` in a
    metadata-only description). ``exact_prompts``: prompts of more rows than the engine's decode rows run
    ``source``'s own (exact) forward, the bfloat16 copy serving decode only (``False``: every forward in bfloat16)."""

    #: its name among :data:`anyquant.protocols.LAYOUT_KINDS` (what a registered backend says it runs)
    kind: ClassVar[str] = "decoded"

    source: Any
    exact_prompts: bool = False


#: one packed layout of the vocabulary
Layout: TypeAlias = Int4Groups | Affine4Blocks | Int8Blocks | Table4 | E4M3Groups | GGUFBlocks | Decoded
