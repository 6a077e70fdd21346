"""``anyquant generate``: load a checkpoint and stream a completion."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..console import add_option_flag, emit, options_from
from ..hookspecs import CommandRegistrar, hookimpl

__all__ = ["anyquant_register_commands"]


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("generate", "load a checkpoint and stream a completion", _configure, _run)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help="checkpoint (default: the bundled SmolLM2 model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--format", default=None, help="assert this format (error if the tensors disagree)")
    add_option_flag(p, "a load option of the format's loader", "-o cpu_fast_tables=memory, -o allow_pickle=true")
    p.add_argument("--json", action="store_true")


def _run(args: argparse.Namespace) -> int:
    from ..api import default_model, load

    path = args.path or default_model()
    flags = {"backend": "--backend", "device": "--device", "dtype": "--dtype", "format": "--format"}
    options = options_from(args.option, {**flags, "registry": "the Python API"})
    model = load(path, format=args.format, backend=args.backend, device=args.device, dtype=args.dtype, **options)
    prompt: Any = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
    if args.json:
        text = model.generate(prompt, **kwargs)
        emit(args, {"path": str(path), "format": model.format, "backend": model.backend, "text": text}, text)
        return 0
    for piece in model.stream(prompt, **kwargs):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
