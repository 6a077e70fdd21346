"""Load time after ``import torch`` (anyquant) / ``import llama_cpp`` (llama.cpp), fresh processes alternating.

Each sample is a fresh process (after one untimed warm-up run per engine and model, which also writes the
sources' bytecode under ``.cache/bench/pycache``, as an installed package has it): it imports torch (or llama_cpp)
untimed, then times ``import anyquant`` plus
``anyquant.load(path)`` (default backend: ``cpu-fast`` on a CPU with the int4 kernel), or llama-cpp-python's
``Llama(path)`` (with its extra CPU buffer types, i.e. repacking at load, where a trial load runs them: see
``_measure.llama_cpp_extra_bufts``; else ``use_extra_bufts=False``). The engines take turns, their
order reversed every other round, and each sample records the share of the machine's CPU time other processes
used while it ran (``/proc/stat`` minus its own process) and the load average; medians are printed over all
samples and over those at or under ``--max-other``.

``--tree NAME=DIR`` adds anyquant from another source tree (its ``core/src`` and ``plugins/*/src`` first on
``PYTHONPATH``), e.g. a worktree of main for before/after figures taken in the same conditions::

    git worktree add --detach /tmp/aq-main main
    python bench/load.py --tree before=/tmp/aq-main [--models 1b,smollm2] [--samples 5] [--threads 2]

Models: ``1b`` (bench/llamacpp.py's synthetic ~1.1B Llama-shaped Q4_0 GGUF, made there once), ``smollm2`` (the
bundled SmolLM2-135M Q4_1 GGUF), ``gptq`` (bench/gptq.py's cached GPTQ 4-bit g64 of SmolLM2, anyquant only),
or paths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _measure import CACHE, ENV, _unshadow, cpu_times, llama_cpp_extra_bufts, llama_cpp_model, other_share

REPO = Path(__file__).resolve().parent.parent


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["engine"] == "llama.cpp":
        import llama_cpp  # noqa: F401  (untimed, as torch's import is for anyquant)

        before = cpu_times()
        t0 = time.perf_counter()
        llama_cpp_model(
            cfg["path"],
            extra_bufts=bool(cfg.get("extra_bufts")),
            n_ctx=1024,
            n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"],
        )
        load_s = time.perf_counter() - t0
        backend = "llama.cpp"
    else:
        _unshadow()
        import torch

        torch.set_num_threads(cfg["threads"])
        before = cpu_times()
        t0 = time.perf_counter()
        import anyquant

        model = anyquant.load(cfg["path"])
        load_s = time.perf_counter() - t0
        backend = model.backend
    return {"load_s": load_s, "other_cpu": other_share(before, cpu_times()), "backend": backend}


def tree_env(tree: Path | None) -> dict[str, str]:
    env = {**os.environ, **ENV}
    root = tree or REPO
    paths = [root / "core" / "src", *sorted((root / "plugins").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    # an installed package imports from compiled bytecode; without a cache (PYTHONDONTWRITEBYTECODE, a read-only
    # tree) every sample would compile anyquant's sources first (~0.1-0.5 s, more than some loads): keep it here
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(CACHE / "pycache")
    return env


def sample(cfg: dict[str, Any], python: str, tree: Path | None) -> dict[str, Any]:
    proc = subprocess.run(
        [python, __file__, "--child"],
        input=json.dumps(cfg),
        capture_output=True,
        text=True,
        env=tree_env(tree),
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": " ".join((proc.stderr or proc.stdout).split())[-300:] or f"exit status {proc.returncode}"}
    return dict(json.loads(lines[-1])) | {"loadavg": os.getloadavg()[0]}


def model_paths(names: str) -> list[tuple[str, Path, bool]]:
    """(label, path, llama.cpp can load it) per requested model."""
    _unshadow()
    import anyquant

    out: list[tuple[str, Path, bool]] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name == "1b":
            sys.path.insert(0, str(Path(__file__).parent))
            import llamacpp

            _unshadow()
            smol = Path(anyquant.default_model())
            out.append(
                ("1.1B Q4_0 GGUF", llamacpp.make_gguf(smol, llamacpp.ROOT / "llama-1.1b-synthetic.Q4_0.gguf"), True)
            )
        elif name == "smollm2":
            out.append(("SmolLM2-135M Q4_1 GGUF", Path(anyquant.default_model()), True))
        elif name == "gptq":
            found = next(iter(sorted(CACHE.glob("smollm2-135m-gptq-b4-g64-*"))), None)
            if found is None:
                print("# gptq: no cached GPTQ of SmolLM2 (bench/gptq.py makes it); skipped")
                continue
            out.append(("SmolLM2-135M GPTQ 4-bit g64", found, False))
        else:
            out.append((name, Path(name), name.endswith(".gguf")))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b,smollm2", help="comma-separated: 1b, smollm2, gptq, or paths")
    ap.add_argument("--samples", type=int, default=5, help="fresh processes per engine and model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR: anyquant from another source tree too")
    ap.add_argument("--max-other", type=float, default=0.05, help="the limit of the filtered medians")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python (default: bench/llamacpp.py's search)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))))
        return 0

    sys.path.insert(0, str(Path(__file__).parent))
    from llamacpp import find_llama_python

    llama_python = find_llama_python(args.llama_python)
    engines: list[tuple[str, str, Path | None]] = [("anyquant", sys.executable, None)]
    for spec in args.tree:
        name, _, folder = spec.partition("=")
        engines.append((f"anyquant ({name})", sys.executable, Path(folder).resolve()))
    extra = False
    if llama_python:
        probe = next((path for _, path, gguf in model_paths(args.models) if gguf), None)
        extra = probe is not None and llama_cpp_extra_bufts(llama_python, probe)
    print(
        f"# {args.threads} threads; load average {os.getloadavg()[0]:.2f} at the start; llama.cpp: {llama_python}, "
        f"extra CPU buffer types {'on (repacks at load)' if extra else 'off'}"
    )
    table = ["| model | engine | load s, median (all) | median (other CPU <= limit) | samples used / all | other CPU |"]
    table.append("|---|---|---|---|---|---|")
    for label, path, gguf in model_paths(args.models):
        runs = [(n, py, tree, "anyquant") for n, py, tree in engines]
        if gguf and llama_python:
            runs.insert(0, ("llama.cpp", llama_python, None, "llama.cpp"))
        got: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in runs}
        for _name, python, tree, engine in runs:  # untimed: fills the bytecode cache and the file's page cache
            sample({"engine": engine, "path": str(path), "threads": args.threads, "extra_bufts": extra}, python, tree)
        for i in range(args.samples):
            for name, python, tree, engine in runs if i % 2 == 0 else runs[::-1]:
                cfg = {"engine": engine, "path": str(path), "threads": args.threads, "extra_bufts": extra}
                r = sample(cfg, python, tree)
                brief = r.get("error") or {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                print(f"# {label} / {name} sample {i + 1}: {brief}", file=sys.stderr, flush=True)
                got[name].append(r)
        for name, samples in got.items():
            ok = [s for s in samples if "load_s" in s]
            quiet = [s["load_s"] for s in ok if s["other_cpu"] <= args.max_other]
            every = statistics.median(s["load_s"] for s in ok) if ok else None
            filtered = f"{statistics.median(quiet):.2f}" if quiet else "-"
            others = ", ".join(f"{s['other_cpu']:.0%}" for s in ok)
            cell = f"{every:.2f}" if every is not None else "-"
            table.append(f"| {label} | {name} | {cell} | {filtered} | {len(quiet)} / {len(samples)} | {others} |")
    print(f"# load average {os.getloadavg()[0]:.2f} at the end; other CPU: per sample, in order")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
