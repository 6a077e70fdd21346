"""``anyquant quantize``: a dense checkpoint quantized by any installed method.

The methods are the registry's (every registered format with a quantizer, a third party's included), and
their own flags (``--desc-act``, ``--zero-point``, ``--format`` ...) are what the quantizers declare in
``quantize_flags`` (:class:`~anyquant.protocols.QuantizeFlag`), checked by their ``check_flags``: core knows
no method. Configuring this command therefore discovers the plugins (``anyquant quantize --help`` does;
``anyquant --help`` does not).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from anyquant.console import JSON_HELP, add_option_flag, emit, on_off, options_from, progress_bar
from anyquant.hookspecs import CommandRegistrar, hookimpl
from anyquant.protocols import QuantizeFlag, QuantizeSpec

__all__ = ["anyquant_register_commands", "method_flags", "quantizer_classes"]

log = logging.getLogger(__name__)

#: quantize() keywords that the command's own flags set
CORE_FLAGS = {
    "method": "--method",
    "bits": "--bits",
    "group_size": "--group-size",
    "sym": "--asym",
    "calibration": "--calibration",
    "calibration_samples": "--samples",
    "calibration_seq_len": "--seq-len",
    "overwrite": "--overwrite",
    "max_ppl_ratio": "--max-ppl-ratio",
    "quality": "--no-quality-check",
    "progress": "--json (no progress bar)",
    "registry": "the Python API",
}

#: flags of the command that are not quantize() keywords (a method's flag may not take them either)
_OTHER_FLAGS = {"src", "dst", "samples", "seq_len", "asym", "no_quality_check", "option", "json", "func", "verbose"}


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("quantize", "quantize a dense checkpoint with an installed plugin's method", _configure, _run)


def quantizer_classes(registry: Any) -> dict[str, Any]:
    """Each registered format with a quantizer -> its quantizer class (``None`` when it does not import here:
    the method is listed all the same, and quantizing says what is missing), in registration order."""
    from anyquant.registry import import_object

    out: dict[str, Any] = {}
    for name, spec in registry.formats().items():
        if spec.quantizer is None:
            continue
        try:
            out[name] = import_object(spec.quantizer)
        except Exception as exc:  # a missing dependency: no flags from it, the method still listed
            log.info("quantizer of %s does not import (%s): no flags of its own", name, exc)
            out[name] = None
    return out


def method_flags(quantizers: Mapping[str, Any]) -> dict[str, tuple[QuantizeFlag, list[Any]]]:
    """The methods' declared flags: keyword -> (the first declaration, every quantizer class declaring it; the
    help shows each one's own help when they differ). A
    declaration that is not a :class:`QuantizeFlag`, or that would take one of the command's own flags, is
    skipped with a warning."""
    out: dict[str, tuple[QuantizeFlag, list[Any]]] = {}
    for method, cls in quantizers.items():
        for flag in getattr(cls, "quantize_flags", ()) if cls is not None else ():
            if not isinstance(flag, QuantizeFlag) or flag.name in CORE_FLAGS or flag.name in _OTHER_FLAGS:
                log.warning("quantizer of %s: flag %r skipped (not a QuantizeFlag, or a flag of core's)", method, flag)
                continue
            out.setdefault(flag.name, (flag, []))[1].append(cls)
    return out


def _declared(cls: Any, name: str) -> list[QuantizeFlag]:
    return [f for f in getattr(cls, "quantize_flags", ()) if isinstance(f, QuantizeFlag) and f.name == name]


def _configure(p: argparse.ArgumentParser) -> None:
    from anyquant.api import default_registry

    quantizers = quantizer_classes(default_registry())
    flags = method_flags(quantizers)
    p.add_argument("src", help="dense checkpoint to quantize (folder or Hugging Face model id)")
    p.add_argument("dst", help="folder to write (must not exist unless --overwrite)")
    aliases = [
        a
        for cls in quantizers.values()
        for a in getattr(cls, "method_aliases", None) or {}
        if "@" not in a and a not in quantizers
    ]
    p.add_argument(
        "--method",
        required=True,
        choices=[*quantizers, *aliases],
        help="quantization method (a format, or a quantizer's shorthand: "
        + (", ".join(aliases) or "none installed")
        + ")",
    )
    p.add_argument("--bits", type=float, default=4, help="bits per weight (default 4)")
    p.add_argument("--group-size", type=int, default=None, help="for methods with groups (default 128)")
    p.add_argument("--asym", action="store_true", help="asymmetric (zero points)")
    for flag, declarers in flags.values():
        helps = {m: f.help for m, cls in quantizers.items() if cls in declarers for f in _declared(cls, flag.name)}
        text = "; ".join(f"{m}: {h}" for m, h in helps.items() if h) if len(set(helps.values())) > 1 else flag.help
        if flag.kind == "switch":
            p.add_argument(
                flag.flag,
                dest=flag.name,
                action="store_true",
                help=text or f"a flag of {', '.join(m for m, c in quantizers.items() if c in declarers)}",
            )
        else:
            kind = on_off if flag.kind == "bool" else str
            p.add_argument(
                flag.flag,
                dest=flag.name,
                type=kind,
                default=None,
                help=text or f"a flag of {', '.join(m for m, c in quantizers.items() if c in declarers)}",
            )
    p.add_argument("--calibration", default=None, help="named source, mix (c4:0.5,code:0.5) or a file")
    p.add_argument("--samples", type=int, default=128, help="calibration samples (default 128)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sample (default 512)")
    p.add_argument(
        "--max-ppl-ratio",
        type=float,
        default=3.0,
        help="refuse a result whose perplexity is above this multiple of the source's (default 3.0)",
    )
    p.add_argument("--no-quality-check", action="store_true", help="skip the perplexity check of the result")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    reads = "; ".join(
        f"{method}: {', '.join(sorted(cls.quantize_options))}"
        for method, cls in quantizers.items()
        if getattr(cls, "quantize_options", None)
    )
    add_option_flag(
        p,
        "an option of the method's quantizer",
        "-o seed=1"
        + (f"; the methods read {reads}" if reads else "")
        + "; an option the method does not read is an error that lists those it does",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(quantize_flags=flags, quantizers=quantizers)


def _given(args: argparse.Namespace, flags: Mapping[str, tuple[QuantizeFlag, list[Any]]]) -> dict[str, Any]:
    """The declared flags given on the command line, as quantize() keywords."""
    out: dict[str, Any] = {}
    for name, (flag, _) in flags.items():
        value = getattr(args, name, None)
        if flag.kind == "switch":
            value = True if value else None
        elif flag.kind == "str":
            value = value or None
        if value is not None:
            out[name] = value
    return out


def _run(args: argparse.Namespace) -> int:
    from ..quantize import quantize

    flags: Mapping[str, tuple[QuantizeFlag, list[Any]]] = args.quantize_flags
    given = _given(args, flags)
    # the quantizers that declared a flag given, then the method's own, check what the command line set
    core_given = {"group_size": args.group_size} if args.group_size is not None else {}
    core_given.update({"sym": False} if args.asym else {})
    checkers = [cls for name in given for cls in flags[name][1]] + [args.quantizers.get(args.method)]
    seen: list[Any] = []
    for cls in checkers:
        check = getattr(cls, "check_flags", None)
        if cls is not None and cls not in seen and callable(check):
            seen.append(cls)
            check({**core_given, **given})
    spec_fields = {f.name for f in fields(QuantizeSpec)}
    taken = {name: flag.flag for name, (flag, _) in flags.items() if name in given or name in spec_fields}
    options = options_from(args.option, {**CORE_FLAGS, **taken})
    options.update(given)
    out = quantize(
        args.src,
        args.dst,
        method=args.method,
        bits=args.bits,
        group_size=128 if args.group_size is None else args.group_size,
        sym=False if args.asym else None,
        calibration=args.calibration,
        calibration_samples=args.samples,
        calibration_seq_len=args.seq_len,
        overwrite=args.overwrite,
        max_ppl_ratio=args.max_ppl_ratio,
        quality=not args.no_quality_check,
        progress=None if args.json else progress_bar(),
        **options,
    )
    emit(args, {"dst": str(out), "method": args.method}, f"wrote {out}")
    return 0
