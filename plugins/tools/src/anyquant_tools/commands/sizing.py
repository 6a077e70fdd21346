"""``anyquant estimate`` and ``anyquant advise``: memory for a checkpoint, and what fits a GPU."""

from __future__ import annotations

import argparse

from anyquant.console import JSON_HELP, json_line
from anyquant.hookspecs import CommandRegistrar, hookimpl

__all__ = ["anyquant_register_commands"]


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("estimate", "memory for weights + KV cache at a context length", _configure_estimate, _cmd_estimate)
    cli.add_command(
        "advise", "format, bits and engine for a GPU, memory and number of users", _configure_advise, _cmd_advise
    )


def _configure_estimate(p: argparse.ArgumentParser) -> None:
    from ..estimate import KV_BITS

    p.add_argument("model", metavar="PATH_OR_CONFIG", help="checkpoint dir/.gguf (exact) or config.json (needs --bits)")
    p.add_argument("--bits", type=float, default=None, help="bits per weight of the decoder linears")
    p.add_argument("--context", type=int, default=8192, help="context length in tokens (default 8192)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the KV cache (default 1)")
    p.add_argument("--kv-dtype", default="fp16", help=f"one of {', '.join(KV_BITS)}")
    p.add_argument("--head-bits", type=float, default=16.0, help="LM head bits for config estimates (EXL3: 6)")
    p.add_argument("--format", default=None, help="format of a config estimate: exl3 counts its padding to 128")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _configure_advise(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", required=True, help='e.g. "RTX 4090", "A100 80GB", "T4", "Apple M3 Max", "CPU"')
    p.add_argument("--vram", type=float, default=None, help="GB per GPU (unified memory / RAM for Apple / CPU)")
    p.add_argument("--users", type=int, default=1, help="concurrent users")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    p.add_argument("--context", type=int, default=8192, help="context length in tokens (default 8192)")
    p.add_argument("--ram", type=float, default=None, help="system RAM in GB (for offload plans)")
    p.add_argument(
        "--model", required=True, metavar="PATH_OR_CONFIG", help="checkpoint dir/.gguf or config.json to size"
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ..estimate import estimate

    e = estimate(
        args.model,
        bits=args.bits,
        context=args.context,
        batch=args.batch,
        kv_dtype=args.kv_dtype,
        head_bits=args.head_bits,
        format=args.format,
    )
    print(json_line(e.to_dict()) if args.json else e.summary())
    return 0


def _cmd_advise(args: argparse.Namespace) -> int:
    from ..advise import advise

    a = advise(args.gpu, args.vram, args.users, args.model, args.gpus, context=args.context, ram_gb=args.ram)
    print(json_line(a.to_dict()) if args.json else a.summary())
    return 0
