"""The ``anyquant`` command line. ``--help`` imports neither torch nor any plugin."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .errors import AnyquantError, ParameterError

__all__ = ["main"]


class _Commands:
    """What plugins get in ``anyquant_register_commands(cli)``."""

    def __init__(self, subparsers: Any) -> None:
        self._sub = subparsers

    def add_command(
        self,
        name: str,
        help: str,
        configure: Callable[[argparse.ArgumentParser], None],
        run: Callable[[argparse.Namespace], int],
    ) -> None:
        parser = self._sub.add_parser(name, help=help)
        configure(parser)
        parser.set_defaults(func=run)


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


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json_line(payload))
    else:
        print(text)


def _cmd_detect(args: argparse.Namespace) -> int:
    from .api import detect

    d = detect(args.path, format=args.format)
    lines = [f"{d.path}: {d.format}" + (f" ({d.variant})" if d.variant else "") + f"  [plugin {d.plugin}]"]
    lines += [f"  - {e}" for e in d.evidence]
    lines += [f"  note: {n}" for n in d.notes]
    _emit(args, d.to_dict(), "\n".join(lines))
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .api import inspect

    report = inspect(args.path)
    d = report.detection
    lines = [f"{d.path}: {d.format}" + (f" ({d.variant})" if d.variant else "")]
    header = f"{'module':<48} {'format':<8} {'bits':>6} {'group':>6} {'shape':<16} {'bytes':>11}"
    lines += [header, "-" * len(header)]
    for m in report.modules:
        bits = f"{m.bits:g}" if m.bits is not None else "-"
        group = str(m.group_size) if m.group_size is not None else "-"
        shape = "x".join(str(s) for s in m.shape)
        lines.append(f"{m.name[:48]:<48} {m.format:<8} {bits:>6} {group:>6} {shape:<16} {_fmt_bytes(m.nbytes):>11}")
    t = report.totals
    lines.append("-" * len(header))
    lines.append(
        f"modules {t['modules']} ({t['quantized_modules']} quantized), parameters {t['parameters']:,}, "
        f"on disk {_fmt_bytes(t['bytes_on_disk'])}, average bits/weight of quantized linears "
        f"{t['avg_bits_quantized'] if t['avg_bits_quantized'] is not None else '-'}"
    )
    if "experts" in t:
        lines.append(
            f"mixture of experts: {t['experts']} experts a layer, {t['experts_per_token']} per token; "
            f"parameters one token reads {t['active_parameters']:,} of {t['parameters']:,}"
        )
    _emit(args, report.to_dict(), "\n".join(lines))
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from .api import default_registry

    reg = default_registry()
    infos = reg.plugins()
    formats = reg.formats()
    payload = {
        "plugins": [i.to_dict() for i in infos],
        "formats": {
            name: {"loader": spec.loader, "quantizer": spec.quantizer, "description": spec.description}
            for name, spec in formats.items()
        },
    }
    lines = []
    for i in infos:
        if i.error == "disabled":
            status = "disabled (ANYQUANT_DISABLE_PLUGINS)"
        else:
            status = f"ERROR {i.error}" if i.error else ", ".join(i.formats) or "(no formats)"
        lines.append(f"{i.name:<16} {i.version or '-':<10} {status}")
    _emit(args, payload, "\n".join(lines))
    return 0


def _cmd_backends(args: argparse.Namespace) -> int:
    from .api import default_registry
    from .registry import load_spec_object

    reg = default_registry()
    names = [args.format.lower()] if args.format else sorted(n for n, spec in reg.formats().items() if spec.loader)
    payload: dict[str, Any] = {}
    lines = []
    for name in names:
        loader = load_spec_object(reg.format(name), "loader")  # unknown format or unloadable: a typed error
        rows = [b for b in loader.backends()] if hasattr(loader, "backends") else []
        payload[name] = [
            {"name": b.name, "available": b.available, "reason": b.reason, "description": b.description} for b in rows
        ]
        lines.append(name)
        for b in rows:
            state = "available" if b.available else f"not available: {b.reason}"
            lines.append(f"  {b.name:<12} {state}" + (f" -- {b.description}" if b.description else ""))
    _emit(args, {"formats": payload}, "\n".join(lines))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .api import default_model, load

    path = args.path or default_model()
    flags = {"backend": "--backend", "device": "--device", "dtype": "--dtype", "format": "--format"}
    options = _options(args.option, {**flags, "registry": "the Python API"})
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
        _emit(args, {"path": str(path), "format": model.format, "backend": model.backend, "text": text}, text)
        return 0
    for piece in model.stream(prompt, **kwargs):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _progress_bar() -> Any:
    """A stage progress bar on stderr (tqdm when installed)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return lambda stage, frac: print(f"[{frac:4.0%}] {stage}", file=sys.stderr)
    bar = tqdm(total=100, unit="%", file=sys.stderr, bar_format="{l_bar}{bar}| {elapsed}")

    def update(stage: str, frac: float) -> None:
        bar.set_description(stage[:40])
        bar.update(max(0, round(100 * frac) - bar.n))
        if frac >= 1.0:
            bar.close()

    return update


def _option(text: str) -> tuple[str, Any]:
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


def _add_option_flag(parser: argparse.ArgumentParser, what: str, examples: str) -> None:
    """``-o/--option KEY=VALUE`` (repeatable), parsed by :func:`_option`."""
    parser.add_argument(
        "-o",
        "--option",
        type=_option,
        action="append",
        metavar="KEY=VALUE",
        help=f"{what} (repeatable; VALUE is JSON or a string), e.g. {examples}",
    )


def _no_constant(name: str) -> Any:
    raise ValueError(name)  # NaN / Infinity stay strings


def _options(pairs: Sequence[tuple[str, Any]] | None, taken: Mapping[str, str]) -> dict[str, Any]:
    """``-o`` pairs as keywords; a key that a flag of the command sets (``taken``: key -> flag) is an error."""
    out: dict[str, Any] = {}
    for key, value in pairs or ():
        if key in taken:
            raise ParameterError(f"-o {key}=...: use {taken[key]}")
        if key in out:
            raise ParameterError(f"-o {key} given twice")
        out[key] = value
    return out


#: quantize() keywords that the quantize command's own flags set
_QUANTIZE_FLAGS = {
    "method": "--method",
    "bits": "--bits",
    "group_size": "--group-size",
    "sym": "--asym",
    "desc_act": "--desc-act",
    "calibration": "--calibration",
    "calibration_samples": "--samples",
    "calibration_seq_len": "--seq-len",
    "overwrite": "--overwrite",
    "max_ppl_ratio": "--max-ppl-ratio",
    "quality": "--no-quality-check",
    "progress": "--json (no progress bar)",
    "registry": "the Python API",
}


def _on_off(value: str) -> bool:
    flag = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if value.lower() not in flag:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of true/false, yes/no, on/off, 1/0")
    return flag[value.lower()]


def _cmd_quantize(args: argparse.Namespace) -> int:
    from .quantization import quantize

    # method options that flags of their own set, when given: -o may not set them too
    flagged = {"format": (args.format or None, "--format"), "zero_point": (args.zero_point, "--zero-point")}
    given = {key: value for key, (value, _) in flagged.items() if value is not None}
    if args.asym and args.zero_point is False:
        raise ParameterError("--asym asks for zero points and --zero-point false for none: pass one of them")
    if args.group_size is not None and args.method == "exl3":
        raise ParameterError("--group-size: exl3 has no groups (its scales are per channel); drop the flag")
    options = _options(args.option, {**_QUANTIZE_FLAGS, **{key: flagged[key][1] for key in given}})
    options.update(given)
    out = quantize(
        args.src,
        args.dst,
        method=args.method,
        bits=args.bits,
        group_size=128 if args.group_size is None else args.group_size,
        sym=False if args.asym else None,
        desc_act=args.desc_act,
        calibration=args.calibration,
        calibration_samples=args.samples,
        calibration_seq_len=args.seq_len,
        overwrite=args.overwrite,
        max_ppl_ratio=args.max_ppl_ratio,
        quality=not args.no_quality_check,
        progress=None if args.json else _progress_bar(),
        **options,
    )
    _emit(args, {"dst": str(out), "method": args.method}, f"wrote {out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import export_dense

    out = export_dense(args.path, args.out, dtype=args.dtype, overwrite=args.overwrite)
    _emit(args, {"out": str(out), "to": args.to, "dtype": args.dtype}, f"wrote {out} ({args.to}, {args.dtype})")
    return 0


def build_parser(with_plugins: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anyquant", description="Load any quantized LLM checkpoint.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("detect", help="decide a checkpoint's format from its headers")
    p.add_argument("path")
    p.add_argument("--format", default=None, help="assert this format (error if the tensors disagree)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_detect)

    p = sub.add_parser("inspect", help="per-module table: format, bits, group size, shape, bytes")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("plugins", help="installed plugins and the formats they register")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("backends", help="each loadable format's backends: available here or why not")
    p.add_argument("--format", default=None, help="one format (default: every loadable one)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("generate", help="load a checkpoint and stream a completion")
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
    _add_option_flag(p, "a load option of the format's loader", "-o cpu_fast_tables=memory, -o allow_pickle=true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("quantize", help="quantize a dense checkpoint (gptq, awq, exl3)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--method", required=True, choices=["gptq", "awq", "exl3"])
    p.add_argument("--bits", type=float, default=4)
    p.add_argument("--group-size", type=int, default=None, help="GPTQ/AWQ (default 128); exl3 has none")
    p.add_argument("--asym", action="store_true", help="asymmetric (zero points)")
    p.add_argument("--zero-point", type=_on_off, default=None, help="AWQ: zero points on/off (true/false)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order")
    p.add_argument("--format", default=None, help="checkpoint format, e.g. gptq (v1) or gptq_v2")
    p.add_argument("--calibration", default=None, help="named source, mix (c4:0.5,code:0.5) or a file")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-ppl-ratio", type=float, default=3.0)
    p.add_argument("--no-quality-check", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    _add_option_flag(
        p,
        "an option of the method's quantizer",
        "-o codebook=mcg -o head_bits=16 (exl3), -o quantizer_backend=anyquant (awq), -o seed=1, "
        "-o 'dynamic={\"-:.*down_proj\": {}}' (gptq); an option the method does not read is an error "
        "that lists those it does",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("export", help="write any loadable checkpoint as a dense HF folder")
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--to", default="dense", choices=["dense"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_export)

    from . import calibration, evaluate, sizing

    evaluate.register_cli(sub)  # eval, compare
    sizing.register_cli(sub)  # estimate, advise
    calibration.register_cli(sub)  # calibration list|sample|check

    if with_plugins:
        from .api import default_registry

        default_registry().call_each("anyquant_register_commands", "register CLI commands", cli=_Commands(sub))
    return parser


BUILTIN_COMMANDS = (
    "-h",
    "--help",
    "detect",
    "inspect",
    "plugins",
    "backends",
    "generate",
    "quantize",
    "export",
    "eval",
    "compare",
    "estimate",
    "advise",
    "calibration",
)


#: the loggers -v/-vv open up: core's and the first-party plugins' (each package logs under its own name)
LOGGERS = ("anyquant", "anyquant_gptq", "anyquant_awq", "anyquant_exl3", "anyquant_gguf")


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
        wants_plugins = command is not None and command not in BUILTIN_COMMANDS
        parser = build_parser(with_plugins=wants_plugins)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        with _console_logging(args.verbose):
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
