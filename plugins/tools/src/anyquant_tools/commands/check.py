"""``anyquant check``: load a checkpoint and say whether it behaves like a language model."""

from __future__ import annotations

import argparse

from anyquant.console import JSON_HELP, add_load_flags, json_line
from anyquant.hookspecs import CommandRegistrar, hookimpl

__all__ = ["anyquant_register_commands"]

#: the exit status of a model the check finds broken (a degraded one exits 0, with its verdict printed)
BROKEN_EXIT = 3


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command(
        "check", "does the loaded model behave like a language model? (bounded sanity pass)", _configure, _run
    )


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help="checkpoint (default: the bundled SmolLM2 model)")
    add_load_flags(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.epilog = f"Exit status {BROKEN_EXIT} when the model is broken (its perplexity near a uniform guess)."


def _run(args: argparse.Namespace) -> int:
    from anyquant.api import default_model, load

    from ..check import check

    model = load(args.path or default_model(), backend=args.backend, device=args.device, dtype=args.dtype)
    try:
        report = check(model)
    finally:
        model.close()
    print(json_line(report.to_dict()) if args.json else report.summary())
    return BROKEN_EXIT if report.verdict == "broken" else 0
