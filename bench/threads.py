"""Decode speed of the bundled model by the thread that runs it: what torch's OpenMP pools cost (issue #43).

libgomp keeps a pool of worker threads for every thread that has run a parallel region; once two are alive they hold
more threads than cores and each region sleeps and wakes. ``anyquant.load`` therefore loads on a thread that ends.
Each row is a fresh process (rows alternating, ``--samples`` of each, medians), greedy, ``--tokens`` new tokens after
a warm-up call of the same kind, 2 threads:

- ``sync``: ``model.complete`` on the main thread after ``anyquant.load``;
- ``async``: ``await model.acomplete`` (a worker thread per call) after ``anyquant.load``;
- ``async after a sync call``: the same after one ``model.complete`` on the main thread (two pools: the limit that
  docs/quickstart.md states);
- ``async, load on the main thread``: the load's work run on the main thread (``anyquant.api._load``, what ``load``
  did before it moved to a thread of its own).

    python bench/threads.py [--samples 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _measure import machine

CHILD = r"""
import asyncio, json, sys, time
import torch
torch.set_num_threads(2)
import anyquant
from anyquant import api
mode, tokens = sys.argv[1], int(sys.argv[2])
path = str(anyquant.default_model())
prompt = "Write a long story about the sea, the ships and the sailors who lived there."
if mode == "async, load on the main thread":
    import inspect  # load()'s own defaults, handed to the work it runs on its thread
    params = inspect.signature(anyquant.load).parameters.values()
    model = api._load(path, **{p.name: p.default for p in params if p.default is not p.empty})
else:
    model = anyquant.load(path)
if mode == "sync":
    model.complete(prompt, max_new_tokens=8)
    t = time.perf_counter()
    r = model.complete(prompt, max_new_tokens=tokens)
else:
    if mode == "async after a sync call":
        model.complete(prompt, max_new_tokens=8)
    async def go():
        await model.acomplete(prompt, max_new_tokens=tokens)
        t = time.perf_counter()
        r = await model.acomplete(prompt, max_new_tokens=tokens)
        return t, r
    t, r = asyncio.run(go())
dt = time.perf_counter() - t
print(json.dumps({"tok_s": r.usage.completion_tokens / dt, "tokens": r.usage.completion_tokens}))
"""

MODES = ["sync", "async", "async after a sync call", "async, load on the main thread"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.samples):
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, str(args.tokens)], capture_output=True, text=True, check=True
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(row["tok_s"])
            print(f"# {mode}: {row}", flush=True)
    print(f"\n{machine()}; load average at the end {os.getloadavg()[0]:.2f}\n")
    print("| how the model runs | decode tok/s (median) | samples |")
    print("|---|---|---|")
    for mode in MODES:
        values = results[mode]
        print(f"| {mode} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
