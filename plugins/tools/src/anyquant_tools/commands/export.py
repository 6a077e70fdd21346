"""``anyquant export``: any loadable checkpoint as a dense Hugging Face folder."""

from __future__ import annotations

import argparse

from anyquant.console import JSON_HELP, emit
from anyquant.hookspecs import CommandRegistrar, hookimpl

__all__ = ["anyquant_register_commands"]


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("export", "write any loadable checkpoint as a dense HF folder", _configure, _run)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint to export (any loadable format)")
    p.add_argument("out", help="folder to write (must not exist unless --overwrite)")
    p.add_argument("--to", default="dense", choices=["dense"], help="output format (dense: a Hugging Face folder)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weights' dtype (default bfloat16)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _run(args: argparse.Namespace) -> int:
    from ..export import export_dense

    out = export_dense(args.path, args.out, dtype=args.dtype, overwrite=args.overwrite)
    emit(args, {"out": str(out), "to": args.to, "dtype": args.dtype}, f"wrote {out} ({args.to}, {args.dtype})")
    return 0
