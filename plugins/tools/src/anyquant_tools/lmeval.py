"""An lm-eval (``lm_eval``, EleutherAI's evaluation harness) model over anyquant: ``AnyquantLM``, registered with
lm-eval as ``"anyquant"`` when this module is imported.

    import anyquant_tools.lmeval, lm_eval
    lm_eval.simple_evaluate(model="anyquant", model_args="pretrained=./model-GPTQ,batch_size=8", tasks=[...])
    lm_eval.simple_evaluate(model=anyquant_tools.lmeval.AnyquantLM(model=sdk.load(path)), tasks=[...])

``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` go through :meth:`LoadedModel.loglikelihood`,
:meth:`LoadedModel.loglikelihood_rolling` and :meth:`LoadedModel.complete`, ``batch_size`` pairs at a time, with a
progress bar on stderr (tqdm, lm-eval's own wording) unless lm-eval passes ``disable_tqdm=True``. Needs ``pip install 'anyquant-tools[lmeval]'``
(``lm-eval``); importing this module without it is a :class:`~anyquant.errors.MissingDependencyError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from anyquant.errors import MissingDependencyError, ParameterError
from anyquant.protocols import LoadedModel

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise MissingDependencyError(
        "anyquant_tools.lmeval needs lm-eval: pip install 'anyquant-tools[lmeval]' (or lm-eval==0.4.13)"
    ) from exc

__all__ = ["AnyquantLM", "main"]

log = logging.getLogger(__name__)

#: ``generate_until``'s ``max_gen_toks`` when a task gives none (lm-eval's own default)
DEFAULT_MAX_GEN_TOKS = 256


class AnyquantLM(LM):  # type: ignore[misc]  # lm-eval is untyped
    """An lm-eval ``LM`` over a :class:`~anyquant.protocols.LoadedModel`: pass ``model=`` (a loaded model) or
    ``pretrained=`` (what :func:`anyquant.load` takes) with ``backend``/``device``/``dtype``. ``batch_size`` is the
    scoring batch (``"auto"``, lm-eval's, is 8), reported as lm-eval's HF model reports its own (``batch_size``,
    ``batch_sizes``); ``max_length`` the rolling window (default: the model's context)."""

    def __init__(
        self,
        pretrained: str | Path | None = None,
        *,
        model: LoadedModel | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        backend: str = "auto",
        device: str = "auto",
        dtype: str | None = None,
        **load_options: Any,
    ) -> None:
        super().__init__()
        if (model is None) == (pretrained is None):
            raise ParameterError("AnyquantLM takes pretrained=PATH or model=<a loaded model>, one of them")
        if model is None:
            from anyquant.api import load

            assert pretrained is not None

            model = load(pretrained, backend=backend, device=device, dtype=dtype, **load_options)
        self.model: LoadedModel = model
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # lm-eval's "auto" is not ours
        self.max_length = None if max_length is None else int(max_length)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Mapping[str, Any] | None = None) -> AnyquantLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(dict(simple_parse_args_string(arg_string)), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: Mapping[str, Any], additional_config: Mapping[str, Any] | None = None
    ) -> AnyquantLM:
        args = dict(arg_dict)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k in ("batch_size", "device")}
        if "batch_size" in extra and "batch_size" in args:
            # lm-eval's command line passes its --batch_size, 1 unless given, beside every model_args: a batch_size in
            # model_args is the user's own and wins (lm-eval's HF model takes only one of them)
            if str(extra["batch_size"]) != str(args["batch_size"]):
                log.info("batch_size=%s from model_args, not lm-eval's %s", args["batch_size"], extra["batch_size"])
            del extra["batch_size"]
        if "device" in extra and "device" not in args and not _device_available(str(extra["device"])):
            # lm-eval's own default is "cuda:0" whether or not the user asked for it (its HFLM falls back the same
            # way); a device in model_args is the user's and stays strict
            log.info("lm-eval's device %r is not available here: anyquant picks the device ('auto')", extra["device"])
            extra["device"] = "auto"
        return cls(**{**args, **extra})

    @property
    def batch_sizes(self) -> dict[int, int]:
        """The batch size used, where lm-eval looks for it (its HF model's ``batch_sizes``: ``simple_evaluate``'s
        ``results["config"]["batch_sizes"]``, printed after ``batch_size:``)."""
        return {0: self.batch_size}

    # ------------------------------------------------------------------ lm-eval's three requests
    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [tuple(r.args) for r in requests]
        # longest first (in characters: the tokens are the model's to count), as lm-eval's HF model orders its
        # requests, so that each batch of batch_size holds pairs of about one length; answers in the requests' order
        order = sorted(range(len(pairs)), key=lambda i: -sum(len(part) for part in pairs[i]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        with self._progress(len(pairs), "Running loglikelihood requests", disable_tqdm) as bar:
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                answers = self.model.loglikelihood([pairs[i] for i in rows], batch_size=self.batch_size)
                for i, answer in zip(rows, answers, strict=True):
                    out[i] = answer
                bar.update(len(rows))
        return out

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        out: list[float] = []
        with self._progress(len(requests), "Running loglikelihood_rolling requests", disable_tqdm) as bar:
            for request in requests:  # each text's windows are scored batch_size at a time
                (total,) = self.model.loglikelihood_rolling(
                    [request.args[0]], window=self.max_length, batch_size=self.batch_size
                )
                out.append(total)
                bar.update(1)
        return out

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        with self._progress(len(requests), "Running generate_until requests", disable_tqdm) as bar:
            for request in requests:
                context, gen_kwargs = request.args
                out.append(self.model.complete(context, **generation_keywords(gen_kwargs)).text)
                bar.update(1)
        return out

    @contextmanager
    def _progress(self, total: int, desc: str, disable: bool) -> Iterator[Any]:
        """lm-eval's progress bar (tqdm on stderr), off with ``disable_tqdm`` and on ranks other than 0 as in its HF
        model."""
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, disable=bool(disable) or getattr(self, "rank", 0) != 0)
        try:
            yield bar
        finally:
            bar.close()

    # ------------------------------------------------------------------ chat templates, caching
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from anyquant_runtime.chat import render_chat
        from anyquant_runtime.generate import context_length

        return render_chat(
            self.model.tokenizer,
            chat_history,
            context_length=context_length(getattr(self.model, "module", None)),
            add_generation_prompt=add_generation_prompt,
        )

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.model.tokenizer, "name_or_path", "") or self.model.detection.path).replace("/", "__")


def _device_available(device: str) -> bool:
    if not device.startswith("cuda"):
        return True
    import torch

    return bool(torch.cuda.is_available())


def generation_keywords(gen_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """lm-eval's ``generation_kwargs`` (``until``, ``max_gen_toks``, ``do_sample``, ``temperature``, ``top_p``,
    ``top_k``) as :class:`~anyquant.params.GenerationParams` keywords; anything else is a ParameterError."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None)
    stop = [until] if isinstance(until, str) else list(until or [])
    out: dict[str, Any] = {"stop": stop, "max_new_tokens": int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))}
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
    out["temperature"] = temperature if do_sample else 0.0
    for key in ("top_p", "top_k", "seed", "min_p", "repetition_penalty"):
        if key in kwargs:
            out[key] = kwargs.pop(key)
    if kwargs:
        raise ParameterError(f"generation_kwargs {sorted(kwargs)}: not read by anyquant's lm-eval model")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m anyquant_tools.lmeval run --model anyquant --model_args pretrained=PATH --tasks ...``: lm-eval's own
    command line with anyquant's model registered (lm-eval 0.4.13's ``lm-eval`` command imports only its own
    models and has no plugin entry points, so ``lm-eval run --model anyquant`` cannot find it)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *_cli_argv(list(sys.argv[1:] if argv is None else argv))]
    cli_evaluate()


def _cli_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--batch_size N`` added when ``--model_args`` names ``batch_size=N`` and no ``--batch_size``
    (``-b``) is given: lm-eval's command line passes (and prints, ``batch_size: 1``) its own default of 1 otherwise,
    while the model uses the one in model_args."""
    if any(a == "-b" or a.startswith(("-b", "--batch")) for a in argv):
        return argv
    values: list[str] = []
    taking = False
    for a in argv:
        if a in ("--model_args", "-a"):
            taking = True
        elif a.startswith("--model_args="):
            values.append(a.partition("=")[2])
            taking = False
        elif taking and not a.startswith("-"):
            values.append(a)
        else:
            taking = False
    size = None
    for value in values:
        for part in value.split(","):
            key, eq, val = part.partition("=")
            if eq and key.strip() == "batch_size" and val.strip():
                size = val.strip()
    return argv if size is None else [*argv, "--batch_size", size]


if __name__ == "__main__":
    # run as a script this file is ``__main__``: register (and run) the importable module's class, not this copy's
    from anyquant_tools.lmeval import main as _main

    _main()
else:
    register_model("anyquant")(AnyquantLM)
