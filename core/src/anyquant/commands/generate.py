"""``anyquant generate``: load a checkpoint and stream a completion."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..console import add_load_flags, add_option_flag, emit, options_from
from ..hookspecs import CommandRegistrar, hookimpl

__all__ = ["anyquant_register_commands"]


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("generate", "load a checkpoint and stream a completion", _configure, _run)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help="checkpoint (default: the bundled SmolLM2 model)")
    p.add_argument("--prompt", required=True, help="the text to continue (or the user message with --chat/--system)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="a system message (implies --chat)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the top-p nucleus (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the best one's probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (repeatable results)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_load_flags(p)
    p.add_argument("--format", default=None, help="assert this format (error if the tensors disagree)")
    add_option_flag(p, "a load option of the format's loader", "-o cpu_fast_tables=memory, -o allow_pickle=true")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, finish_reason, stop_string, usage, timings, capped",
    )


def _run(args: argparse.Namespace) -> int:
    from ..api import default_model, load
    from ..errors import ParameterError
    from ..protocols import LoadedModel

    # everything the command line says is checked before the model loads (seconds)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
    LoadedModel.params(**kwargs)
    if not args.prompt:
        raise ParameterError("--prompt is empty: give the text to continue")
    prompt: Any = args.prompt
    if args.chat or args.system is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = [*system, {"role": "user", "content": args.prompt}]
    path = args.path or default_model()
    flags = {"backend": "--backend", "device": "--device", "dtype": "--dtype", "format": "--format"}
    options = options_from(args.option, {**flags, "registry": "the Python API"})
    if sys.stderr.isatty():  # a person at a terminal: say what the next seconds are (pipes and logs stay clean)
        print(f"loading {path} ...", file=sys.stderr, flush=True)
    model = load(path, format=args.format, backend=args.backend, device=args.device, dtype=args.dtype, **options)
    if args.json:
        result = model.complete(prompt, **kwargs)
        if result.capped is not None:
            print(f"note: {result.capped.message}", file=sys.stderr)
        payload = {"path": str(path), "format": model.format, "backend": model.backend, **result.to_dict()}
        emit(args, payload, result.text)
        return 0
    for chunk in model.complete_stream(prompt, **kwargs):
        if chunk.capped is not None:
            print(f"note: {chunk.capped.message}", file=sys.stderr, flush=True)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
