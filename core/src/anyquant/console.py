"""What the command line's commands share: strict JSON lines, a progress bar, ``-o KEY=VALUE`` options.

Built-in and third-party commands alike import these (a command module imports this, never :mod:`anyquant.cli`,
which only assembles the parser and runs a command). Standard library only: ``anyquant --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ParameterError

__all__ = [
    "JSON_HELP",
    "add_load_flags",
    "add_option_flag",
    "emit",
    "fmt_bytes",
    "json_line",
    "on_off",
    "options_from",
    "parse_option",
    "progress_bar",
]


#: the ``--json`` flag's help, the same on every command
JSON_HELP = "print one line of JSON instead of text"


def json_line(payload: Any) -> str:
    """``--json`` output: one line of strict JSON. A NaN or infinite number (a perplexity that diverged) is
    ``null``, since ``NaN``/``Infinity`` are not JSON and strict parsers refuse the whole line."""
    return json.dumps(_finite(payload), default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    """Print ``payload`` as a JSON line under ``--json``, else ``text``."""
    if getattr(args, "json", False):
        print(json_line(payload))
    else:
        print(text)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def progress_bar() -> Any:
    """A stage progress bar on stderr (tqdm when installed), drawn at the first stage reported: a command that
    fails its checks before any work prints its error and no empty bar."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return lambda stage, frac: print(f"[{frac:4.0%}] {stage}", file=sys.stderr)
    bars: list[Any] = []

    def update(stage: str, frac: float) -> None:
        if not bars:
            bars.append(tqdm(total=100, unit="%", file=sys.stderr, bar_format="{l_bar}{bar}| {elapsed}"))
        bar = bars[0]
        bar.set_description(stage[:40])
        bar.update(max(0, round(100 * frac) - bar.n))
        if frac >= 1.0:
            bar.close()

    return update


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``-o``: the value as JSON when it is (numbers, true/false, null, lists, objects),
    else the string itself; a key is an identifier."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        value = raw
    return key, value


def _no_constant(name: str) -> Any:
    raise ValueError(name)  # NaN / Infinity stay strings


def add_load_flags(parser: argparse.ArgumentParser) -> None:
    """``--backend``, ``--device`` and ``--dtype``: how a command that loads a model loads it."""
    parser.add_argument(
        "--backend", default="auto", help="kernel backend (default auto; `anyquant backends` lists them)"
    )
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=None, help="compute dtype, e.g. float16 (default: the loader's choice)")


def add_option_flag(parser: argparse.ArgumentParser, what: str, examples: str) -> None:
    """``-o/--option KEY=VALUE`` (repeatable), parsed by :func:`parse_option`."""
    parser.add_argument(
        "-o",
        "--option",
        type=parse_option,
        action="append",
        metavar="KEY=VALUE",
        help=f"{what} (repeatable; VALUE is JSON or a string), e.g. {examples}",
    )


def options_from(pairs: Sequence[tuple[str, Any]] | None, taken: Mapping[str, str]) -> dict[str, Any]:
    """``-o`` pairs as keywords; a key that a flag of the command sets (``taken``: key -> flag) is an error."""
    out: dict[str, Any] = {}
    for key, value in pairs or ():
        if key in taken:
            raise ParameterError(f"-o {key}=...: use {taken[key]}")
        if key in out:
            raise ParameterError(f"-o {key} given twice")
        out[key] = value
    return out


def on_off(value: str) -> bool:
    """An argparse ``type``: true/false, yes/no, on/off, 1/0."""
    flag = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if value.lower() not in flag:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of true/false, yes/no, on/off, 1/0")
    return flag[value.lower()]
