"""Build a transformers model from ``config.json`` on the meta device, swap in quantized linears,
and fill every remaining tensor from a :class:`~anyquant_runtime.tensors.TensorSource`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from anyquant.errors import CheckpointError, ConfigError, MissingTensorError, ParameterError

from .finite import check_finite
from .tensors import LAYER_PREFIX, FileRows, TensorSource, fill_file_tables

__all__ = [
    "RUNTIMES",
    "LinearFactory",
    "ModuleFactory",
    "build_model",
    "check_config",
    "choose_runtime",
    "fill_file_tables",
    "meta_parameters",
    "resolve_device",
    "resolve_dtype",
    "skeleton",
]

log = logging.getLogger(__name__)

#: ``factory(name, meta_linear) -> module or None``; None keeps a dense ``nn.Linear``.
LinearFactory = Callable[[str, nn.Linear], nn.Module | None]
#: ``(name, module) -> replacement | None`` for any other module of the skeleton (still on the meta device), asked
#: before its parameters are read: a format's own form of a fused experts module (gpt-oss's MXFP4 experts kept packed)
ModuleFactory = Callable[[str, nn.Module], nn.Module | None]

_DROP_KEYS = ("quantization_config", "compression_config", "auto_map")


def resolve_device(device: str) -> torch.device:
    """``"auto"``: the first CUDA GPU when torch sees one, else the CPU. A device torch cannot parse, or a
    CUDA device where torch sees none, is a :class:`~anyquant.errors.ParameterError`."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ParameterError(f"device={device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError(
            f"device={device!r}, but torch {torch.__version__} sees no CUDA GPU; use device='cpu' or 'auto'"
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/"auto": float32 on CPU (bf16/fp16 matmul is 5-50x slower there), float16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float16 if device.type == "cuda" else torch.float32
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype not in names:
        raise ParameterError(f"dtype {dtype!r} is not one of {sorted(names)}")
    return names[dtype]


#: meta_parameters' bookkeeping: the threads inside it, and how many builds hold the patch
_META = threading.local()
_META_LOCK = threading.Lock()
#: transformers' from_config sets torch's process-wide default dtype for the duration
_DEFAULT_DTYPE_LOCK = threading.Lock()
_meta_users = 0
_meta_original: Any = None


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """``nn.Module.register_parameter`` while :func:`meta_parameters` is patched in: the original, then, in a
    thread inside the context only, the parameter moved to the meta device."""
    _meta_original(module, name, param)
    if param is not None and _META.__dict__.get("depth", 0):
        p = module._parameters[name]
        assert p is not None
        module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Create parameters on the meta device (no memory); buffers stay real (rotary tables).

    transformers' classes create their parameters in ``__init__`` with no device argument, so this patches
    ``nn.Module.register_parameter`` for the duration. The patch acts only in the threads inside this
    context (a thread-local flag): another thread building modules meanwhile gets the original behaviour,
    and concurrent loads share one patch (counted under a lock), so none can leave it installed."""
    global _meta_users, _meta_original
    with _META_LOCK:
        if _meta_users == 0:
            _meta_original = nn.Module.register_parameter
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign, assignment]
        _meta_users += 1
    _META.depth = getattr(_META, "depth", 0) + 1
    try:
        yield
    finally:
        _META.depth -= 1
        with _META_LOCK:
            _meta_users -= 1
            if _meta_users == 0:
                # _meta_original stays set: a thread that fetched the patched method just before this line
                # still calls the original through it
                nn.Module.register_parameter = _meta_original  # type: ignore[method-assign]


RUNTIMES = ("transformers", "native", "auto")


def choose_runtime(config: Mapping[str, Any], runtime: str) -> str:
    """``"transformers"`` or ``"native"`` (:mod:`anyquant_runtime.native`) for ``config``: ``"auto"`` picks native
    where it supports the architecture; ``"native"`` where it does not is a :class:`CheckpointError`."""
    if runtime not in RUNTIMES:
        raise ParameterError(f"runtime {runtime!r} is not one of {RUNTIMES}")
    if runtime == "transformers":
        return runtime
    from .native import native_runtime_reason

    reason = native_runtime_reason(config)
    if reason is None:
        return "native"
    if runtime == "native":
        raise CheckpointError(f"runtime='native' cannot build this model: {reason}; use runtime='transformers'")
    return "transformers"


#: config values that size a decoder: positive integers where present (``None`` = the architecture's default)
_SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
#: what the native decoder cannot do without
_NATIVE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: above zero where present (a log or a division by them in the rotary tables)
_POSITIVE_KEYS = (
    "rope_theta",
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "original_max_position_embeddings",
)
#: non-negative finite numbers where present (also inside ``rope_parameters`` / ``rope_scaling``: YaRN's too)
_NUMBER_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "mscale", "mscale_all_dim", *_POSITIVE_KEYS)
#: the rotary table is a real tensor of head_dim / 2 values, even on the meta device
_MAX_HEAD_DIM = 1 << 16


def check_config(config: Mapping[str, Any], *, tensors: int | None = None, native: bool = False) -> None:
    """:class:`~anyquant.errors.ConfigError` unless the values that size the model are positive integers,
    its epsilons non-negative and its rotary base and factor positive finite numbers, and ``num_hidden_layers`` at most the
    checkpoint's ``tensors`` (every layer has some): checked before anything is built, so a hostile
    ``config.json`` (``num_hidden_layers: 1e9``, ``hidden_size: "abc"``) gives a clear error at once
    instead of a build that runs for ever or a ``ValueError`` from deep inside. ``native``: the native
    decoder's keys must be present too (transformers' classes have defaults for them)."""
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is None:
            if native and key in _NATIVE_KEYS:
                raise ConfigError(f"config.json has no {key}")
            continue
        if type(value) is not int or not 1 <= value < 2**31:
            raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    head_dim = config.get("head_dim")
    if isinstance(head_dim, int) and head_dim > _MAX_HEAD_DIM:
        raise ConfigError(f"config.json: head_dim {head_dim} is larger than any model's ({_MAX_HEAD_DIM})")
    scopes = [config, *(config.get(k) for k in ("rope_parameters", "rope_scaling"))]
    for rope in scopes[1:]:  # per layer type (Gemma3: {"full_attention": {...}, "sliding_attention": {...}})
        if isinstance(rope, Mapping):
            scopes += [v for v in rope.values() if isinstance(v, Mapping)]
    for scope in scopes:
        if not isinstance(scope, Mapping):
            continue
        for key in _NUMBER_KEYS:
            found = scope.get(key)
            # a value per layer type: transformers 5 writes Gemma3's rope_theta as {"global": ..., "local": ...}
            for value in found.values() if isinstance(found, Mapping) else [found]:
                if value is None:
                    continue
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or value < 0
                ):
                    raise ConfigError(f"config.json: {key} must be a non-negative number, got {found!r}")
                if value == 0 and key in _POSITIVE_KEYS:  # a rotary base or scale of 0: every angle 0 or inf
                    raise ConfigError(f"config.json: {key} must be positive, got {found!r}")
    layers = config.get("num_hidden_layers")
    if tensors is not None and isinstance(layers, int) and layers > tensors:
        raise ConfigError(f"config.json: num_hidden_layers={layers}, but the checkpoint holds only {tensors} tensor(s)")


def skeleton(
    config: Mapping[str, Any],
    *,
    trust_remote_code: bool = False,
    runtime: str = "transformers",
    tensors: int | None = None,
) -> nn.Module:
    """The causal-LM module for ``config`` (transformers' class, or anyquant's native decoder when ``runtime``
    says so: :func:`choose_runtime`), with parameters on the meta device; ``config`` is checked first
    (:func:`check_config`, with the checkpoint's ``tensors`` count when given)."""
    native = choose_runtime(config, runtime) == "native"
    check_config(config, tensors=tensors, native=native)
    if native:
        from .native import NativeCausalLM

        cfg = {k: v for k, v in config.items() if k not in _DROP_KEYS}
        with torch.device("meta"):  # a thread-local mode: nothing global is patched
            return NativeCausalLM(cfg)
    import transformers

    cfg = {k: v for k, v in config.items() if k not in _DROP_KEYS}
    model_type = cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise CheckpointError("config.json has no model_type; cannot build the model")
    if config.get("auto_map") and not trust_remote_code:
        log.info("config.json has auto_map (remote code); ignored, using transformers' own %s", model_type)
    if model_type not in transformers.CONFIG_MAPPING:
        raise CheckpointError(
            f"transformers {transformers.__version__} does not know model_type {model_type!r}. "
            "Upgrade transformers; remote code is never run unless trust_remote_code=True."
        )
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
        # transformers builds under torch.set_default_dtype(dtype), process-wide, and restores what it found:
        # two builds at once could leave float32 behind as the host's default. One build at a time, and the
        # default it found is put back whatever happens.
        with _DEFAULT_DTYPE_LOCK, meta_parameters():
            before = torch.get_default_dtype()
            try:
                built: nn.Module = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    hf_config, dtype=torch.float32
                )
                return built
            finally:
                if torch.get_default_dtype() is not before:
                    torch.set_default_dtype(before)
    except MemoryError:
        raise
    except Exception as exc:  # transformers' own checks: ValueError, huggingface_hub's StrictDataclassError, ...
        raise ConfigError(
            f"config.json is not a {model_type!r} config that transformers {transformers.__version__} can build: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def _tied_head(model: Any) -> tuple[str, str] | None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is None or inp is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return names.get(id(out), "lm_head") + ".weight", names.get(id(inp), "") + ".weight"


#: decoder layers read and repacked between two hand-backs of the heap's free pages during a load
TRIM_LAYERS = 4


def build_model(
    config: Mapping[str, Any],
    source: TensorSource,
    *,
    make_linear: LinearFactory | None = None,
    make_module: ModuleFactory | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    name_map: Callable[[str], str] | None = None,
    runtime: str = "transformers",
    keep_embedding_dtype: bool = False,
    file_tables: dict[str, FileRows] | None = None,
    tie_absent_head: bool = False,
) -> nn.Module:
    """Assemble a model: skeleton -> quantized linears -> tensors -> tie -> dtype/device.

    ``make_linear(name, linear)`` returns the replacement for each ``nn.Linear`` (already holding
    its tensors), or ``None`` to keep it dense. ``make_module(name, module)`` may replace any other module before
    its parameters are read (``None``: keep it; asked before core's own per-expert split). The output head is tied to the input embeddings
    only when the source has no head tensor of its own (a stale ``tie_word_embeddings: true`` beside a head
    is ignored; ``false`` with no head is a :class:`MissingTensorError`, unless ``tie_absent_head``: formats
    whose own loader ties whenever the head tensor is absent, whatever the flag says, as exllamav3's does).
    ``name_map`` maps a model parameter name to the source's tensor name. ``runtime``: see :func:`choose_runtime`.
    ``keep_embedding_dtype``: the input embedding (and a head tied to it) keeps the checkpoint's 16-bit float
    dtype instead of the compute dtype, for a caller that replaces it next (cpu-fast's compact embedding and
    head): the compute-dtype copy, twice the table's size, then never exists.
    ``file_tables``: a dict the build fills with the input embedding and a dense head that the source can
    serve from its file (:meth:`SafetensorsSource.file_rows`), by parameter name; those parameters are
    left on the meta device, unread, for the caller to install (cpu-fast's head and embedding read them
    from the file) or to fill with :func:`fill_file_tables`.
    """
    tensors = sum(1 for _ in source.keys())
    model: Any = skeleton(config, trust_remote_code=trust_remote_code, runtime=runtime, tensors=tensors)
    device = torch.device(device)
    stored = _StoredNames(source, config.get("model_type"), native=getattr(model, "runtime_name", "") == "native")
    src = name_map or stored.resolve
    # state the skeleton made real (DeepSeek's router bias `e_score_correction_bias`): the checkpoint's values
    # replace it; rotary tables are not persistent and never read
    kept = [n for n, b in model.named_buffers() if not b.is_meta and _persistent(model, n)]
    layers = _Layers(make_linear, source, src, stored, config, dtype, device)
    from anyquant._memory import release_free_heap

    block, blocks = None, 0
    for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        # every few decoder layers read and repacked, the heap's freed pages (their reads, unpacking temporaries)
        # handed back to the system, not left to pile up under the load's peak (a 1.1B W4A16 load peaked at 1,474
        # MiB for 800 kept; after every layer the page faults cost a tenth of the load)
        numbered = LAYER_PREFIX.match(name)
        if numbered is not None and numbered.group(0) != block:
            blocks += 1
            if blocks % TRIM_LAYERS == 0:
                release_free_heap()
            block = numbered.group(0)
        replacement = layers.linear(name, lin)
        if replacement is not None:
            bias = getattr(replacement, "bias", None)
            if isinstance(bias, torch.Tensor) and tuple(bias.shape) != (lin.out_features,):
                raise CheckpointError(
                    f"{name}: a bias of shape {tuple(bias.shape)} for a layer of {lin.out_features} outputs"
                )
            _set_module(model, name, replacement.to(device))
    replaced: list[str] = []
    for name, module in list(model.named_modules()):
        if any(name.startswith(r + ".") for r in replaced) or isinstance(module, nn.Linear) or not name:
            continue
        made = make_module(name, module) if make_module is not None else None
        experts = made if made is not None else layers.experts(name, module)
        if experts is not None:
            _set_module(model, name, experts.to(device))
            replaced.append(name)
    tie = _tied_head(model)
    head = model.get_output_embeddings() if tie is not None else None
    # the registered parameter, not getattr: a replacement head's ``weight`` may be a property that decodes
    # the whole table (cpu-fast's FastHead over a file-backed one)
    head_weight = head._parameters.get("weight") if isinstance(head, nn.Module) else None
    head_missing = (
        tie is not None
        and isinstance(head_weight, torch.Tensor)
        and head_weight.is_meta  # not replaced by a quantized module
        and src(tie[0]) not in source
    )
    if head_missing and config.get("tie_word_embeddings") is False and not tie_absent_head:
        raise MissingTensorError(
            f"config.json has tie_word_embeddings: false, but the checkpoint has no {tie[0]!r} ({src(tie[0])!r}) "  # type: ignore[index]
            "tensor: the output head is missing (tying it to the input embedding would give other logits)"
        )
    if head_missing:
        log.info("no %s tensor in the checkpoint: tying it to %s", tie[0] if tie else "", tie[1] if tie else "")
    embedding = _embedding_weight_name(model) if keep_embedding_dtype or file_tables is not None else None
    if file_tables is not None and device.type == "cpu":
        rows_of = getattr(source, "file_rows", None)
        wanted = [embedding]
        if tie is not None and not head_missing and isinstance(head_weight, torch.Tensor) and head_weight.is_meta:
            wanted.append(tie[0])  # a dense head of its own
        for name in wanted:
            if rows_of is not None and name is not None and src(name) in source:
                table = rows_of(src(name))
                if table is not None:
                    _check_value(name, model.get_parameter(name), table.shape, table.dtype)
                    _check_table(src(name), table)
                    file_tables[name] = table
    skip = file_tables or {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if not param.is_meta or name in skip:
            continue
        if head_missing and tie is not None and name == tie[0]:
            continue
        if src(name) not in source:
            _missing(name, src(name), source)
        value = source.get(src(name))
        keep = (
            keep_embedding_dtype
            and name == embedding
            and value.dtype in (torch.float16, torch.bfloat16)
            and value.dtype != dtype
        )
        _fill(model, name, value, value.dtype if keep else dtype, device, is_param=True)
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            key = src(name)
            if key not in source:
                raise MissingTensorError(f"buffer {name!r} ({key!r}) is not in the checkpoint")
            _fill(model, name, source.get(key), dtype, device, is_param=False)
    for name in kept:
        if src(name) in source:
            _fill(model, name, source.get(src(name)), dtype, device, is_param=False)
    if head_missing and tie is not None:
        head = model.get_output_embeddings()
        head.weight = model.get_input_embeddings().weight
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = bool(head_missing)
    if not skip:  # parameters left in the file stay on meta (a move would fail); the rest is on the CPU already
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    assembled: nn.Module = model
    return assembled


def _check_table(name: str, table: FileRows, rows: int = 4096) -> None:
    """A table left in the file (cpu-fast's embedding and head) checked for NaN/inf as a filled tensor is, read a
    slice of ``rows`` at a time (the memory of one slice, not of the table)."""
    for start in range(0, len(table), rows):
        check_finite(name, table.slice(start, min(rows, len(table) - start)))


class _StoredNames:
    """The checkpoint's module names, and the names a model tensor may have there: its own, or transformers'
    renaming for the architecture run backwards (Mixtral's ``mlp`` is ``block_sparse_moe`` on disk)."""

    def __init__(self, source: TensorSource, model_type: Any, *, native: bool) -> None:
        from .experts import checkpoint_names

        self.source = source
        # the native decoder's families have no renamings but Mixtral's (``block_sparse_moe`` on disk), and asking
        # for them would import transformers' conversion tables (0.7 s) that a native build otherwise never loads
        known = model_type if isinstance(model_type, str) and (not native or model_type == "mixtral") else None
        self.renames = checkpoint_names(known)
        self._modules: set[str] | None = None

    def has_module(self, name: str) -> bool:
        if self._modules is None:
            self._modules = {k.rpartition(".")[0] for k in self.source.keys()}
        return name in self._modules

    def resolve(self, name: str) -> str:
        if name in self.source:
            return name
        return next((n for n in self.renames(name) if n in self.source), name)


class _Layers:
    """The model's linears and MoE experts as the checkpoint stores them: the format's factory's module where it
    has one, else the dense tensors; a fused projection stored split becomes a
    :class:`~anyquant_runtime.parts.LinearParts`, transformers' fused 3-D experts stored one linear per expert an
    :class:`~anyquant_runtime.experts.Experts`."""

    def __init__(
        self,
        factory: LinearFactory | None,
        source: TensorSource,
        src: Callable[[str], str],
        stored: _StoredNames,
        config: Mapping[str, Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.factory, self.source, self.src, self.stored = factory, source, src, stored
        self.config, self.dtype, self.device = config, dtype, device

    def _made(self, name: str, linear: nn.Linear) -> nn.Module | None:
        if self.factory is None:
            return None
        try:
            return self.factory(name, linear)
        except CheckpointError as exc:
            if name in str(exc):
                raise
            raise type(exc)(f"{name}: {exc}") from exc

    def linear(self, name: str, linear: nn.Linear) -> nn.Module | None:
        """The replacement of the model's ``linear`` (``None``: keep it, filled from ``<name>.weight``)."""
        made = self._made(name, linear)
        if made is not None or self.src(f"{name}.weight") in self.source:
            return made
        from .parts import split_parts

        plan = split_parts(name, linear, self.stored.has_module, self.config)
        if plan is None:
            return None
        return plan.build(lambda part, i, o: self.one(part, i, o, bias=linear.bias is not None), linear)

    def one(self, name: str, in_features: int, out_features: int, *, bias: bool) -> nn.Module:
        """The checkpoint's linear ``name``: the factory's module, or a dense ``nn.Linear`` of its tensors."""
        with torch.device("meta"):
            meta = nn.Linear(in_features, out_features, bias=bias)
        made = self._made(name, meta)
        if made is not None:
            return made
        for attr in ("weight", "bias") if bias else ("weight",):
            key = self.src(f"{name}.{attr}")
            if key not in self.source:
                _missing(f"{name}.{attr}", key, self.source)
            _fill(meta, attr, self.source.get(key), self.dtype, self.device, is_param=True)
        return meta

    def experts(self, name: str, module: nn.Module) -> nn.Module | None:
        """An :class:`~anyquant_runtime.experts.Experts` for transformers' fused experts module stored one linear
        per expert (``None``: not such a module, or the checkpoint holds the fused tensors)."""
        from .experts import Expert, Experts, fused_experts, stored_experts

        sizes = fused_experts(module)
        if sizes is None:
            return None
        count, hidden, inner = sizes
        where = stored_experts(name, count, self.stored.has_module, self.stored.renames)
        if where is None:
            return None
        prefix, (gate, up, down) = where
        return Experts(
            Expert(
                self.one(f"{prefix}.{e}.{gate}", hidden, inner, bias=False),
                self.one(f"{prefix}.{e}.{up}", hidden, inner, bias=False),
                self.one(f"{prefix}.{e}.{down}", inner, hidden, bias=False),
                module.act_fn,
            )
            for e in range(count)
        )


def _persistent(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr not in (model.get_submodule(owner) if owner else model)._non_persistent_buffers_set


def _embedding_weight_name(model: nn.Module) -> str | None:
    accessor = getattr(model, "get_input_embeddings", None)  # transformers' and the native decoder's
    emb = accessor() if callable(accessor) else None
    for name, module in model.named_modules():
        if module is emb and isinstance(module, nn.Embedding):
            return f"{name}.weight"
    return None


def _missing(name: str, key: str, source: TensorSource) -> None:
    """Raise the :class:`MissingTensorError` for parameter ``name`` (``key`` in the source), naming what the
    module does have when it has something: a quantized layer missing one of its tensors is left to a dense
    ``.weight`` by its plugin, and "no .weight" alone would name a tensor that never existed."""
    module = key.rpartition(".")[0] + "."
    present = sorted(
        k.removeprefix(module) for k in source.keys() if k.startswith(module) and "." not in k[len(module) :]
    )
    if present:
        raise MissingTensorError(
            f"{key!r} is not in the checkpoint, and its module has only {', '.join(present)}: a quantized layer "
            "missing some of its tensors (its format needs them all) or a dense layer without its weight"
        )
    raise MissingTensorError(f"tensor {key!r} (parameter {name!r}) is not in the checkpoint")


def _check_value(name: str, current: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> None:
    """A checkpoint tensor of ``shape``/``dtype`` may fill the model's ``current`` parameter or buffer."""
    if tuple(current.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(shape)} in the checkpoint, the model expects "
            f"{tuple(current.shape)} (config.json and the weights disagree)"
        )
    if current.is_floating_point() and not dtype.is_floating_point:
        raise CheckpointError(
            f"tensor {name!r} is {str(dtype).removeprefix('torch.')} in the checkpoint; the model expects floating "
            "point values there (a converted value would be wrong)"
        )


def _fill(
    model: nn.Module,
    name: str,
    value: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    *,
    is_param: bool,
) -> None:
    """Put the checkpoint's ``value`` at ``name`` in ``model``. Every floating tensor (norms, biases, the
    embedding, dense linear weights) is checked for NaN/inf (:func:`~.finite.check_finite`, a
    :class:`~anyquant.errors.NumericalError` naming it): a NaN weight otherwise loads and makes the logits NaN
    (or, for a few values of a linear, only those of a long prompt). The check is one ``sum`` over the values
    as converted (the exact count only on failure): SECURITY.md gives its measured load cost."""
    mod_name, _, attr = name.rpartition(".")
    module = model.get_submodule(mod_name) if mod_name else model
    _check_value(name, getattr(module, attr), value.shape, value.dtype)
    if value.is_floating_point():
        stored = value
        value = value.to(device=device, dtype=dtype)
        check_finite(name, value, source=stored)  # a NaN norm, embedding row or weight would make logits NaN
    else:
        value = value.to(device=device)
    if is_param:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value
