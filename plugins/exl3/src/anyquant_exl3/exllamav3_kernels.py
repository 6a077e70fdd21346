"""The ``exllamav3`` backend: EXL3 checkpoints run by exllamav3's own CUDA runtime.

**Prepared, not yet run on a GPU.** Every call into exllamav3 below was written from the exllamav3 1.6.5
sources (file references inline); the pure-Python glue (option and sampler mapping, result parsing, the
availability and tensor-parallel checks) is unit-tested on CPU, the rest only by ``bench/gpu_exl3.sh`` on a
CUDA machine.

What it wraps (the sequence of exllamav3's own examples):

``Config.from_directory`` -> ``Model.from_config`` -> ``Cache(model, max_num_tokens)`` (attached before the
load: ``cache/cache.py``) -> ``model.load(device=...)`` or ``model.load(tensor_p=True)`` (``model/model.py``
``load_gen``) -> ``Tokenizer.from_config`` -> ``Generator(model, cache, tokenizer)``
(``generator/generator.py``). Text generation runs as exllamav3 ``Job`` objects (``generator/job.py``) with
a sampler built from :class:`~anyquant.protocols.GenerationParams`; stop strings and end-of-sequence ids go
to exllamav3 as ``stop_conditions``, so stopping and streaming are exllamav3's own. Prompts are tokenised
by the checkpoint's transformers tokenizer, exactly as core's generator does it (same chat template, same
special tokens), and handed to the job as token ids.

``LoadedModel.module`` is an :class:`ExllamaModule`: ``module(input_ids)`` runs exllamav3's
``Model.forward`` without a cache (``attn_mode="flash_attn_nc"``, ``modules/attn.py``) and returns an
object whose ``.logits`` is fp32 ``[batch, seq, vocab]`` on the output GPU. It is for scoring (perplexity,
logit comparisons), not a torch ``nn.Module``; generation goes through the generator.

exllamav3 is imported only inside :func:`load_exllamav3`, after ``torch.cuda.is_available()``: importing it
JIT-compiles its CUDA extension (minutes the first time) and fails on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from anyquant.plugin import (
    AnyquantError,
    BackendInfo,
    GenerationParams,
    LoadOptions,
    MissingDependencyError,
    ModelClosedError,
    ParameterError,
    UnsupportedBackendError,
)
from anyquant_runtime.generate import TorchGenerator

from .options import EXLLAMAV3_OPTIONS

if TYPE_CHECKING:
    from anyquant.plugin import Detection, LoadedModel, Probe, Prompt

__all__ = [
    "BACKEND",
    "ExllamaGenerator",
    "ExllamaModule",
    "SamplerSpec",
    "backend_info",
    "cache_tokens",
    "check_tensor_parallel",
    "gpu_count",
    "load_exllamav3",
    "result_token_ids",
    "sampler_spec",
    "stop_conditions",
]

log = logging.getLogger(__name__)

BACKEND = "exllamav3"
#: exllamav3's cache page (``constants.PAGE_SIZE``): the cache holds a multiple of it.
PAGE_SIZE = 256
#: Default KV-cache size in tokens, shared by every job of a batch (``cache_tokens=`` to change).
DEFAULT_CACHE_TOKENS = 8192
#: ``LoadOptions.extra`` keys this backend reads (declared once, in ``EXLLAMAV3_OPTIONS``, which the loader's ``load_options`` include).
EXTRA_OPTIONS = tuple(EXLLAMAV3_OPTIONS)
INSTALL_HINT = "pip install exllamav3 (needs an Ampere or newer NVIDIA GPU and a CUDA toolkit for its JIT build)"


# ------------------------------------------------------------------------------------------------ availability


def _nvcc_available() -> bool:
    """nvcc where torch's JIT build would look for it (``torch.utils.cpp_extension``: CUDA_HOME, PATH, /usr/local/cuda)."""
    if shutil.which("nvcc"):
        return True
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and Path(home, "bin", "nvcc").is_file():
            return True
    return False


def _extension_available() -> bool:
    """exllamav3 runs its kernels from ``exllamav3_ext``: a prebuilt module, or one it JIT-builds at import
    (``exllamav3/ext.py``), which needs nvcc."""
    if "exllamav3" in sys.modules or importlib.util.find_spec("exllamav3_ext") is not None:
        return True
    return _nvcc_available()


def gpu_count() -> int:
    """Visible CUDA devices."""
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def backend_info() -> BackendInfo:
    """Whether the exllamav3 backend can run here. Cheap: never imports exllamav3 (that JIT-compiles)."""
    if importlib.util.find_spec("exllamav3") is None:
        return BackendInfo(BACKEND, False, f"exllamav3 is not installed ({INSTALL_HINT})")
    if not torch.cuda.is_available():
        return BackendInfo(
            BACKEND, False, "exllamav3 needs an Ampere+ NVIDIA GPU (CUDA, sm_80 or newer); none is visible"
        )
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if not torch.version.hip and caps and max(caps) < (8, 0):
        major, minor = max(caps)
        return BackendInfo(
            BACKEND,
            False,
            f"exllamav3's kernels need Ampere (sm_80) or newer; the best visible GPU is sm_{major}{minor}",
        )
    if not _extension_available():
        return BackendInfo(
            BACKEND,
            False,
            "exllamav3's CUDA extension is not prebuilt (exllamav3_ext) and nvcc was not found to JIT-build it "
            "(set CUDA_HOME or put nvcc on PATH)",
        )
    return BackendInfo(
        BACKEND,
        True,
        description="exllamav3's CUDA kernels and generator; its first import JIT-compiles the CUDA extension (minutes)",
    )


def backend_status() -> tuple[bool, str]:
    """The registered ``exllamav3`` backend's availability here (``anyquant backends``)."""
    info = backend_info()
    return info.available, info.reason


def check_tensor_parallel(options: LoadOptions) -> bool:
    """``tensor_parallel=True`` asked: exllamav3's tensor-parallel load on 2+ GPUs, else a typed error.

    Checked before anything heavy is imported, so a machine without the GPUs gets the error at once.
    """
    if not options.extra.get("tensor_parallel", False):
        return False
    if options.backend not in ("auto", BACKEND):
        raise UnsupportedBackendError(
            f"tensor_parallel=True uses exllamav3's tensor-parallel loader; backend {options.backend!r} has none. "
            f"Use backend='{BACKEND}' (or 'auto')."
        )
    n = gpu_count()
    if n < 2:
        seen = "no CUDA GPU is visible" if n == 0 else "only 1 CUDA GPU is visible"
        raise UnsupportedBackendError(
            f"tensor_parallel=True needs 2 or more CUDA GPUs; {seen} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Drop tensor_parallel to load on one GPU."
        )
    return True


# ------------------------------------------------------------------------------------------------ pure glue


@dataclass(frozen=True)
class SamplerSpec:
    """The exllamav3 sampler for a :class:`GenerationParams`: ``ArgmaxSampler`` or ``ComboSampler(...)``.

    exllamav3's ``ComboSampler`` (``generator/sampler/presets.py``) applies repetition penalty, temperature,
    top-k, top-p, then samples, the order of core's ``sample_next``; temperature 0 or top_k 1 is argmax there.
    """

    kind: str  # "argmax" or "combo"
    rep_p: float = 1.0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def kwargs(self) -> dict[str, Any]:
        """``ComboSampler`` keyword arguments (for ``kind == "combo"`` or a greedy run with a penalty)."""
        return {"rep_p": self.rep_p, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def sampler_spec(params: GenerationParams) -> SamplerSpec:
    """Map the sampling fields onto exllamav3's samplers (:class:`GenerationParams` checked their ranges). The fields
    this mapping does not carry (``min_p``, presence/frequency penalties, ``logit_bias``) are refused, never ignored."""
    unmapped = [
        name
        for name, off in (("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", {}))
        if getattr(params, name, off) != off
    ]
    if unmapped:
        raise ParameterError(
            f"{', '.join(unmapped)}: not supported by the exllamav3 CUDA backend's sampler; "
            "leave them at their defaults, or load with another backend (anyquant info lists them)"
        )
    rep_p = float(params.repetition_penalty)
    if params.temperature <= 0 or params.top_k == 1:
        return SamplerSpec("argmax", rep_p=rep_p)
    return SamplerSpec(
        "combo", rep_p=rep_p, temperature=float(params.temperature), top_k=int(params.top_k), top_p=float(params.top_p)
    )


def make_sampler(xl: Any, spec: SamplerSpec) -> Any:
    """The exllamav3 sampler object (``xl`` is the imported ``exllamav3`` package)."""
    if spec.kind == "argmax" and spec.rep_p == 1.0:
        return xl.ArgmaxSampler()
    # ComboSampler keeps SS_RepP ahead of SS_Argmax when temperature is 0 (presets.py)
    return xl.ComboSampler(**spec.kwargs())


def stop_conditions(eos_ids: Iterable[int], stops: Sequence[str]) -> list[int | str]:
    """exllamav3 ``stop_conditions``: end-of-sequence token ids, then the non-empty stop strings (de-duplicated)."""
    out: list[int | str] = [int(i) for i in sorted({int(i) for i in eos_ids})]
    seen: set[str] = set()
    for s in stops:
        if s and s not in seen:
            seen.add(s)
            out.append(s)
    return out


def cache_tokens(requested: Any) -> int:
    """KV-cache size in tokens, a positive multiple of exllamav3's 256-token page. The cache is one pool for
    every job of a batch (``Generator`` queues jobs that do not fit), so the default does not follow the
    model's context length."""
    if requested is None:
        return DEFAULT_CACHE_TOKENS
    try:
        value = int(requested)
    except (TypeError, ValueError) as exc:
        raise ParameterError(f"cache_tokens must be an integer, got {requested!r}") from exc
    if value <= 0:
        raise ParameterError(f"cache_tokens must be positive, got {value}")
    return -(-value // PAGE_SIZE) * PAGE_SIZE


def _flat_ids(value: Any) -> list[int]:
    if value is None:
        return []
    tolist = getattr(value, "tolist", None)
    items = tolist() if callable(tolist) else value
    out: list[int] = []
    stack = [items]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            out.append(int(item))
    return out


def result_token_ids(result: Mapping[str, Any]) -> list[int]:
    """New token ids of one exllamav3 ``Generator.iterate()`` result, in order.

    A streaming result carries ``token_ids`` once the job stops holding them (incomplete UTF-8, partial stop
    strings). A job that ends on a stop token emits no ``token_ids``; the tokens it still held, the stop token
    last, come under ``held`` (``generator/job.py``, ``emit``).
    """
    ids = _flat_ids(result.get("token_ids"))
    held = result.get("held")
    if result.get("eos") and isinstance(held, Mapping):
        ids += _flat_ids(held.get("token_ids"))
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------------------------------ module


@dataclass
class ExllamaOutput:
    logits: Any  # torch.Tensor, fp32 [batch, seq, vocab]


class ExllamaModule:
    """``LoadedModel.module`` of the exllamav3 backend: ``module(input_ids) -> .logits``.

    Runs exllamav3's ``Model.forward(input_ids, {})``: the whole sequence, no KV cache
    (``attn_mode="flash_attn_nc"``), causal attention, positions from 0. Logits are cut to the vocabulary
    (exllamav3 pads the head to a multiple of 128) and returned as fp32 on the output GPU. There is no padding
    mask: a batch is rows of equal length.
    """

    def __init__(self, model: Any, config: Mapping[str, Any], generation_config: Mapping[str, Any], device: str):
        self.model = model
        self.config = SimpleNamespace(**config)
        self.generation_config = SimpleNamespace(**generation_config)
        self.vocab_size = int(config.get("vocab_size") or 0) or None
        self.device = device

    def forward(self, input_ids: Any, attention_mask: Any = None, **kwargs: Any) -> ExllamaOutput:
        for key in ("past_key_values", "cache", "use_cache", "position_ids"):
            if kwargs.get(key):
                raise ParameterError(
                    f"the exllamav3 backend's module takes no {key!r}: it scores whole sequences without a cache; "
                    "generate through model.generate / stream / generate_batch"
                )
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ParameterError(f"input_ids must be [batch, seq], got shape {tuple(ids.shape)}")
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise ParameterError("the exllamav3 backend's module has no padding mask: pass rows of equal length")
        logits = self.model.forward(ids.to("cpu", torch.long).contiguous(), {"attn_mode": "flash_attn_nc"})
        if self.vocab_size is not None:
            logits = logits[..., : self.vocab_size]
        return ExllamaOutput(logits=logits.float())

    __call__ = forward

    def unload(self) -> None:
        """Free the GPU memory (exllamav3 ``Model.unload``)."""
        self.model.unload()

    def __repr__(self) -> str:
        return f"ExllamaModule(exllamav3 {type(self.model).__name__}, device={self.device!r})"


# ------------------------------------------------------------------------------------------------ generator


class ExllamaGenerator(TorchGenerator):
    """:class:`~anyquant.protocols.Generator` over exllamav3's dynamic ``Generator``.

    Core's ``TorchGenerator`` supplies prompt encoding (chat templates) and decoding; the decoding loop is
    exllamav3's: one ``Job`` per prompt, ``iterate()`` until every job ends. Text, stop strings and
    end-of-sequence handling are exllamav3's (``stop_conditions``). One call at a time per model: a second
    ``generate``/``stream`` while a stream is still open is refused (batch the prompts instead).
    """

    def __init__(self, module: Any, tokenizer: Any, xl: Any, xl_generator: Any, *, extra_eos: Iterable[int] = ()):
        super().__init__(module, tokenizer, device="cpu")
        self.eos_ids = set(self.eos_ids) | {int(i) for i in extra_eos}
        self.xl = xl
        self.xl_generator = xl_generator
        self._busy = False

    # ------------------------------------------------------------------ jobs
    def _job(
        self,
        ids: Sequence[int],
        params: GenerationParams,
        *,
        identifier: int,
        stops: bool,
        ends: Iterable[int] | None = None,
    ) -> Any:
        if not ids:
            raise ParameterError("empty prompt: nothing to condition on")
        spec = sampler_spec(params)
        seed = None if params.seed is None else int(params.seed) + identifier
        cond = stop_conditions(self.eos_ids if ends is None else set(ends), params.stop if stops else ())
        return self.xl.Job(
            input_ids=torch.tensor([list(ids)], dtype=torch.long),
            max_new_tokens=int(params.max_new_tokens),
            sampler=make_sampler(self.xl, spec),
            seed=seed,
            stop_conditions=cond or None,
            identifier=identifier,
        )

    def close(self) -> None:
        """As core's, and exllamav3's generator (its cache and job queue) is dropped too."""
        super().close()
        self.xl_generator = None

    def _results(self, jobs: list[Any]) -> Generator[dict[str, Any], None, None]:
        """Enqueue ``jobs`` and yield their streaming results; cancel what is left when closed early."""
        if self.closed:
            raise ModelClosedError("the model was closed; load the checkpoint again")
        if self._busy:
            raise AnyquantError(
                "this exllamav3 model is already generating (a stream not yet exhausted?); it serves one "
                "generate/stream/generate_batch call at a time: pass several prompts to generate_batch instead"
            )
        gen = self.xl_generator
        self._busy = True
        try:
            gen.enqueue(jobs)
            while gen.num_remaining_jobs():
                for r in gen.iterate():
                    if r.get("stage") == "error":
                        err = r.get("error")
                        raise AnyquantError(f"exllamav3 generation failed: {err!r}") from (
                            err if isinstance(err, BaseException) else None
                        )
                    if r.get("stage") == "streaming":
                        yield r
                        if self.closed:  # closed while the stream was paused: the model is unloaded
                            raise ModelClosedError("the model was closed while generating; load the checkpoint again")
        finally:
            if not self.closed:
                for job in jobs:
                    gen.cancel(job)  # no-op for finished jobs (generator.py, cancel)
            self._busy = False

    # ------------------------------------------------------------------ protocol
    def stream(self, prompt: Prompt, params: GenerationParams) -> Iterator[str]:
        ids = self.encode(prompt, params)
        if params.max_new_tokens <= 0:
            return
        results = self._results([self._job(ids, params, identifier=0, stops=True)])
        try:
            for r in results:
                text = r.get("text")
                if text:
                    yield str(text)
                if r.get("eos"):
                    return
        finally:
            results.close()

    # generate() is TorchGenerator's: the joined stream

    def generate_batch(self, prompts: Sequence[Prompt], params: GenerationParams) -> list[str]:
        if not prompts:
            return []
        encoded = [self.encode(p, params) for p in prompts]
        texts = [""] * len(prompts)
        if params.max_new_tokens <= 0:
            return texts
        jobs = [self._job(ids, params, identifier=i, stops=True) for i, ids in enumerate(encoded)]
        left = len(jobs)
        results = self._results(jobs)
        try:
            for r in results:
                texts[int(r["identifier"])] += str(r.get("text") or "")
                if r.get("eos"):
                    left -= 1
                    if not left:
                        break
        finally:
            results.close()
        return texts

    def token_steps(
        self, batch: Sequence[Sequence[int]], params: GenerationParams, ends: Iterable[int] | None = None
    ) -> Iterator[list[int | None]]:
        """Token ids as exllamav3 releases them: each step holds one new token for some rows and ``None`` for
        the others (core's ``generate_ids`` and evaluate's decode timing read this). A row ends at one of
        ``ends`` (default: the end-of-sequence ids), which is included, as core's generator does."""
        if params.max_new_tokens <= 0:
            return
        jobs = [self._job(ids, params, identifier=i, stops=False, ends=ends) for i, ids in enumerate(batch)]
        pending: list[deque[int]] = [deque() for _ in batch]
        results = self._results(jobs)
        try:
            for r in results:
                pending[int(r["identifier"])].extend(result_token_ids(r))
                while any(pending):
                    yield [q.popleft() if q else None for q in pending]
        finally:
            results.close()


# ------------------------------------------------------------------------------------------------ load


def import_exllamav3() -> Any:
    """``import exllamav3`` (JIT-builds its CUDA extension the first time), as a typed error when it fails."""
    if not torch.cuda.is_available():
        raise UnsupportedBackendError(f"backend {BACKEND!r} needs a CUDA GPU; none is visible")
    try:
        import exllamav3
    except ImportError as exc:
        raise MissingDependencyError(f"importing exllamav3 failed: {exc}. {INSTALL_HINT}") from exc
    except Exception as exc:  # the JIT build raises RuntimeError / subprocess errors
        raise UnsupportedBackendError(
            f"importing exllamav3 failed while loading its CUDA extension: {type(exc).__name__}: {exc}"
        ) from exc
    return exllamav3


def _cuda_device(device: str) -> str:
    if device in ("auto", "cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    dev = torch.device(device)
    if dev.type != "cuda":
        raise UnsupportedBackendError(f"backend {BACKEND!r} runs on CUDA GPUs only; device={device!r} was asked")
    index = 0 if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise UnsupportedBackendError(f"device={device!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return f"cuda:{index}"


def load_exllamav3(
    probe: Probe, detection: Detection, options: LoadOptions, *, tensor_parallel: bool = False
) -> LoadedModel:
    """Load ``probe``'s EXL3 checkpoint with exllamav3 and wrap it as a :class:`LoadedModel`.

    ``options.extra``: ``tensor_parallel`` (checked by the caller), ``tp_backend`` (exllamav3's, default its own
    ``"native"``), ``autosplit`` (layer split over every visible GPU), ``cache_tokens`` (KV cache size shared by
    all jobs, default 8192; exllamav3 caps ``max_new_tokens`` to what fits), ``max_batch_size`` (default 16),
    ``max_chunk_size`` (prefill chunk, default 2048).
    """
    from anyquant.plugin import LoadedModel
    from anyquant_runtime.tokenizer import load_tokenizer

    extra = dict(options.extra)
    if options.dtype not in (None, "auto", "float16", "fp16", "half"):
        log.warning("backend %r computes in fp16 (fp32 accumulation) whatever dtype=%r says", BACKEND, options.dtype)
    device = "multi-gpu" if tensor_parallel or extra.get("autosplit") else _cuda_device(options.device)
    xl = import_exllamav3()

    config = xl.Config.from_directory(str(probe.root))
    model = xl.Model.from_config(config)
    tokens = cache_tokens(extra.get("cache_tokens"))
    cache = xl.Cache(model, max_num_tokens=tokens)  # attach before load: load allocates the cache tensors
    max_chunk = int(extra.get("max_chunk_size", 2048))
    if tensor_parallel:
        tp_kw = {"tp_backend": str(extra["tp_backend"])} if "tp_backend" in extra else {}
        model.load(tensor_p=True, max_chunk_size=max_chunk, progressbar=False, **tp_kw)
    elif extra.get("autosplit"):
        model.load(max_chunk_size=max_chunk, progressbar=False)
    else:
        model.load(device=torch.device(device), progressbar=False)
    output_device = getattr(model, "output_device", None)
    if output_device is not None:
        device = str(torch.device(output_device if not isinstance(output_device, int) else f"cuda:{output_device}"))

    xl_tokenizer = xl.Tokenizer.from_config(config)
    xl_generator = xl.Generator(
        model=model,
        cache=cache,
        tokenizer=xl_tokenizer,
        max_batch_size=int(extra.get("max_batch_size", 16)),
        max_chunk_size=max_chunk,
    )
    cfg = _read_json(Path(probe.root) / "config.json")
    gen_cfg = _read_json(Path(probe.root) / "generation_config.json")
    module = ExllamaModule(model, cfg, gen_cfg, device)
    tokenizer = load_tokenizer(probe, trust_remote_code=options.trust_remote_code)
    extra_eos = [int(i) for i in getattr(config, "eos_token_id_list", []) or [] if i is not None]
    generator = ExllamaGenerator(module, tokenizer, xl, xl_generator, extra_eos=extra_eos)
    version = getattr(xl, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("exllamav3")
        except Exception:  # pragma: no cover
            version = "unknown"
    return LoadedModel(
        module=module,
        tokenizer=tokenizer,
        format=detection.format,
        backend=BACKEND,
        detection=detection,
        generator=generator,
        device=device,
        dtype="float16",
        info={
            "exllamav3_version": str(version),
            "tensor_parallel": bool(tensor_parallel),
            "cache_tokens": tokens,
            "ignored_options": sorted(k for k in extra if k not in EXTRA_OPTIONS),
        },
    )
