"""``anyquant calibration list|sample|check``: calibration sources, mixes and the overlap guard."""

from __future__ import annotations

import argparse
import hashlib
import json

from anyquant.console import JSON_HELP
from anyquant.hookspecs import CommandRegistrar, hookimpl

from ..calibration import (
    DEFAULT_NGRAM,
    DEFAULT_THRESHOLD,
    CalibrationError,
    CalibrationOverlapError,
    corpus_dir,
    evaluation_text,
    overlap,
    sample,
    sources,
)

__all__ = ["anyquant_register_commands"]


@hookimpl
def anyquant_register_commands(cli: CommandRegistrar) -> None:
    cli.add_command("calibration", "calibration sources, mixes and the overlap guard", _configure, _no_action)


def _no_action(args: argparse.Namespace) -> int:  # pragma: no cover - argparse requires an ACTION
    return 2


_THRESHOLD_HELP = f"largest share of shared n-grams accepted (default {DEFAULT_THRESHOLD})"


def _configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="calibration_command", metavar="ACTION", required=True)

    p = sub.add_parser("list", help="named calibration sources")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("sample", help="draw calibration texts from a source or a mix")
    p.add_argument("spec", help='a source, file or mix, e.g. "c4:0.5,code:0.25,wiki:0.25"')
    p.add_argument("-n", "--n", type=int, default=8, help="number of samples")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample (about 4 characters a token)")
    p.add_argument("--seed", type=int, default=0, help="seed for drawing the samples")
    p.add_argument("--against", default=None, help="evaluation text (corpus name or file): refuse overlap")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help=_THRESHOLD_HELP)
    p.add_argument("--output", default=None, help="write the samples as JSONL")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_sample)

    p = sub.add_parser("check", help="n-gram overlap between calibration and evaluation text")
    p.add_argument("calibration", help='calibration source, file or mix, e.g. "c4:0.5,code:0.5"')
    p.add_argument("evaluation", help="corpus name (its held-out part) or file")
    p.add_argument("-n", "--n", type=int, default=128, help="number of calibration samples drawn (default 128)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed for drawing the samples")
    p.add_argument("--ngram", type=int, default=DEFAULT_NGRAM, help=f"n-gram length compared (default {DEFAULT_NGRAM})")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help=_THRESHOLD_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_check)


def _cmd_list(args: argparse.Namespace) -> int:
    found = sources()
    try:
        where = str(corpus_dir())
    except CalibrationError as exc:
        where = f"unavailable: {exc}"
    if args.json:
        print(json.dumps({"corpus_dir": where, "sources": [s.to_dict() for s in found.values()]}))
        return 0
    for s in found.values():
        print(f"{s.name:<14} {s.origin:<28} {s.description}")
    print(f"\ncorpus: {where}\nalso: FILE.txt, FILE.jsonl[#field], FILE.parquet[#column], hf:NAME[:CONFIG][@SPLIT]")
    return 0


def _against_text(spec: str) -> str:
    return evaluation_text(spec)


def _cmd_sample(args: argparse.Namespace) -> int:
    evaluation = _against_text(args.against) if args.against else None
    texts = sample(args.spec, args.n, args.seq_len, args.seed, evaluation=evaluation, threshold=args.threshold)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            for t in texts:
                fh.write(json.dumps({"text": t}) + "\n")
    summary = {
        "spec": args.spec,
        "n_samples": len(texts),
        "seq_len": args.seq_len,
        "seed": args.seed,
        "chars": sum(len(t) for t in texts),
        "sha256": hashlib.sha256("\x00".join(texts).encode()).hexdigest(),
        "output": args.output,
    }
    if args.json:
        print(json.dumps({**summary, **({} if args.output else {"texts": texts})}))
    elif args.output:
        print(f"wrote {len(texts)} samples ({summary['chars']} chars) to {args.output}")
    else:
        for i, t in enumerate(texts):
            print(f"--- sample {i} ({len(t)} chars)\n{t[:300]}{' ...' if len(t) > 300 else ''}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    texts = sample(args.calibration, args.n, args.seq_len, args.seed)
    result = overlap(texts, _against_text(args.evaluation), args.ngram)
    if result.fraction > args.threshold:  # with --json, the error object is the one line printed
        raise CalibrationOverlapError(
            f"{result.describe()}; overlap {result.fraction:.2%} is over the {args.threshold:.2%} threshold"
        )
    if args.json:
        print(json.dumps({**result.to_dict(), "threshold": args.threshold, "refused": False}))
    else:
        print(f"{result.describe()}; overlap {result.fraction:.4%} -> ok")
    return 0
