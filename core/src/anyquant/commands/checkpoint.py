"""``anyquant detect``, ``inspect``, ``download``, ``plugins`` and ``backends``: what a checkpoint is, fetching
one from the Hugging Face Hub when asked, and what is installed."""

from __future__ import annotations

import argparse
from typing import Any

from ..console import JSON_HELP, emit, fmt_bytes
from ..hookspecs import CommandRegistrar, hookimpl

__all__ = ["anyquant_register_commands"]


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("detect", "decide a checkpoint's format from its headers", _configure_detect, _cmd_detect)
    cli.add_command(
        "inspect", "per-module table: format, bits, group size, shape, bytes", _configure_inspect, _cmd_inspect
    )
    cli.add_command(
        "download",
        "fetch a Hugging Face Hub model's files its format needs into the Hugging Face cache (huggingface_hub)",
        _configure_download,
        _cmd_download,
    )
    cli.add_command("plugins", "installed plugins and the formats they register", _configure_json, _cmd_plugins)
    cli.add_command(
        "backends", "each loadable format's backends: available here or why not", _configure_backends, _cmd_backends
    )


_REVISION_HELP = "a model id's branch, tag or commit in the Hugging Face cache (same as ID@REVISION)"


_PATH_HELP = "checkpoint folder, .gguf file or Hugging Face model id"


def _configure_detect(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help=_PATH_HELP)
    p.add_argument("--format", default=None, help="assert this format (error if the tensors disagree)")
    p.add_argument("--revision", default=None, help=_REVISION_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help=_PATH_HELP)
    p.add_argument("--revision", default=None, help=_REVISION_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _configure_download(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="owner/name, owner/name@REVISION, or owner/name/file.gguf")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default main)")
    p.add_argument(
        "--include",
        default=None,
        metavar="PATTERN",
        help='which weights, a glob: "*Q4_K_M*" (one file of a GGUF repository)',
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _cmd_download(args: argparse.Namespace) -> int:
    from ..hub import download

    path = download(args.model, revision=args.revision, include=args.include)
    emit(args, {"model": args.model, "path": str(path)}, str(path))
    return 0


def _configure_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _configure_backends(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default=None, help="one format (default: every loadable one)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _cmd_detect(args: argparse.Namespace) -> int:
    from ..api import detect

    d = detect(args.path, format=args.format, revision=args.revision)
    lines = [f"{d.path}: {d.format}" + (f" ({d.variant})" if d.variant else "") + f"  [plugin {d.plugin}]"]
    lines += [f"  - {e}" for e in d.evidence]
    lines += [f"  note: {n}" for n in d.notes]
    emit(args, d.to_dict(), "\n".join(lines))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..api import inspect

    report = inspect(args.path, revision=args.revision)
    d = report.detection
    lines = [f"{d.path}: {d.format}" + (f" ({d.variant})" if d.variant else "")]
    header = f"{'module':<48} {'format':<8} {'bits':>6} {'group':>6} {'shape':<16} {'bytes':>11}"
    lines += [header, "-" * len(header)]
    for m in report.modules:
        bits = f"{m.bits:g}" if m.bits is not None else "-"
        group = str(m.group_size) if m.group_size is not None else "-"
        shape = "x".join(str(s) for s in m.shape)
        lines.append(f"{m.name[:48]:<48} {m.format:<8} {bits:>6} {group:>6} {shape:<16} {fmt_bytes(m.nbytes):>11}")
    t = report.totals
    lines.append("-" * len(header))
    lines.append(
        f"modules {t['modules']} ({t['quantized_modules']} quantized), parameters {t['parameters']:,}, "
        f"on disk {fmt_bytes(t['bytes_on_disk'])}, average bits/weight of quantized linears "
        f"{t['avg_bits_quantized'] if t['avg_bits_quantized'] is not None else '-'}"
    )
    if "experts" in t:
        lines.append(
            f"mixture of experts: {t['experts']} experts a layer, {t['experts_per_token']} per token; "
            f"parameters one token reads {t['active_parameters']:,} of {t['parameters']:,}"
        )
    emit(args, report.to_dict(), "\n".join(lines))
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from ..api import default_registry

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
    emit(args, payload, "\n".join(lines))
    return 0


def _cmd_backends(args: argparse.Namespace) -> int:
    from ..api import default_registry
    from ..registry import load_spec_object

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
    backends: dict[str, Any] = {}
    if not args.format:
        from ..backends import backend_status

        lines.append("registered backends (anyquant_register_backends)")
        for name, spec in sorted(reg.backends().items()):
            ok, reason = backend_status(spec.status)
            backends[name] = {
                "plugin": reg.backend_owner(name),
                "devices": list(spec.devices),
                "layouts": list(spec.layouts),
                "available": ok,
                "reason": reason,
                "description": spec.description,
            }
            where = ", ".join(spec.devices) or "any device"
            state = "available" if ok else "not available"
            lines.append(f"  {name:<12} {state} on {where}; layouts: {', '.join(spec.layouts)} ({reason or 'ok'})")
    emit(args, {"formats": payload, **({"backends": backends} if backends else {})}, "\n".join(lines))
    return 0
