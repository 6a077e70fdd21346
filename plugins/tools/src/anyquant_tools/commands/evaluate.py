"""``anyquant eval`` and ``anyquant compare``: perplexity, memory and speed of one or several checkpoints."""

from __future__ import annotations

import argparse
from typing import Any

from anyquant.console import JSON_HELP, add_load_flags, json_line, progress_bar
from anyquant.hookspecs import CommandRegistrar, hookimpl

__all__ = ["anyquant_register_commands"]


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("eval", "perplexity, peak memory, prefill/decode speed and load time", _configure_eval, _cmd_eval)
    cli.add_command(
        "compare", "evaluate several checkpoints on the same text; table and PNG", _configure_compare, _cmd_compare
    )


def _configure_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help="checkpoint (default: the bundled SmolLM2 model)")
    _add_common(p)


def _configure_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", help="checkpoints to compare")
    _add_common(p)
    p.add_argument("--rounds", type=int, default=2, help="timing rounds, alternating order")
    p.add_argument("--png", default=None, help="write the perplexity/bits/memory plot here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")


def _add_common(p: argparse.ArgumentParser) -> None:
    from ..evaluate import DEFAULT_DECODE, DEFAULT_MAX_TOKENS, DEFAULT_PREFILL, DEFAULT_TEXT, DEFAULT_WINDOW

    p.add_argument("--text", default=DEFAULT_TEXT, help="corpus name (held-out part), .txt/.jsonl/.parquet, or hf:NAME")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per perplexity window")
    p.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="cap on tokens read from the text (0: all)"
    )
    p.add_argument("--prefill-tokens", type=int, default=DEFAULT_PREFILL, help="prompt tokens of the speed test")
    p.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE, help="new tokens of the speed test")
    add_load_flags(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _common_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        text=args.text,
        window=args.window,
        max_tokens=args.max_tokens or None,
        prefill_tokens=args.prefill_tokens,
        decode_tokens=args.decode_tokens,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
    )


def _cmd_eval(args: argparse.Namespace) -> int:
    from anyquant.api import default_model

    from ..evaluate import evaluate, to_table

    path = args.path or default_model()
    result = evaluate(path, **_common_kwargs(args))
    print(json_line(result.to_dict()) if args.json else to_table([result]))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from ..evaluate import check_png_path, compare, plot, to_markdown, to_table

    if args.png:
        check_png_path(args.png)
    results = compare(args.paths, rounds=args.rounds, progress=progress_bar(), **_common_kwargs(args))
    png = plot(results, args.png) if args.png else None
    if args.json:
        print(json_line({"results": [r.to_dict() for r in results], "png": str(png) if png else None}))
    else:
        print(to_markdown(results) if args.markdown else to_table(results))
        if png:
            print(f"\nplot: {png}")
    return 0
