"""The ``anyquant`` command line: an argparse shell. ``--help`` imports neither torch nor any plugin.

Every command, core's own included, comes through the ``anyquant_register_commands`` hook: core's built-in
commands are default plugins (:data:`anyquant.commands.DEFAULT_COMMANDS`), registered first and without any
plugin discovery; the installed plugins' commands are added only for a command that is not a built-in one.
A command's parser is configured only when it is the command being run, so listing the commands costs nothing.
What commands share (JSON lines, the progress bar, ``-o KEY=VALUE``) is in :mod:`anyquant.console`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from . import __version__
from .commands import DEFAULT_COMMANDS
from .errors import AnyquantError, MissingDependencyError

__all__ = ["build_parser", "main"]


class _Commands:
    """What ``anyquant_register_commands(cli)`` gets. Each command is listed (``anyquant --help``); its
    ``configure(parser)`` runs only when it is ``command`` (the one being run), or for every command with
    ``configure_all`` (:func:`build_parser`)."""

    def __init__(self, subparsers: Any, command: str | None = None, configure_all: bool = True) -> None:
        self._sub = subparsers
        self._command = command
        self._configure_all = configure_all
        self.names: list[str] = []

    def add_command(
        self,
        name: str,
        help: str,
        configure: Callable[[argparse.ArgumentParser], None],
        run: Callable[[argparse.Namespace], int],
    ) -> None:
        parser = self._sub.add_parser(name, help=help)
        parser.add_argument(  # here too, so it may follow the command (SUPPRESS: the global one's value stays)
            "--allow-symlinks", action="store_true", default=argparse.SUPPRESS, help=_ALLOW_SYMLINKS_HELP
        )
        self.names.append(name)
        if self._configure_all or name == self._command:
            configure(parser)
        parser.set_defaults(func=run)


#: first-party commands that are their own distribution's (registered by its plugin when installed): what to install
ELSEWHERE = {
    **dict.fromkeys(
        ("quantize", "export", "eval", "compare", "check", "estimate", "advise", "calibration"), "anyquant-tools"
    ),
    "serve": "anyquant-serve",
}

_ALLOW_SYMLINKS_HELP = (
    "follow links that leave the model directory when they end at a regular file "
    "(a shared model tree, a linked .gguf); also ANYQUANT_ALLOW_SYMLINKS=1"
)


def _elsewhere_epilog() -> str:
    """The first-party commands of other distributions, and whether each distribution is installed (looked up, not
    imported: ``--help`` imports no plugin)."""
    import importlib.util

    parts = []
    for dist in dict.fromkeys(ELSEWHERE.values()):
        names = ", ".join(c for c, d in ELSEWHERE.items() if d == dist)
        try:
            installed = importlib.util.find_spec(dist.replace("-", "_")) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules: not importable here
            installed = False
        parts.append(f"{names} ({dist}, " + ("installed" if installed else f"not installed: pip install {dist}") + ")")
    return "More commands: " + "; ".join(parts) + ". `anyquant COMMAND --help` shows a command's options."


def _build(command: str | None, configure_all: bool) -> tuple[argparse.ArgumentParser, _Commands]:
    parser = argparse.ArgumentParser(
        prog="anyquant",
        description="Load any quantized LLM checkpoint.",
        epilog=_elsewhere_epilog(),
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"anyquant {__version__}", help="print the version")
    parser.add_argument("--allow-symlinks", action="store_true", help=_ALLOW_SYMLINKS_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli = _Commands(sub, command, configure_all)
    for module in DEFAULT_COMMANDS:  # core's default plugins, as a plugin's hook is called
        importlib.import_module(module).anyquant_register_commands(cli=cli)
    return parser, cli


def _add_plugin_commands(cli: _Commands) -> None:
    from .api import default_registry

    default_registry().call_each("anyquant_register_commands", "register CLI commands", cli=cli)


def build_parser(with_plugins: bool = True) -> argparse.ArgumentParser:
    """The whole parser, every command configured (the installed plugins' too with ``with_plugins``)."""
    parser, cli = _build(None, configure_all=True)
    if with_plugins:
        _add_plugin_commands(cli)
    return parser


#: the loggers -v/-vv open up: core's and the first-party plugins' (each package logs under its own name)
LOGGERS = (
    "anyquant",
    "anyquant_runtime",
    "anyquant_tools",
    "anyquant_gptq",
    "anyquant_awq",
    "anyquant_exl3",
    "anyquant_gguf",
    "anyquant_serve",
)


@contextmanager
def _console_logging(verbose: int) -> Iterator[None]:
    """anyquant's log records on stderr for one command (``-v`` INFO, ``-vv`` DEBUG), touching only anyquant's
    loggers and only for the command's duration: ``main()`` called from a host application leaves the root
    logger, other libraries' levels and the host's handlers as they were. Where the host already handles
    records (a handler on the root logger), only the levels change and the host's handler shows them."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    handler: logging.Handler | None = None
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler()  # sys.stderr as it is now
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        if verbose:
            logger.setLevel(level)
        if handler is not None:
            logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, old in saved:
            logger.setLevel(old)
            if handler is not None:
                logger.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 success, 2 an anyquant error, a file-system error (``OSError``: permissions, a path too
    long, a full disk) or a bad argument, 130 Ctrl-C, 141 a closed output pipe (``anyquant ... | head``)."""
    args = None
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        # plugins may add commands; --help and no-argument runs stay fast (no plugin import)
        command = next((a for a in argv if not a.startswith("-")), None)  # after global options such as -v
        parser, cli = _build(command, configure_all=False)
        if command is not None and command not in cli.names:  # a plugin's command (or a typo): ask the plugins
            _add_plugin_commands(cli)
            if command not in cli.names and command in ELSEWHERE:
                raise MissingDependencyError(
                    f"`anyquant {command}` is in the {ELSEWHERE[command]} distribution, which is not installed: "
                    f"pip install {ELSEWHERE[command]}"
                )
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        if args.allow_symlinks:  # the CLI process's own setting: every probe (and worker) it starts follows it
            os.environ["ANYQUANT_ALLOW_SYMLINKS"] = "1"
        from .quiet import quiet_dependencies

        with _console_logging(args.verbose), quiet_dependencies():  # no dependency's import-time notices
            return int(args.func(args))
    except (AnyquantError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            return _pipe_closed()
        _report(args, exc)
        return 2
    except KeyboardInterrupt:
        return 130


def _report(args: argparse.Namespace | None, exc: BaseException) -> None:
    message = str(exc)
    if isinstance(exc, OSError) and exc.strerror:  # "[Errno 13] Permission denied: 'x'" -> "x: Permission denied"
        message = f"{exc.filename}: {exc.strerror}" if exc.filename is not None else exc.strerror
    try:
        if getattr(args, "json", False):
            print(json.dumps({"error": type(exc).__name__, "message": message}))
        else:
            print(f"anyquant: {type(exc).__name__}: {message}", file=sys.stderr)
    except BrokenPipeError:
        _pipe_closed()


def _pipe_closed() -> int:
    """The reader of stdout went away (``| head``): no traceback, and none from the interpreter's own flush
    of stdout at exit either (stdout is pointed at /dev/null)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to flush
        pass
    return 141


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
