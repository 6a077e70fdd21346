"""The GGUF loader: GGUF files (llama and Mixtral, qwen2, qwen3, qwen3moe, qwen2moe, gemma2, gemma3, phi3) into
transformers modules, packed linears kept packed.

One load opens the file once: the config, the tensors and the tokenizer all come from the same
memory-mapped :class:`~anyquant_gguf.reader.GGUFFile`.

Backends:

* a registered fast backend that runs GGUF blocks (anyquant-cpu's, on a CPU: auto where its kernels take some of
  the file's linears): each linear offers its blocks as stored (``GGUFBlocks``, zero-copy) and then a ``Decoded`` copy
  whose prompts stay exact from the file's blocks; the engine decides which runs. The head is the engine's over the
  file's table (:meth:`table_head`), the token embedding and a tied LM head stay packed unless ``embedding="dense"``
  (faster decode, more memory). Greedy text can leave the exact path's at a near-tie, as llama.cpp's own CPU path
  (8-bit activations) can.
* ``dequantized`` (auto elsewhere; the exact choice): every weight dequantized to the compute
  dtype at load (the packed ``GGUFLinear`` keeps its bytes and a cached dense weight); the file's
  pages are then released from the process (``madvise``), so RSS holds the dense weights only.
* ``packed``: quantized linears stay packed (file-backed) and are dequantized on every
  forward; with ``embedding="packed"`` (the default) the token embedding stays packed too
  (:class:`~anyquant_gguf.qlinear.GGUFEmbedding`, only looked-up rows are dequantized) and a
  tied LM head becomes a :class:`~anyquant_gguf.qlinear.GGUFTiedHead` over the same bytes
  (dequantized in 1 MiB slices per forward). ``embedding="dense"`` keeps a dense float
  embedding (tied to the head as usual): more memory, faster decode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from anyquant.plugin import (
    AnyquantError,
    BackendInfo,
    CheckpointError,
    Detection,
    LoadedModel,
    LoadOptions,
    MissingTensorError,
    ModuleInfo,
    Probe,
    UnsupportedFormatError,
)
from anyquant_runtime import RUNTIME_OPTIONS, LoadContext, LoadPlan, TransformersLoader
from anyquant_runtime.layouts import Decoded, GGUFBlocks, Layout

from .plugin import gguf_model

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["GGUFLoader", "GGUFSource"]

log = logging.getLogger(__name__)

#: equals :data:`anyquant_gguf.reader.SUPPORTED_ARCHITECTURES` (kept here: that module imports torch)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "qwen2moe")
EMBEDDING_MODES = ("packed", "dense")
_EMBED = "model.embed_tokens.weight"
#: the key of the fast backend's record in ``ctx.state`` (which linears took which of its kernels)
_RECORD = "gguf_fast_record"
_HEAD = "lm_head.weight"


def gguf_path(probe: Probe) -> Path:
    """The file whose metadata is the model's: the probe's one GGUF file, or the first part of a split model
    (:func:`~anyquant_gguf.plugin.gguf_model` checks the parts)."""
    return gguf_model(probe).paths[0]


def _kernel_linears(probe: Probe) -> int:
    """How many of the GGUF model's tensors (every part's), the token embedding aside, the fast engine takes here,
    from the headers: each packed tensor's blocks described as the engine's layout (:func:`.qlinear.blocks_layout`;
    a Q6_K or Q8_0 file has no int4 tensor, only the GGUF-block kernel takes it)."""
    from anyquant_runtime.cpu import layouts_run

    from .qlinear import PACKED_TYPES, blocks_layout

    try:
        headers = gguf_model(probe).headers
    except AnyquantError:
        return 0
    packed = {int(t): t for t in PACKED_TYPES}
    layers = []
    for t in (t for h in headers for t in h.tensors if t.type_id in packed and not t.name.startswith("token_embd")):
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        layers.append([blocks_layout(packed[t.type_id], (rows, t.shape[0]))])
    return layouts_run(layers)


class GGUFSource:
    """HF-named tensors of a GGUF file, dequantized on request (torch block dequant, bit-exact
    with ``gguf.quants``).

    A name in ``placeholders`` (name -> dtype) is answered with a zero-stride tensor of the
    right shape that holds no memory: the loader replaces its module after the build.

    A MoE file's experts are named one linear each (``model.layers.N.mlp.experts.E.gate_proj.weight``,
    :func:`~anyquant_gguf.reader.hf_expert_names`), each a slice of its layer's 3-D GGUF tensor: core replaces
    transformers' fused experts module with per-expert linears made by the loader's factory.
    """

    def __init__(self, path: Path, reader: Any = None) -> None:
        from .reader import hf_expert_names, hf_tensor_names, open_gguf

        self.path = path
        self.reader = open_gguf(path) if reader is None else reader
        self.gguf_names = {hf: g for g, hf in hf_tensor_names(self.reader).items()}
        #: HF name -> expert index, for the per-expert slices of 3-D expert tensors
        self.experts: dict[str, int] = {}
        for hf, (g, expert) in hf_expert_names(self.reader).items():
            self.gguf_names[hf], self.experts[hf] = g, expert
        self.used: set[str] = set()
        self.placeholders: dict[str, torch.dtype] = {}
        #: copy every tensor out of the map and drop its file pages from RSS (dequantized backend)
        self.release_after_copy = False

    def keys(self) -> Iterator[str]:
        return iter(self.gguf_names)

    def __contains__(self, name: object) -> bool:
        return name in self.gguf_names

    def get(self, name: str) -> torch.Tensor:
        from .reader import load_tensor

        if name not in self.gguf_names:
            raise MissingTensorError(f"{self.path.name} has no tensor for {name!r}")
        self.used.add(name)
        if name in self.placeholders:
            import torch

            shape = self.shape(name)
            return torch.zeros(1, dtype=self.placeholders[name]).expand(shape)
        value = load_tensor(self.reader, self.gguf_names[name], expert=self.experts.get(name))
        if self.release_after_copy:
            if self._in_map(value):
                # a float tensor stored as-is (norms): a view would keep the mapping live, and
                # the page fault of its first forward maps the file pages around it too
                # (the kernel's fault-around, 64 KiB per fault): copy it out
                value = value.clone()
            self.release(name)
        return value

    def _in_map(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views the map of the file (of any part of a split model)."""
        ptr = tensor.data_ptr()
        return any(p.data.ctypes.data <= ptr < p.data.ctypes.data + p.data.nbytes for p in self.reader.parts)

    def release(self, name: str) -> None:
        """Drop the file pages under tensor ``name`` from RSS (they are re-read if touched)."""
        from .reader import get_tensor, release_pages

        data = get_tensor(self.reader, self.gguf_names[name]).data
        if name in self.experts:
            data = data[self.experts[name]]
        if data.flags.c_contiguous:
            import torch

            release_pages(self.reader, torch.from_numpy(data.reshape(-1).view("uint8")))

    def shape(self, name: str) -> tuple[int, ...]:
        from .reader import get_tensor

        shape = tuple(reversed(get_tensor(self.reader, self.gguf_names[name]).shape))
        return shape[1:] if name in self.experts else shape

    def raw(self, name: str, *, unpermute: bool = True) -> Any:
        from .dequant import check_finite_blocks
        from .reader import load_raw

        self.used.add(name)
        raw = load_raw(self.reader, self.gguf_names[name], expert=self.experts.get(name), unpermute=unpermute)
        check_finite_blocks(name, raw.data, raw.qtype)  # a NaN/inf scale: refused at load (SECURITY.md)
        return raw

    def qtype(self, name: str) -> Any:
        from .reader import get_tensor

        return get_tensor(self.reader, self.gguf_names[name]).tensor_type

    def unused(self) -> list[str]:
        return sorted(set(self.gguf_names) - self.used)


class GGUFLoader(TransformersLoader):
    format = "gguf"
    backend_order = ("dequantized", "packed")
    format_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            **RUNTIME_OPTIONS,
            "embedding": "'packed' (the default but with 'dequantized': looked-up rows decoded from the GGUF blocks) "
            "or 'dense'",
        }
    )
    layout_kinds: ClassVar[tuple[type[Layout], ...]] = (GGUFBlocks, Decoded)

    def __init__(self) -> None:
        #: the open readers of the file being loaded, shared by the hooks that take a probe, not the load's
        #: context (tokenizer, tensor_source, model_config): one header parse per load
        self._readers: dict[Path, Any] | None = None

    def own_backends(self) -> list[BackendInfo]:
        return [
            BackendInfo(
                "packed",
                True,
                description="block-quantized linears (Q4_0/Q4_1/Q5_x/Q8_0, K-quants, IQ-quants, TQ1_0/TQ2_0, MXFP4), "
                "the token embedding and a tied "
                "LM head stay packed (file-backed mmap), dequantized in torch on every forward "
                "(embedding='dense' keeps a dense embedding and head)",
            ),
            BackendInfo(
                "dequantized",
                True,
                description="every tensor dequantized to the compute dtype at load; the file's pages are then released",
            ),
        ]

    def validate(self, probe: Probe, detection: Detection) -> None:
        gguf_path(probe)
        arch = detection.details.get("architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedFormatError(
                f"{probe.path}: GGUF architecture {arch!r} is not mapped to transformers by anyquant "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

    def _reader(self, probe: Probe) -> Any:
        """The open file of the probe (its header as the probe parsed it): shared by everything one :meth:`load`
        reads."""
        from .reader import open_gguf

        model = gguf_model(probe)
        path = model.paths[0]
        reader = None if self._readers is None else self._readers.get(path)
        if reader is None:
            reader = open_gguf(path, model.headers[0], parts=list(zip(model.paths[1:], model.headers[1:], strict=True)))
            if self._readers is not None:
                self._readers[path] = reader
        return reader

    def load(self, probe: Probe, detection: Detection, options: LoadOptions) -> Any:
        embedding = options.extra.get("embedding", "packed")
        if embedding not in EMBEDDING_MODES:
            raise UnsupportedFormatError(f"embedding={embedding!r}: choose one of {EMBEDDING_MODES}")
        self._readers = {}
        try:
            return super().load(probe, detection, options)
        finally:
            self._readers = None

    def plan(self, probe: Probe, detection: Detection, options: LoadOptions, device: Any) -> LoadPlan:
        """The backend, from the file's linears that a fast backend's kernels take (``auto`` picks it where some)."""
        return LoadPlan(self.choose_backend(options.backend, device, kernel_linears=_kernel_linears(probe)))

    def finish(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """The packed token embedding installed, the file's pages released after a dequantized load."""
        src = ctx.source
        info: dict[str, Any] = {"embedding": "dense"}
        if isinstance(src, GGUFSource):
            if src.placeholders:
                self._install_packed_embedding(loaded.module, src)
                info["embedding"] = "packed"
            if loaded.backend == "dequantized":
                from .reader import release_pages

                release_pages(src.reader)
        loaded.info = {**loaded.info, **info}
        return loaded

    def finish_fast(self, loaded: LoadedModel, ctx: LoadContext) -> LoadedModel:
        """The fast backend's decode-path norms where some linear runs its kernels, and the record under its name
        (which linears took which kernel); the head was built with the linears."""
        record = ctx.state.get(_RECORD)
        plan = self.fast_plan(ctx)
        if record is None or plan is None:
            return loaded
        norms = plan.install_norms(loaded.module) if record["converted"] + len(record["bf16"]) else 0
        if norms:
            record["kernel_norms"] = norms
        if norms and plan.attention:
            record["kernel_attention"] = plan.attention  # decode steps' attention on the kernel, layers
        rows = plan.install_embedding_rows(loaded.module)
        if rows is not None:
            record["embedding_rows"] = rows  # the packed embedding's lookups decoded by the backend's kernel
        return self.record_fast(loaded, record)

    @staticmethod
    def _install_packed_embedding(module: Any, src: GGUFSource) -> None:
        from .qlinear import GGUFEmbedding, GGUFRows, GGUFTiedHead

        old = module.get_input_embeddings()
        weight = getattr(old, "weight", None)
        if weight is None or weight.stride() != (0, 0):
            raise CheckpointError("the model's input embedding is not the GGUF token_embd placeholder")
        raw = src.raw(_EMBED)
        head = module.get_output_embeddings()
        source = getattr(head, "source", None)  # the fast backend's head over the embedding's GGUFRows, when tied
        tied = (
            head.qweight
            if isinstance(head, GGUFTiedHead)
            else source.qweight
            if isinstance(source, GGUFRows) and getattr(head, "tied_to_input_embedding", False)
            else None
        )
        data = raw.data if tied is None else tied  # share the tied head's bytes
        # Gemma's ScaledWordEmbedding multiplies the looked-up rows by its embed_scale buffer (sqrt(hidden))
        scale = getattr(old, "embed_scale", None)
        scale = None if scale is None else float(scale)
        new = GGUFEmbedding(data, raw.qtype, raw.shape, dtype=weight.dtype, scale=scale)
        module.set_input_embeddings(new.to(weight.device))

    def choose_backend(self, requested: str, device: Any, *, kernel_linears: int = 0) -> str:
        """``kernel_linears``: how many of the file's linears the fast backend's kernels take (:meth:`plan` counts).
        ``auto``: the fast backend where its kernels take some (the CPU engine loads faster, peaks lower and decodes
        faster than dequantized, and both beat transformers' gguf load on all three: docs/benchmarks.md), else the
        exact dequantized."""
        from anyquant.plugin import choose_backend

        why = "no linear of this file takes its kernels"
        skip = {} if kernel_linears else {s.name: why for s in self.fast_backends()}
        return choose_backend(self.format, self.backends(), self.preference(), requested, device, skip=skip)

    def keep_embedding_dtype(self, ctx: LoadContext) -> bool:
        """No: the token embedding stays packed, or is dense in the compute dtype."""
        return False

    def file_tables(self, ctx: LoadContext) -> bool:
        """No: the head is built over the file's table as the linears are (:meth:`make_linear`)."""
        return False

    def tensor_source(self, probe: Probe, options: LoadOptions) -> GGUFSource:
        return GGUFSource(gguf_path(probe), self._reader(probe))

    def model_config(self, probe: Probe) -> Mapping[str, Any]:
        from .reader import hf_config_from_gguf

        return hf_config_from_gguf(self._reader(probe))

    def tokenizer(self, probe: Probe, options: LoadOptions) -> Any:
        from .reader import tokenizer_from_gguf

        return tokenizer_from_gguf(self._reader(probe))

    def make_linear(self, ctx: LoadContext) -> Callable[[str, nn.Linear], nn.Module | None]:
        from .qlinear import PACKED_TYPES, GGUFLinear, GGUFRows, GGUFTiedHead, blocks_layout

        src = ctx.source
        assert isinstance(src, GGUFSource)
        mode: Literal["on-the-fly", "dequant-at-load"] = "on-the-fly" if ctx.backend == "packed" else "dequant-at-load"
        plan: Any = self.fast_plan(ctx)  # the fast backend's (None on the exact ones), which builds its modules
        embedding = ctx.options.extra.get("embedding", "dense" if ctx.backend == "dequantized" else "packed")
        packed_embedding = (
            (ctx.backend == "packed" or plan is not None)
            and embedding == "packed"
            and ctx.device.type == "cpu"
            and _EMBED in src
            and src.qtype(_EMBED) in PACKED_TYPES
        )
        if packed_embedding:
            src.placeholders[_EMBED] = ctx.dtype
        src.release_after_copy = ctx.backend == "dequantized" or plan is not None
        fast: dict[str, Any] | None = None  # the fast backend's record: which linears took which of its kernels
        if plan is not None:
            from anyquant_runtime.cpu import layouts_run

            fast = ctx.state[_RECORD] = {
                "converted": 0,
                "bf16": {},
                "dequantized": {},
                "prefill_dtype": plan.prefill_name,
            }

        def fast_head(raw: Any) -> tuple[nn.Module, bool] | None:
            """The fast backend's head over the file's table, and whether it decodes from a copy of another type:
            the table's blocks on the engine's block kernel where it reads them, else a decode copy of any other type
            (the table read for prompts and the exact top logits); ``None`` where neither runs."""
            head: tuple[nn.Module, bool] | None = plan.table_head(
                GGUFRows(raw.data, raw.qtype, raw.shape), blocks_layout(raw.qtype, raw.shape, raw.data)
            )
            return head

        def on_kernel(module: nn.Module, qtype: Any) -> bool:
            """Record a module on the GGUF-block kernel; whether it reads the file's bytes in place."""
            assert fast is not None
            fast["converted"] += 1
            in_place = not getattr(module, "interleaved", False)  # an interleaved copy: the pages can go
            key_name = "in_place" if in_place else "interleaved"
            fast[key_name] = fast.get(key_name, 0) + 1
            blocks = fast.setdefault("block_kernel", {})  # linears per block type
            blocks[qtype.name] = blocks.get(qtype.name, 0) + 1
            return in_place

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            key = f"{name}.weight"
            if packed_embedding and key == _HEAD and key not in src:
                # tied head: a packed linear over the embedding's own bytes (a fast backend: its decode form)
                raw = src.raw(_EMBED)
                made = fast_head(raw) if fast is not None else None
                if made is not None:
                    made[0].tied_to_input_embedding = True  # type: ignore[assignment]  # export_dense ties them again
                    return made[0]
                return GGUFTiedHead(raw.data, raw.qtype, raw.shape)
            if key not in src or src.qtype(key) not in PACKED_TYPES:
                return None  # F32/F16/BF16: a dense nn.Linear filled from the source
            # a Q/K weight of a "llama" file that the engine takes with the interleaving copy: its rows as stored
            # (permuted, zero-copy), which the engine reads back in the model's order itself (no un-permuted copy
            # made first); else the rows un-permuted here
            stored = (
                fast is not None
                and key != _HEAD
                and plan.interleave
                and layouts_run([[blocks_layout(src.qtype(key), src.shape(key))]]) > 0
            )
            raw = src.raw(key, unpermute=not stored)
            if tuple(raw.shape) != (linear.out_features, linear.in_features):
                raise CheckpointError(f"{name}: GGUF weight {raw.shape} does not fit the model's linear")
            bias = src.get(f"{name}.bias") if f"{name}.bias" in src else None
            module: nn.Module | None = None
            in_place = False  # read by the GGUF-block kernel from the file's bytes: no copy to release them for
            if fast is not None and bias is None and key == _HEAD:
                made = fast_head(raw)
                if made is not None and made[1]:  # its decode copy beside the file's table, which stays
                    module = made[0]
                    fast["converted"] += 1
                    decode = "Q8_0 blocks" if getattr(module, "blocks", None) is not None else "bfloat16 prepacked"
                    fast["lm_head"] = {"table": raw.qtype.name, "decode": decode}
                    return module
                if made is not None:  # the table's own blocks on the GGUF-block kernel
                    module = made[0]
                    in_place = on_kernel(module, raw.qtype)
            elif fast is not None:
                # the engine's module: the blocks on the GGUF-block kernel, Q4_0/Q4_1/Q4_K on torch's int4 kernel, else
                # a bfloat16 copy prepacked for oneDNN for decode (2 bytes per weight, not float32's 4; prompts over
                # small_rows exact from the file's blocks), else the exact weight dequantized at load
                layer = GGUFLinear.from_raw(raw.data, raw.qtype, raw.shape, bias, qk_heads=raw.qk_heads)
                layer.compute_dtype = ctx.dtype
                module = plan.convert(name, layer)
                if name in plan.fallback:
                    fast["dequantized"][name] = plan.fallback[name]
                elif getattr(module, "source", None) is layer:
                    fast["bf16"][name] = raw.qtype.name
                elif hasattr(module, "interleaved"):
                    in_place = on_kernel(module, raw.qtype)
                else:
                    fast["converted"] += 1
            if module is None:
                module = GGUFLinear.from_raw(raw.data, raw.qtype, raw.shape, bias, mode=mode)
            if src.release_after_copy and not in_place:
                src.release(key)  # a copy exists (dense or int4); the GGUF bytes stay valid, file-backed
            return module

        return factory

    def inspect(self, probe: Probe, detection: Detection) -> list[ModuleInfo]:
        from anyquant.plugin import GGUF_TYPE_SIZES

        try:
            headers, split = gguf_model(probe).headers, True
        except AnyquantError:  # parts that do not fit, several models: the rows of the first file (detect says why)
            headers, split = probe.gguf[:1], False
        split = split and len(headers) > 1
        rows = []
        for header, t in ((h, t) for h in headers for t in h.tensors):
            name, block, block_bytes = GGUF_TYPE_SIZES.get(t.type_id, (t.type_name, 0, 0))
            numel = 1
            for d in t.shape:
                numel *= d
            nbytes = numel // block * block_bytes if block else 0
            fmt = "dense" if name in ("F32", "F16", "BF16") else "gguf"
            rows.append(
                ModuleInfo(
                    t.name,
                    fmt,
                    tuple(reversed(t.shape)),
                    8 * nbytes / numel if numel else None,
                    block if fmt == "gguf" else None,
                    nbytes,
                    extra={"type": name, "part": header.file} if split else {"type": name},
                )
            )
        return rows
