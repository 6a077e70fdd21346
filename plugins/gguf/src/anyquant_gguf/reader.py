"""GGUF -> torch loading: config, tensor names, (de)quantized tensors, tokenizer.

Everything here reads a ``.gguf`` file through :class:`GGUFFile` (memory-mapped, its header parsed
by :func:`anyquant.headers.read_gguf_header`; the ``gguf`` package is not imported) and returns what
the transformers class of its architecture expects (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` (text only) or
``Phi3ForCausalLM``): a ``config.json``-style dict, HF parameter names, and tensors in HF
orientation (``[out_features, in_features]``), undoing what llama.cpp's converter
(``convert_hf_to_gguf.py``) changed:

llama.cpp's converter permutes the rows of the Q and K projections of "llama"
architecture models (it uses interleaved-pair RoPE where HF uses rotate-half). Within
each head of ``head_dim`` rows, GGUF row ``2*i + p`` holds HF row ``p*head_dim/2 + i``
(``p`` in {0, 1}, ``i`` < ``head_dim/2``); Q uses ``num_attention_heads`` heads and K
``num_key_value_heads``. :func:`unpermute_qk_rows` undoes it along dim 0, which works
on dequantized weights, biases and raw quantized rows alike (GGUF blocks never cross a
row). The other architectures here (qwen2, qwen3, qwen3moe, qwen2moe, gemma2, gemma3, phi3) are not permuted: their
llama.cpp graphs use NeoX-style (rotate-half) RoPE, as HF does.

The converter stores Gemma 2/3 RMSNorm weights as ``w + 1`` (HF's ``GemmaRMSNorm`` computes
``x * (1 + w)``, llama.cpp ``x * w``): every ``*norm.weight`` of a gemma2/gemma3 file is loaded
minus 1. Phi-3's fused ``attn_qkv`` (Q, K, V rows) and ``ffn_up`` (gate rows, then up rows) are
stored as HF's ``qkv_proj`` / ``gate_up_proj`` are; its ``rope_factors_long/short`` become
``rope_parameters`` (``longrope``). Where llama.cpp's graph reads a value from a hard-coded default
or from the layer count (Gemma's sliding-window layer pattern, its query scale, Phi-3's disabled
sliding window), the config says what llama.cpp computes.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch
from numpy.typing import NDArray

from anyquant.plugin import CheckpointError, GGUFHeader, GGUFSkippedArray, GGUFTensorInfo, read_gguf_header

from .dequant import PACKED_TYPES, UnsupportedGGUFType, check_supported, dequantize_blocks_torch
from .ggml import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from .metadata import MAX_SIZE, GGUFMetadataError, metadata_float, metadata_int

__all__ = [
    "DEQUANTIZABLE_TYPES",
    "GGUFField",
    "GGUFFile",
    "GGUFMetadataError",
    "GGUFRawTensor",
    "GGUFTensor",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedGGUFArchitecture",
    "UnsupportedGGUFType",
    "field_value",
    "get_tensor",
    "gguf_architecture",
    "hf_config_from_gguf",
    "hf_expert_names",
    "hf_state_dict",
    "hf_tensor_names",
    "load_raw",
    "load_tensor",
    "norm_offset",
    "open_gguf",
    "qk_permutation_heads",
    "tensor_type_name",
    "tokenizer_from_gguf",
    "unpermute_qk_rows",
]


log = logging.getLogger(__name__)


class UnsupportedGGUFArchitecture(CheckpointError, ValueError):
    """The GGUF file's ``general.architecture`` (or one of its features) is not supported."""


Q = GGMLQuantizationType

#: Storage types :func:`load_tensor` dequantizes (:mod:`.dequant`, equal to ``gguf.quants.dequantize``): F32, F16,
#: BF16 and every block type of :data:`~anyquant_gguf.dequant.PACKED_TYPES` (Q4_0 ... Q6_K, IQ1_S ... IQ4_XS, TQ1_0,
#: TQ2_0, MXFP4).
DEQUANTIZABLE_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F32, Q.F16, Q.BF16}) | PACKED_TYPES

_HF_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_HF_CLASSES)
#: a "llama" file with experts (``llama.expert_count``) is Mixtral
_MIXTRAL = ("mixtral", "MixtralForCausalLM")

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS: dict[str, str] = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2/3: four norms per layer; llama.cpp's "ffn_norm" is HF's pre_feedforward_layernorm there
_GEMMA_BLOCK_NAMES: dict[str, str] = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: fused projections, stored in HF's row order (Q|K|V rows; gate rows then up rows)
_PHI3_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "llama": _BLOCK_NAMES,
    "qwen2": _BLOCK_NAMES,
    "qwen3": {**_BLOCK_NAMES, **_QK_NORMS},
    "gemma2": _GEMMA_BLOCK_NAMES,
    "gemma3": {**_GEMMA_BLOCK_NAMES, **_QK_NORMS},
    "phi3": _PHI3_BLOCK_NAMES,
    "qwen3moe": {**_BLOCK_NAMES, **_QK_NORMS, "ffn_gate_inp": "mlp.gate"},
    # Qwen2-MoE: a shared expert beside the routed ones, gated by a sigmoid of one row (``ffn_gate_inp_shexp``)
    "qwen2moe": {
        **_BLOCK_NAMES,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    },
}
#: GGUF vectors that are one-row matrices in transformers (Qwen2-MoE's shared-expert gate, ``Linear(hidden, 1)``)
_ROW_VECTORS: frozenset[str] = frozenset({"ffn_gate_inp_shexp"})
#: MoE files: the router, and the experts' 3-D tensors ``[experts, out, in]`` (HF order), served one linear per
#: expert as ``model.layers.N.mlp.experts.E.<leaf>`` (transformers' fused experts module is replaced by those)
_ROUTER: dict[str, str] = {"ffn_gate_inp": "mlp.gate"}
_EXPERT_LEAVES: dict[str, str] = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")
#: architectures whose Q/K rows llama.cpp's converter permutes (``LlamaModel.permute``)
_PERMUTED_QK: frozenset[str] = frozenset({"llama"})
#: architectures whose RMSNorm weights the converter stored as ``w + 1`` (every ``*norm.weight``)
_NORM_PLUS_ONE: frozenset[str] = frozenset({"gemma2", "gemma3"})
# Tensors with no HF parameter: llama3-style RoPE factors (and Phi-3's LongRoPE factors), folded
# into the config instead.
_IGNORED_TENSORS: frozenset[str] = frozenset({"rope_freqs.weight"})
_LONGROPE_TENSORS: frozenset[str] = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
_QK_RE = re.compile(r"^blk\.\d+\.attn_([qk])\.(weight|bias)$")

# --------------------------------------------------------------------------- reading

#: numpy item types of GGUF's scalar value types
_NP_SCALARS: dict[int, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
#: the element types a tensor's ``data`` has (``gguf.GGUFReader``'s choice); every other type is its bytes
_NP_TENSOR: dict[int, np.dtype[Any]] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


class GGUFField:
    """One metadata key of a :class:`GGUFFile`: ``contents()`` is its Python value (str, int, float, bool or a
    list of them), ``count`` its number of items (1 for a scalar)."""

    __slots__ = ("_file", "_skipped", "_value", "count", "name")

    def __init__(self, name: str, value: Any, count: int, skipped: GGUFSkippedArray | None, file: GGUFFile):
        self.name, self._value, self.count, self._skipped, self._file = name, value, count, skipped, file

    def contents(self) -> Any:
        """The value; a long array (a vocabulary, merges, scores) is decoded from the map on each call."""
        if self._skipped is None:
            return self._value
        item_type, start, count, starts = self._skipped
        plain = self._file._plain
        dtype = _NP_SCALARS.get(item_type)
        if dtype is not None:
            items: list[Any] = plain[start : start + count * dtype.itemsize].view(dtype).tolist()
            return items
        assert starts is not None  # the header parser walked the strings (checking every length)
        return _decode_strings(plain, np.frombuffer(starts, dtype=np.int64))


def _decode_strings(plain: NDArray[Any], starts: NDArray[np.int64]) -> list[str]:
    """The GGUF strings whose lengths are at ``starts[:-1]`` (the last string ends at ``starts[-1]``), UTF-8.

    All at once where it can: the strings' bytes copied out in one piece with a NUL in place of each length
    after the first, decoded once and split at the NULs (~5x faster than one ``str`` per string for a
    vocabulary); a string that holds a NUL itself sends the array through the loop, one string at a time.
    """
    count = len(starts) - 1
    begin, end = int(starts[0]), int(starts[-1])
    rel = starts[:-1] - begin
    keep = np.ones(end - begin, dtype=bool)
    keep[(rel[:, None] + np.arange(1, 8)).ravel()] = False  # each length's last 7 bytes
    keep[0] = False  # and all of the first one's
    body = plain[begin:end][keep]
    body[rel[1:] - 8 - 7 * np.arange(count - 1)] = 0  # the first byte of each later length: a NUL
    text: str = body.tobytes().decode("utf-8")
    if text.count("\0") == count - 1:
        return text.split("\0")
    buf = memoryview(plain.data)
    return [str(buf[a + 8 : b], "utf-8") for a, b in itertools.pairwise(starts.tolist())]


class GGUFTensor:
    """One tensor of a :class:`GGUFFile`, as ``gguf.GGUFReader`` describes it: ``shape`` in GGUF order
    (``ne[0]``, the fastest, first), ``data`` a numpy view of its bytes in the map (float32/float16/float64 and
    integer types as such, shaped in reverse GGUF order; every block type as ``uint8`` ``[..., bytes_per_row]``)."""

    __slots__ = ("_data", "_file", "data_offset", "n_bytes", "n_elements", "name", "shape", "tensor_type")

    def __init__(self, info: GGUFTensorInfo, data_offset: int, file: GGUFFile) -> None:
        try:
            self.tensor_type = GGMLQuantizationType(info.type_id)
        except ValueError:
            raise UnsupportedGGUFType(
                f"tensor {info.name!r} has GGML type id {info.type_id}, which anyquant does not know"
            ) from None
        block, type_size = GGML_QUANT_SIZES[self.tensor_type]
        self.name, self.shape, self._file = info.name, info.shape, file
        self.n_elements = math.prod(info.shape)
        self.n_bytes = self.n_elements // block * type_size
        self.data_offset = data_offset + info.offset
        self._data: NDArray[Any] | None = None

    @property
    def data(self) -> NDArray[Any]:
        if self._data is None:
            dims = tuple(reversed(self.shape))
            raw = self._file._plain[self.data_offset : self.data_offset + self.n_bytes]
            dtype = _NP_TENSOR.get(self.tensor_type)
            if dtype is None:
                block, type_size = GGML_QUANT_SIZES[self.tensor_type]
                self._data = raw.reshape(*dims[:-1], dims[-1] // block * type_size)
            else:
                self._data = raw.view(dtype).reshape(dims)
        return self._data


class GGUFFile:
    """A GGUF file, memory-mapped copy-on-write: its metadata (``fields``, by key) and tensors (``tensors``, in
    file order), with what ``gguf.GGUFReader`` gives for them (values, names, types, shapes, data views).

    The header is parsed by anyquant's bounded parser (:func:`anyquant.headers.read_gguf_header`: every length,
    count and offset checked against the file and the header budget, tensors contiguous in order); a long
    array is walked there but decoded here only when asked for. ``header``: that parse of this file, when the
    caller has it (the load's probe), so it is not read twice.

    A model split by gguf-split: ``parts``, the other parts' ``(path, header)`` in order (the header ``None`` to
    read it), each mapped by a :class:`GGUFFile` of its own (``parts``, this file first); the metadata (``fields``)
    is this file's (the first part's), ``tensors`` every part's in order, each viewing its own part's map. Nothing
    is merged or copied; :func:`open_gguf` finds and checks the parts (:mod:`anyquant_gguf.split`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        header: GGUFHeader | None = None,
        parts: Sequence[tuple[str | os.PathLike[str], GGUFHeader | None]] = (),
    ) -> None:
        self.path = os.fspath(path)
        if header is None:
            header = read_gguf_header(Path(self.path), os.path.basename(self.path))
        #: the whole file, copy-on-write (mode ``"c"``: views are writable, so torch takes them without a copy
        #: or a warning; nothing is ever written back)
        self.data = np.memmap(self.path, mode="c")
        self._plain: NDArray[Any] = self.data.view(np.ndarray)
        if len(self._plain) != header.size:
            raise CheckpointError(f"{self.path}: the file changed size while it was being opened")
        self.fields: dict[str, GGUFField] = {
            key: GGUFField(
                key,
                value,
                header.array_lengths.get(key, 1),
                header.skipped_arrays.get(key),
                self,
            )
            for key, value in header.metadata.items()
        }
        self.tensors: list[GGUFTensor] = [GGUFTensor(t, header.data_offset, self) for t in header.tensors]
        #: this file and, for a split model, its other parts in order (each with its own map)
        self.parts: list[GGUFFile] = [self]
        for part_path, part_header in parts:
            part = GGUFFile(part_path, part_header)
            self.parts.append(part)
            self.tensors.extend(part.tensors)
        self._index: dict[str, GGUFTensor] = {}
        for t in self.tensors:
            if t.name in self._index:
                raise CheckpointError(
                    f"tensor {t.name!r} is in two parts of the split GGUF model: "
                    f"{os.path.basename(self._index[t.name]._file.path)} and {os.path.basename(t._file.path)}"
                )
            self._index[t.name] = t


def open_gguf(
    path: str | os.PathLike[str],
    header: GGUFHeader | None = None,
    *,
    parts: Sequence[tuple[str | os.PathLike[str], GGUFHeader | None]] | None = None,
) -> GGUFFile:
    """Open a GGUF file (:class:`GGUFFile`: metadata, tensors viewing a copy-on-write map); ``header``: the
    file's :func:`~anyquant.headers.read_gguf_header`, when already parsed. A malformed header raises
    :class:`anyquant.errors.HeaderError`, an unknown tensor type :class:`UnsupportedGGUFType`.

    A part of a model split by gguf-split opens the whole model: its first part's metadata and every part's
    tensors, the parts found beside it by name and checked (:func:`anyquant_gguf.split.resolve_split`;
    :class:`~anyquant_gguf.split.GGUFSplitError` when they do not fit together). ``parts``: the other parts'
    ``(path, header)``, already found and checked (the loader's), so they are not looked for again."""
    if parts is not None:
        return GGUFFile(path, header, parts)
    from .split import resolve_split

    first = Path(path)
    if header is None:
        header = read_gguf_header(first, first.name)
    model = resolve_split(first, header, lambda p: read_gguf_header(p, p.name))
    others = list(zip(model.paths[1:], model.headers[1:], strict=True))
    return GGUFFile(model.paths[0], model.headers[0], others)


def release_pages(reader: GGUFFile, data: torch.Tensor | None = None) -> None:
    """Drop resident pages of the file from this process (``madvise(MADV_DONTNEED)``).

    All of the file, or only the whole pages under ``data`` (a contiguous tensor that views
    the map; anything else is ignored). For a load that copied what it needs (a weight
    dequantized at load): the mapping stays valid and a page touched later is read back
    from the file (nothing is ever written to it), but the page cache it occupied stops
    counting in the process's RSS.
    """
    for part in reader.parts:  # a split model: every part's map, or the one whose map holds ``data``
        if data is None or part.data.ctypes.data <= data.data_ptr() < part.data.ctypes.data + part.data.nbytes:
            _release_map(part, data)


def _release_map(reader: GGUFFile, data: torch.Tensor | None) -> None:
    """:func:`release_pages` for one file's map."""
    import mmap

    mm = getattr(reader.data, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mm is None or advice is None or mm.closed:
        return
    start, stop = 0, len(mm)
    if data is not None:
        begin = data.data_ptr() - reader.data.ctypes.data
        end = begin + data.numel() * data.element_size()
        if not data.is_contiguous() or begin < 0 or end > len(mm):
            return
        start, stop = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if stop > start:
        try:
            mm.madvise(advice, start, stop - start)
        except (OSError, ValueError):  # pragma: no cover - platform without madvise
            pass


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The python value of a metadata key (str, int, float, bool or list), or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_architecture(reader: GGUFFile) -> str:
    """``general.architecture``; raises :class:`UnsupportedGGUFArchitecture` if unsupported."""
    arch = field_value(reader, "general.architecture")
    if arch not in _HF_CLASSES:
        raise UnsupportedGGUFArchitecture(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return str(arch)


def get_tensor(reader: GGUFFile, gguf_name: str) -> GGUFTensor:
    """The reader's tensor record named ``gguf_name`` (``KeyError`` if absent)."""
    try:
        return reader._index[gguf_name]
    except KeyError:
        raise KeyError(f"no tensor {gguf_name!r} in the GGUF file") from None


def tensor_type_name(reader: GGUFFile, gguf_name: str) -> str:
    """The GGML storage type of a tensor, e.g. ``"Q4_1"``."""
    return get_tensor(reader, gguf_name).tensor_type.name


def _has_tensor(reader: GGUFFile, gguf_name: str) -> bool:
    try:
        get_tensor(reader, gguf_name)
    except KeyError:
        return False
    return True


# --------------------------------------------------------------------------- config


def _arch_value(reader: GGUFFile, arch: str, key: str, default: Any = None) -> Any:
    return field_value(reader, f"{arch}.{key}", default)


# Every number read from the metadata goes through metadata_int / metadata_float (anyquant_gguf.metadata): type,
# finiteness and range checked where it is read, a GGUFMetadataError naming the key and the value otherwise.


def _scalar(reader: GGUFFile, arch: str, key: str) -> Any:
    value = _arch_value(reader, arch, key)
    if isinstance(value, list):
        raise UnsupportedGGUFArchitecture(f"per-layer {arch}.{key} values are not supported")
    return value


@overload
def _arch_int(
    reader: GGUFFile, arch: str, key: str, default: int, *, minimum: int = ..., maximum: int = ...
) -> int: ...
@overload
def _arch_int(
    reader: GGUFFile, arch: str, key: str, default: None = None, *, minimum: int = ..., maximum: int = ...
) -> int | None: ...
def _arch_int(
    reader: GGUFFile, arch: str, key: str, default: int | None = None, *, minimum: int = 1, maximum: int = MAX_SIZE
) -> int | None:
    """``{arch}.{key}``, an integer in ``[minimum, maximum]`` (a count or a size: at least 1 unless told), or
    ``default`` when the key is absent."""
    value = metadata_int(f"{arch}.{key}", _scalar(reader, arch, key), minimum=minimum, maximum=maximum)
    return default if value is None else value


def _required_int(reader: GGUFFile, arch: str, key: str, *, minimum: int = 1, maximum: int = MAX_SIZE) -> int:
    value = metadata_int(f"{arch}.{key}", _scalar(reader, arch, key), minimum=minimum, maximum=maximum, required=True)
    assert value is not None
    return value


@overload
def _arch_float(
    reader: GGUFFile, arch: str, key: str, default: float, *, minimum: float | None = ..., above: bool = ...
) -> float: ...
@overload
def _arch_float(
    reader: GGUFFile, arch: str, key: str, default: None = None, *, minimum: float | None = ..., above: bool = ...
) -> float | None: ...
def _arch_float(
    reader: GGUFFile,
    arch: str,
    key: str,
    default: float | None = None,
    *,
    minimum: float | None = None,
    above: bool = False,
) -> float | None:
    """``{arch}.{key}``, a finite number (``minimum``: at least that, more than it with ``above``), or ``default``
    when the key is absent."""
    value = metadata_float(f"{arch}.{key}", _scalar(reader, arch, key), minimum=minimum, above=above)
    return default if value is None else value


def _required_float(
    reader: GGUFFile, arch: str, key: str, *, minimum: float | None = None, above: bool = False
) -> float:
    value = metadata_float(f"{arch}.{key}", _scalar(reader, arch, key), minimum=minimum, above=above, required=True)
    assert value is not None
    return value


def _rows(reader: GGUFFile, gguf_name: str) -> int | None:
    """The rows (HF's first dimension) of a 2-D table tensor, ``None`` when the file has no such tensor."""
    if not _has_tensor(reader, gguf_name):
        return None
    shape = _hf_shape(get_tensor(reader, gguf_name))
    if len(shape) != 2:
        raise CheckpointError(f"{gguf_name} has shape {shape}; a [vocabulary, hidden] table has two dimensions")
    return shape[0]


def _vocab_size(reader: GGUFFile, arch: str) -> int:
    """The model's vocabulary: the token embedding's rows, checked against what else says a size.

    ``{arch}.vocab_size``, where given, is the embedding's rows (llama.cpp builds ``token_embd`` as
    ``[n_embd, n_vocab]`` with it); the LM head (``output.weight``, when untied) has as many rows; the tokenizer may
    have fewer tokens (a padded embedding) but not more: an id past the embedding's rows would index past it (in
    ``generate``, as a bare ``IndexError``). Any disagreement is a :class:`GGUFMetadataError` naming both sizes.
    """
    key = f"{arch}.vocab_size"
    declared = _arch_int(reader, arch, "vocab_size")
    field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = None if field is None else field.count
    rows = _rows(reader, "token_embd.weight")
    if rows is None:  # a file without the table (the config alone is asked for): what the metadata says
        vocab = declared if declared is not None else tokens
        if vocab is None:
            raise GGUFMetadataError(f"the GGUF file has no token_embd.weight, {key} or tokenizer: no vocabulary size")
        if tokens is not None and tokens > vocab:
            raise GGUFMetadataError(f"the tokenizer has {tokens} tokens (tokenizer.ggml.tokens), {key} says {vocab}")
        return vocab
    if declared is not None and declared != rows:
        raise GGUFMetadataError(
            f"GGUF metadata {key} = {declared}, but the token embedding token_embd.weight has {rows} rows; the file "
            "is damaged or was written wrongly (re-download or re-convert it)"
        )
    if tokens is not None and tokens > rows:
        raise GGUFMetadataError(
            f"the tokenizer has {tokens} tokens (tokenizer.ggml.tokens) but the token embedding token_embd.weight has "
            f"{rows} rows: token ids {rows}..{tokens - 1} would index past it; the file is damaged or was written "
            "wrongly (re-download or re-convert it)"
        )
    head = _rows(reader, "output.weight")
    if head is not None and head != rows:
        raise GGUFMetadataError(
            f"the LM head output.weight has {head} rows but the token embedding token_embd.weight has {rows}: "
            f"{'generated ids would index past the embedding' if head > rows else 'the model has one vocabulary'}; "
            "the file is damaged or was written wrongly (re-download or re-convert it)"
        )
    return rows


def _head_dim(reader: GGUFFile, arch: str) -> int | None:
    key_length = _arch_int(reader, arch, "attention.key_length")
    if key_length is not None:
        return key_length
    if arch == "llama":  # transformers maps rope.dimension_count -> head_dim for llama
        return _arch_int(reader, arch, "rope.dimension_count")
    return None


#: the config's special token ids and the GGUF keys they come from
TOKEN_ID_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
    "unk_token_id": "tokenizer.ggml.unknown_token_id",
}


def _token_ids(reader: GGUFFile, vocab: int) -> dict[str, int]:
    """The special token ids that are tokens of the vocabulary (``vocab`` ids, or the tokenizer's fewer). An id
    that is no integer is a :class:`GGUFMetadataError`; one outside the vocabulary (``0xFFFFFFFF``, past the last
    token) is left out with a warning, as llama.cpp ignores it ("bad special token"): it never reaches the
    embedding."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    limit = vocab if field is None else min(vocab, field.count)
    out = {}
    for hf_key, gguf_key in TOKEN_ID_KEYS.items():
        value = metadata_int(gguf_key, field_value(reader, gguf_key), minimum=None, maximum=None)
        if value is None:
            continue
        if 0 <= value < limit:
            out[hf_key] = value
        else:
            log.warning("GGUF metadata %s = %d is not one of the %d token ids: ignored", gguf_key, value, limit)
    return out


def _llama3_rope_parameters(freqs: NDArray[Any], rope_theta: float, head_dim: int) -> dict[str, Any]:
    """Recover HF ``rope_type="llama3"`` parameters from a ``rope_freqs`` tensor.

    llama.cpp stores the per-frequency divisors, not the parameters; Llama 3.1/3.2
    use low_freq_factor=1, high_freq_factor=4, original context 8192, and the factor is
    the largest divisor. The guess is verified against the stored divisors.
    """
    params = {
        "rope_type": "llama3",
        "factor": float(freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_divisors(params, rope_theta, head_dim)
    if expected.shape != freqs.shape or not np.allclose(expected, freqs, rtol=1e-5, atol=1e-6):
        raise UnsupportedGGUFArchitecture(
            "rope_freqs.weight does not match Llama-3 RoPE scaling (factor "
            f"{params['factor']}, low 1, high 4, original context 8192)"
        )
    return params


def _llama3_divisors(params: dict[str, Any], rope_theta: float, head_dim: int) -> NDArray[Any]:
    base = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / base
    old_ctx = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))
    return out.astype(np.float32)


def _rope_parameters(reader: GGUFFile, arch: str, rope_theta: float, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default"}
    scaling = _arch_value(reader, arch, "rope.scaling.type")
    if _has_tensor(reader, "rope_freqs.weight"):
        freqs = load_tensor(reader, "rope_freqs.weight").numpy()
        params = _llama3_rope_parameters(freqs, rope_theta, head_dim)
    elif scaling in ("linear", "yarn"):
        params = {
            "rope_type": scaling,
            "factor": _arch_float(reader, arch, "rope.scaling.factor", 1.0, minimum=0.0, above=True),
        }
        orig = _arch_int(reader, arch, "rope.scaling.original_context_length")
        if orig is not None:
            params["original_max_position_embeddings"] = orig
        for key in ("beta_fast", "beta_slow"):
            value = _arch_float(reader, arch, f"rope.scaling.yarn_{key}")
            if value is not None and scaling == "yarn":
                params[key] = value
    elif scaling not in (None, "none"):
        raise UnsupportedGGUFArchitecture(f"RoPE scaling type {scaling!r} is not supported")
    params["rope_theta"] = rope_theta
    return params


def hf_config_from_gguf(reader: GGUFFile) -> dict[str, Any]:
    """A transformers ``config.json``-style dict for a GGUF file of a supported architecture."""
    arch = gguf_architecture(reader)
    model_type, hf_class = _HF_CLASSES[arch]
    hidden = _required_int(reader, arch, "embedding_length")
    n_heads = _required_int(reader, arch, "attention.head_count", maximum=hidden)
    rope_theta = _arch_float(reader, arch, "rope.freq_base", 10000.0, minimum=0.0, above=True)
    head_dim = _head_dim(reader, arch)
    if head_dim is None and arch not in ("llama", "qwen2"):
        head_dim = hidden // n_heads  # llama.cpp's default; the HF classes' own defaults differ (128, 256)
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "vocab_size": _vocab_size(reader, arch),
        "hidden_size": hidden,
        "intermediate_size": _required_int(reader, arch, "feed_forward_length"),
        "num_hidden_layers": _required_int(reader, arch, "block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _arch_int(reader, arch, "attention.head_count_kv", n_heads, maximum=n_heads),
        "rms_norm_eps": _required_float(reader, arch, "attention.layer_norm_rms_epsilon", minimum=0.0),
        "rope_theta": rope_theta,
        "max_position_embeddings": _required_int(reader, arch, "context_length"),
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2"
        or (arch in ("qwen3", "qwen3moe") and _has_tensor(reader, "blk.0.attn_q.bias")),
        "tie_word_embeddings": not _has_tensor(reader, "output.weight"),
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    rope_head_dim = head_dim or hidden // n_heads
    if arch in ("gemma2", "gemma3"):
        _gemma_config(reader, arch, config, rope_head_dim)
    elif arch == "phi3":
        _phi3_config(reader, arch, config, rope_head_dim)
    else:
        config["rope_parameters"] = _rope_parameters(reader, arch, rope_theta, rope_head_dim)
    experts = _expert_count(reader, arch)
    if experts:
        _moe_config(reader, arch, config, experts)
    config.update(_token_ids(reader, config["vocab_size"]))
    return config


def _expert_count(reader: GGUFFile, arch: str) -> int:
    return _arch_int(reader, arch, "expert_count", 0, minimum=0)


def _moe_config(reader: GGUFFile, arch: str, config: dict[str, Any], experts: int) -> None:
    """Mixtral (a ``llama`` file with experts) and Qwen3-MoE: llama.cpp routes by softmax over the router's
    logits, keeps the top ``expert_used_count`` and renormalizes their weights (``build_moe_ffn``)."""
    if arch not in ("llama", "qwen3moe", "qwen2moe"):
        raise UnsupportedGGUFArchitecture(f"{arch} with experts is not supported")
    gating = _arch_int(reader, arch, "expert_gating_func", minimum=0)
    scale = _arch_float(reader, arch, "expert_weights_scale")
    if (gating is not None and gating != 1) or (scale is not None and scale not in (0.0, 1.0)):
        raise UnsupportedGGUFArchitecture(f"{arch} expert gating {gating} / weights scale {scale} is not supported")
    if _arch_int(reader, arch, "expert_shared_count", 0, minimum=0) and arch != "qwen2moe":
        raise UnsupportedGGUFArchitecture(f"{arch} with shared experts is not supported")
    used = _required_int(reader, arch, "expert_used_count", maximum=experts)
    if arch == "llama":
        config["model_type"], config["architectures"] = _MIXTRAL[0], [_MIXTRAL[1]]
        del config["attention_bias"]  # not a MixtralConfig key (it has no biases)
        config.update(num_local_experts=experts, num_experts_per_tok=used, sliding_window=None)
    else:
        config.update(
            num_experts=experts,
            num_experts_per_tok=used,
            moe_intermediate_size=_required_int(reader, arch, "expert_feed_forward_length"),
            norm_topk_prob=arch == "qwen3moe",  # llama.cpp's qwen2moe graph keeps the top-k softmax weights as they are
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "qwen2moe":
        config["qkv_bias"] = config.pop("attention_bias") or _has_tensor(reader, "blk.0.attn_q.bias")
        config["shared_expert_intermediate_size"] = _arch_int(
            reader, arch, "expert_shared_feed_forward_length", config["intermediate_size"]
        )
        config["use_sliding_window"] = False


def _sliding_layers(reader: GGUFFile, arch: str, layers: int, default_pattern: int) -> list[bool]:
    """Which layers use the sliding window, as llama.cpp decides (``load_swa_pattern``): the
    ``attention.sliding_window_pattern`` array (one bool per layer), or its period ``n`` (every
    ``n``-th layer is global, the others slide; 0: all slide), or the architecture's period."""
    key = f"{arch}.attention.sliding_window_pattern"
    value = field_value(reader, key)
    if isinstance(value, list):
        if len(value) != layers:
            raise UnsupportedGGUFArchitecture(f"{key} has {len(value)} entries for {layers} layers")
        # bools as llama.cpp writes them; 0/1 integers taken as such, anything else refused
        return [
            v if isinstance(v, bool) else bool(metadata_int(f"{key}[{i}]", v, maximum=1)) for i, v in enumerate(value)
        ]
    period = _arch_int(reader, arch, "attention.sliding_window_pattern", default_pattern, minimum=0)
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _gemma_config(reader: GGUFFile, arch: str, config: dict[str, Any], head_dim: int) -> None:
    """Gemma 2 / Gemma 3 (text): what llama.cpp's gemma2/gemma3 graphs compute, as HF config keys."""
    layers, hidden, n_heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    config["hidden_act"] = config["hidden_activation"] = "gelu_pytorch_tanh"
    # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) for the 27B models
    # (recognised by their layer count: 46 for Gemma 2, 62 for Gemma 3)
    config["query_pre_attn_scalar"] = hidden // n_heads if layers == {"gemma2": 46, "gemma3": 62}[arch] else head_dim
    rope_theta = config["rope_theta"]
    global_rope = _rope_parameters(reader, arch, rope_theta, head_dim)
    swa_theta = _arch_float(reader, arch, "rope.freq_base_swa", minimum=0.0, above=True)
    window: int | None
    if arch == "gemma2":
        # llama.cpp: window 4096 and every other layer sliding unless the file says otherwise; soft-capping
        # 50 / 30 by default; the sliding layers use the global RoPE unless rope.freq_base_swa is set
        if swa_theta is not None and swa_theta != rope_theta:
            raise UnsupportedGGUFArchitecture(
                f"gemma2 with a sliding-window RoPE base ({swa_theta}) other than the global one ({rope_theta})"
            )
        window = _arch_int(reader, arch, "attention.sliding_window", 4096)
        sliding = _sliding_layers(reader, arch, layers, 2)
        # both caps divide (tanh(x / cap) * cap): positive
        config["attn_logit_softcapping"] = _arch_float(
            reader, arch, "attn_logit_softcapping", 50.0, minimum=0.0, above=True
        )
        config["final_logit_softcapping"] = _arch_float(
            reader, arch, "final_logit_softcapping", 30.0, minimum=0.0, above=True
        )
        config["rope_parameters"] = global_rope
    else:
        # llama.cpp: no sliding window unless the file gives one (0: none); then every 6th layer is global and the
        # sliding ones use rope.freq_base_swa (10000 by default) without scaling
        window = _arch_int(reader, arch, "attention.sliding_window", 0, minimum=0) or None
        sliding = [False] * layers if window is None else _sliding_layers(reader, arch, layers, 6)
        final_cap = _arch_float(reader, arch, "final_logit_softcapping", minimum=0.0)
        config["attn_logit_softcapping"] = None
        config["final_logit_softcapping"] = final_cap or None
        local = {"rope_type": "default", "rope_theta": 10000.0 if swa_theta is None else swa_theta}
        config["rope_parameters"] = {"full_attention": global_rope, "sliding_attention": local}
    config["sliding_window"] = window
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]


def _phi3_config(reader: GGUFFile, arch: str, config: dict[str, Any], head_dim: int) -> None:
    """Phi-3: partial rotary, LongRoPE from the ``rope_factors_long/short`` tensors, no sliding window."""
    del config["attention_bias"]  # not a Phi3Config key (it has no biases)
    # llama.cpp runs Phi-3 without its sliding window ("Phi SWA is currently disabled"), whatever the file says
    config["sliding_window"] = None
    rope_dims = _arch_int(reader, arch, "rope.dimension_count", maximum=head_dim)
    partial = 1.0 if rope_dims is None else rope_dims / head_dim
    orig = _arch_int(reader, arch, "rope.scaling.original_context_length")
    if orig is not None:
        config["original_max_position_embeddings"] = orig
    attn_factor = _arch_float(reader, arch, "rope.scaling.attn_factor", 1.0, minimum=0.0, above=True)
    scaling = _arch_value(reader, arch, "rope.scaling.type")
    has_long, has_short = (_has_tensor(reader, name) for name in sorted(_LONGROPE_TENSORS))
    params: dict[str, Any]
    if has_long and has_short:
        # llama.cpp picks the long factors when the context (n_ctx) exceeds the original one, HF when the
        # sequence does; both scale cos/sin by the attention factor
        params = {
            "rope_type": "longrope",
            "long_factor": [float(v) for v in load_tensor(reader, "rope_factors_long.weight").tolist()],
            "short_factor": [float(v) for v in load_tensor(reader, "rope_factors_short.weight").tolist()],
            "original_max_position_embeddings": config["max_position_embeddings"] if orig is None else orig,
            "attention_factor": attn_factor,
        }
    elif has_long or has_short:
        raise UnsupportedGGUFArchitecture("phi3 with only one of rope_factors_long / rope_factors_short")
    elif (
        scaling in (None, "none", "linear", "longrope")
        and attn_factor == 1.0
        and not _arch_float(reader, arch, "rope.scaling.factor")
    ):
        params = {"rope_type": "default"}
    else:
        raise UnsupportedGGUFArchitecture(f"phi3 RoPE scaling {scaling!r} without LongRoPE factor tensors")
    params["rope_theta"] = config["rope_theta"]
    params["partial_rotary_factor"] = partial
    config["rope_parameters"] = params


# --------------------------------------------------------------------------- names


def _hf_name(gguf_name: str, blocks: dict[str, str] = _BLOCK_NAMES) -> str | None:
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        hf_part = blocks.get(part)
        return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{kind}"
    match = _GLOBAL_RE.match(gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    return None


def hf_tensor_names(reader: GGUFFile) -> dict[str, str]:
    """Map every GGUF tensor name to its transformers parameter name.

    ``rope_freqs.weight`` (and Phi-3's ``rope_factors_long/short.weight``: no HF parameter, they are
    in the config) is left out, and so are a MoE file's 3-D expert tensors (see :func:`hf_expert_names`);
    any other unknown tensor raises :class:`UnsupportedGGUFArchitecture`.
    """
    arch = gguf_architecture(reader)
    moe = _expert_count(reader, arch) > 0
    blocks = {**_ARCH_BLOCK_NAMES[arch], **_ROUTER} if moe else _ARCH_BLOCK_NAMES[arch]
    ignored = _IGNORED_TENSORS | _LONGROPE_TENSORS if arch == "phi3" else _IGNORED_TENSORS
    names: dict[str, str] = {}
    for tensor in reader.tensors:
        if tensor.name in ignored or (moe and _EXPERT_RE.match(tensor.name)):
            continue
        hf_name = _hf_name(tensor.name, blocks)
        if hf_name is None:
            raise UnsupportedGGUFArchitecture(f"unexpected GGUF tensor {tensor.name!r} for architecture {arch!r}")
        names[tensor.name] = hf_name
    return names


def hf_expert_names(reader: GGUFFile) -> dict[str, tuple[str, int]]:
    """A MoE file's experts, one linear each: ``{model.layers.N.mlp.experts.E.gate_proj.weight: (GGUF name, E)}``
    (``up_proj``, ``down_proj`` alike); empty for a dense file.

    llama.cpp stores a layer's experts as one 3-D tensor (``blk.N.ffn_gate_exps.weight``, GGUF shape
    ``[in, out, experts]``, i.e. ``[experts, out, in]`` in HF order); expert ``E`` is the contiguous slice
    ``E`` of its first dimension (:func:`load_raw` with ``expert=E``).
    """
    arch = gguf_architecture(reader)
    count = _expert_count(reader, arch)
    out: dict[str, tuple[str, int]] = {}
    if not count:
        return out
    for tensor in reader.tensors:
        match = _EXPERT_RE.match(tensor.name)
        if match is None:
            continue
        shape = _hf_shape(tensor)
        if len(shape) != 3 or shape[0] != count:
            raise UnsupportedGGUFArchitecture(f"{tensor.name} has shape {shape}, expected {count} experts first")
        layer, part = match.groups()
        for expert in range(count):
            out[f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_LEAVES[part]}.weight"] = (tensor.name, expert)
    return out


def qk_permutation_heads(reader: GGUFFile, gguf_name: str) -> int | None:
    """Number of heads whose rows must be un-permuted for this tensor, or ``None``.

    Only llama.cpp's ``llama`` architecture is permuted (``LlamaModel.permute`` in the converter).
    """
    match = _QK_RE.match(gguf_name)
    if match is None or gguf_architecture(reader) not in _PERMUTED_QK:
        return None
    n_heads = _required_int(reader, "llama", "attention.head_count")
    if match.group(1) == "q":
        return n_heads
    return _arch_int(reader, "llama", "attention.head_count_kv", n_heads, maximum=n_heads)


def norm_offset(reader: GGUFFile, gguf_name: str) -> float:
    """What llama.cpp's converter added to this tensor (1 for a Gemma 2/3 ``*norm.weight``), else 0."""
    if not gguf_name.endswith("norm.weight"):
        return 0.0
    return 1.0 if gguf_architecture(reader) in _NORM_PLUS_ONE else 0.0


def unpermute_qk_rows(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-pair Q/K row order along dim 0 (returns a copy)."""
    rows = tensor.shape[0]
    if rows % (2 * n_heads) != 0:
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    grouped = tensor.reshape(n_heads, rows // n_heads // 2, 2, *tensor.shape[1:])
    return grouped.transpose(1, 2).reshape(tensor.shape)


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class GGUFRawTensor:
    """A tensor's raw GGUF bytes, rows in HF order.

    ``data`` is ``uint8`` ``[out, bytes_per_row]`` for 2-D tensors (``[bytes]`` for
    1-D), zero-copy from the mmap except for un-permuted Q/K rows; ``shape`` is the
    logical HF shape (``[out, in]`` or ``[n]``); ``qk_heads``: the rows are still as llama.cpp's converter permuted
    them, in that many heads (:func:`load_raw` with ``unpermute=False``), else ``None``.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    qk_heads: int | None = None


def _hf_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    shape = tuple(reversed(tensor.shape))
    match = _BLOCK_RE.match(tensor.name)
    if len(shape) == 1 and match and match.group(2) in _ROW_VECTORS:
        return (1, shape[0])
    return shape


def _check_type(tensor: GGUFTensor) -> None:
    if tensor.tensor_type not in DEQUANTIZABLE_TYPES:
        supported = ", ".join(sorted(t.name for t in DEQUANTIZABLE_TYPES))
        raise UnsupportedGGUFType(
            f"tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, "
            f"which is not supported (supported: {supported})"
        )
    check_supported(tensor.tensor_type)  # a lattice type's grid, from gguf


def _as_torch(array: NDArray[Any]) -> torch.Tensor:
    if not array.flags.writeable:  # read-only mmap ("r" mode reader): copy, never alias
        array = np.array(array)
    return torch.from_numpy(array)


def load_raw(reader: GGUFFile, gguf_name: str, *, expert: int | None = None, unpermute: bool = True) -> GGUFRawTensor:
    """The tensor's stored bytes as a ``uint8`` torch tensor, rows in HF order; ``expert``: that expert's
    slice of a 3-D expert tensor (zero-copy, HF shape ``[out, in]``); ``unpermute=False``: permuted Q/K rows left
    as stored (zero-copy; ``qk_heads`` says how to un-permute them)."""
    tensor = get_tensor(reader, gguf_name)
    _check_type(tensor)
    shape = _hf_shape(tensor)
    array = tensor.data
    if expert is not None:
        if len(shape) != 3 or not 0 <= expert < shape[0]:
            raise ValueError(f"{gguf_name} of shape {shape} has no expert {expert}")
        array, shape = array[expert], shape[1:]
    data = _as_torch(array.view(np.uint8))  # F32/F16 rows become their bytes
    heads = qk_permutation_heads(reader, gguf_name)
    if heads is not None and not unpermute:
        return GGUFRawTensor(data=data, qtype=tensor.tensor_type, shape=shape, qk_heads=heads)
    if heads is not None:
        data = unpermute_qk_rows(data, heads)
    return GGUFRawTensor(data=data, qtype=tensor.tensor_type, shape=shape)


def load_tensor(
    reader: GGUFFile, gguf_name: str, *, dtype: torch.dtype = torch.float32, expert: int | None = None
) -> torch.Tensor:
    """Dequantize a tensor into HF orientation and order (float32, then ``dtype``).

    Uses the torch block dequantizer of :mod:`.dequant`, which equals ``gguf.quants.dequantize``
    bit for bit but writes the float32 result once (numpy's goes through temporaries of the
    same size: ~3x the tensor transiently). Q/K rows are un-permuted on the raw bytes before
    dequantizing; Gemma norms get the converter's +1 taken off (:func:`norm_offset`). Other F32
    tensors alias the (copy-on-write) map when ``dtype`` is float32.
    """
    raw = load_raw(reader, gguf_name, expert=expert)
    value = dequantize_blocks_torch(raw.data, raw.qtype, raw.shape)
    offset = norm_offset(reader, gguf_name)
    if offset:
        value = value - offset  # a new tensor: Gemma's HF norms add the 1 back (x * (1 + w))
    return value.to(dtype)


def hf_state_dict(reader: GGUFFile, *, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized, under its HF name (no ``lm_head.weight`` when tied; a MoE file's experts one
    linear each, as :func:`hf_expert_names` names them)."""
    out = {hf: load_tensor(reader, name, dtype=dtype) for name, hf in hf_tensor_names(reader).items()}
    for hf, (name, expert) in hf_expert_names(reader).items():
        out[hf] = load_tensor(reader, name, dtype=dtype, expert=expert)
    return out


# --------------------------------------------------------------------------- tokenizer


def tokenizer_from_gguf(source: str | os.PathLike[str] | GGUFFile) -> Any:
    """A transformers tokenizer (with chat template) built offline from GGUF metadata.

    ``source`` is a path or an open reader (whose metadata is then not read again); see
    :func:`anyquant_gguf.tokenizer.tokenizer_from_reader`.
    """
    from .tokenizer import tokenizer_from_reader

    reader = source if isinstance(source, GGUFFile) else open_gguf(source)
    return tokenizer_from_reader(reader)
