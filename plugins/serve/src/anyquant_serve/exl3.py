"""``anyquant serve PATH --engine exllamav3``: EXL3 through exllamav3's own batching generator (CUDA), behind the
same OpenAI API as the built-in server: :class:`Exl3Scheduler` takes the built-in
:class:`~anyquant_serve.scheduler.Scheduler`'s place (``submit``, ``close``, ``adapter``, ``running``,
``waiting``). Tensor parallel over the visible GPUs when there are several (exllamav3's ``tensor_p``)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anyquant.plugin import MissingDependencyError

from .scheduler import Finished, QueueFull, Request

__all__ = ["Exl3Adapter", "Exl3Scheduler", "exl3_settings", "exllamav3_available", "gpu_split"]

log = logging.getLogger(__name__)


def exl3_settings(path: str | Path, *, max_batch: int, context: int | None, devices: Sequence[int]) -> dict[str, Any]:
    """What :class:`Exl3Scheduler` asks of exllamav3: cache tokens, batch size, load keywords."""
    from anyquant.plugin import Probe

    probe = Probe.open(path)
    found = (probe.config or {}).get("max_position_embeddings")
    length = context or (found if isinstance(found, int) and found > 0 else 8192)
    tokens = -(-length * max_batch // 256) * 256  # exllamav3 pages the cache in blocks of 256
    return {"max_num_tokens": tokens, "max_batch_size": max_batch, "context": length, "load": gpu_split(devices)}


class Exl3Adapter:
    """Prompts to token ids with the checkpoint's own tokenizer (transformers', for its chat template)."""

    def __init__(self, path: Path, context: int, tokenizer: Any) -> None:
        self.context: int | None = context
        self.tokenizer = tokenizer
        self.eos_ids: frozenset[int] = frozenset()

    def encode(self, prompt: str | Sequence[Mapping[str, Any]], chat: bool) -> list[int]:
        if chat:
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def vocab_size(self) -> int:
        return len(self.tokenizer)


class Exl3Scheduler:
    """exllamav3's ``Generator`` driven from one thread: jobs in, text pieces out."""

    #: exllamav3's sampler takes temperature, top_k, top_p, the repetition penalty and a seed only; the HTTP side
    #: refuses logprobs, logit_bias, presence/frequency penalties and min_p for this engine
    full_sampling = False
    #: exllamav3's jobs generate at least one token: ``echo`` with ``max_tokens: 0`` (the prompt alone) is refused
    prompt_only = False

    def __init__(
        self, path: str | Path, *, max_batch: int = 16, max_queue: int = 64, context: int | None = None
    ) -> None:
        why = exllamav3_available()
        if why is not None:
            raise MissingDependencyError(f"--engine exllamav3: {why}")
        import importlib

        import torch
        from transformers import AutoTokenizer

        exl: Any = importlib.import_module("exllamav3")  # its names are not re-exported for type checkers
        self.exl = exl
        Cache, Config, Generator, Model = exl.Cache, exl.Config, exl.Generator, exl.Model

        devices = list(range(torch.cuda.device_count()))
        settings = exl3_settings(path, max_batch=max_batch, context=context, devices=devices)
        config = Config.from_directory(str(path))
        self.model = Model.from_config(config)
        self.cache = Cache(self.model, max_num_tokens=settings["max_num_tokens"])
        self.model.load(**settings["load"])
        self.exl_tokenizer = exl.Tokenizer.from_config(config)
        self.generator = Generator(self.model, self.cache, self.exl_tokenizer, max_batch_size=max_batch)
        hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        self.adapter = Exl3Adapter(Path(path), settings["context"], hf)
        self.max_queue = max_queue
        self.running = 0
        self._waiting: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="anyquant-serve-exl3", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def capacity(self) -> int:
        """The most requests taken at once (its queue; the generator takes them from there)."""
        return self.max_queue

    def submit(self, request: Request) -> None:
        with self._cond:
            if self._stopping or len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue})")
            self._waiting.append(request)
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        self.model.unload()

    def _job(self, request: Request) -> Any:
        import torch

        p = request.params
        sampler = self.exl.ComboSampler(
            rep_p=p.repetition_penalty, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p
        )
        stops: list[Any] = [*p.stop, *sorted(_eos_ids(self.exl_tokenizer))]
        return self.exl.Job(
            input_ids=torch.tensor([request.ids], dtype=torch.long),
            max_new_tokens=request.max_tokens,
            sampler=sampler,
            seed=p.seed,
            stop_conditions=stops,
            identifier=request,
        )

    def _loop(self) -> None:
        jobs: dict[int, tuple[Request, Any, int]] = {}
        while True:
            with self._cond:
                while not self._waiting and not jobs and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._waiting and not jobs:
                    return
                new = list(self._waiting)
                self._waiting.clear()
            for request in new:
                try:
                    job = self._job(request)
                    self.generator.enqueue(job)
                except Exception as exc:  # this request's failure (exllamav3 asserts on what it refuses)
                    log.exception("exllamav3 refused a job")
                    request.finish(Finished("error", len(request.ids), 0, exc))
                    continue
                jobs[id(request)] = (request, job, 0)
            now = time.monotonic()
            for key, (request, job, count) in list(jobs.items()):
                late = request.deadline is not None and now > request.deadline
                if request.cancelled.is_set() or late:
                    self.generator.cancel(job)
                    del jobs[key]
                    request.finish(Finished("timeout" if late else "cancelled", len(request.ids), count))
            self.running = len(jobs)
            if not jobs:
                continue
            try:
                results: list[dict[str, Any]] = self.generator.iterate()
            except Exception as exc:
                log.exception("exllamav3 generator failed")
                for request, _, count in jobs.values():
                    request.finish(Finished("error", len(request.ids), count, exc))
                jobs.clear()
                continue
            for r in results:
                request = r.get("identifier")  # type: ignore[assignment]
                if not isinstance(request, Request) or id(request) not in jobs or r.get("stage") != "streaming":
                    continue
                _, job, count = jobs[id(request)]
                ids = r.get("token_ids")
                count += int(ids.shape[-1]) if ids is not None else 0
                jobs[id(request)] = (request, job, count)
                if r.get("text"):
                    request.emit(r["text"])
                if r.get("eos"):
                    del jobs[id(request)]
                    reason = "length" if r.get("eos_reason") == "max_new_tokens" else "stop"
                    request.finish(Finished(reason, len(request.ids), int(r.get("new_tokens", count))))


def _eos_ids(tokenizer: Any) -> set[int]:
    """exllamav3's tokenizer's end-of-sequence id and those of the checkpoint's ``generation_config.json``."""
    ids: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        (getattr(tokenizer, "generation_config_dict", None) or {}).get("eos_token_id"),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def exllamav3_available() -> str | None:
    """``None`` when exllamav3 can serve here, else why not (no CUDA device, not installed)."""
    import importlib.util

    if importlib.util.find_spec("exllamav3") is None:
        return "exllamav3 is not installed: pip install exllamav3"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "exllamav3 needs a CUDA GPU (Ampere or newer) and none is visible here"
    return None


def gpu_split(devices: Sequence[int]) -> dict[str, Any]:
    """exllamav3's load keywords for the visible GPUs: tensor parallel over all of them when there are several."""
    return {"tensor_p": len(devices) > 1}
