"""Decode speed of the bundled model by the thread that runs it: what torch's OpenMP pools cost (issue #43).

libgomp keeps a pool of worker threads for every thread that has run a parallel region; once two are alive they hold
more threads than cores and each region sleeps and wakes. ``anyquant.load`` and each model call therefore end the
calling thread's pool when they return (``anyquant._openmp``). Each row is a fresh process (rows alternating,
``--samples`` of each, medians), greedy, ``--tokens`` new tokens after a warm-up call of the same kind, 2 threads:

- ``sync``: ``model.complete`` on the main thread after ``anyquant.load``;
- ``async``: ``await model.acomplete`` (a worker thread per call) after ``anyquant.load``;
- ``async after a sync call``: the same after one ``model.complete`` on the main thread;
- ``sync, a thread pool``: ``model.complete`` from a pool of 4 long-lived threads, each call on the next (what a web
  framework's sync endpoints do);
- ``..., pools kept``: the third and fourth rows with the release turned off (two or more pools alive: what they
  cost without it).

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
import asyncio, json, queue, sys, threading, time
import torch
torch.set_num_threads(2)
import anyquant
from anyquant import _openmp
mode, tokens = sys.argv[1], int(sys.argv[2])
if mode.endswith("pools kept"):
    _openmp._find_pause = lambda: None
path = str(anyquant.default_model())
prompt = "Write a long story about the sea, the ships and the sailors who lived there."
model = anyquant.load(path)
if mode == "sync":
    model.complete(prompt, max_new_tokens=8)
    t = time.perf_counter()
    r = model.complete(prompt, max_new_tokens=tokens)
elif mode.startswith("sync, a thread pool"):
    inboxes = [queue.Queue() for _ in range(4)]
    def serve(inbox):
        while (job := inbox.get()) is not None:
            job[1].append(model.complete(prompt, max_new_tokens=job[0]))
            job[2].set()
    workers = [threading.Thread(target=serve, args=(q,)) for q in inboxes]
    for w in workers: w.start()
    def call(i, n):
        box, done = [], threading.Event()
        inboxes[i % 4].put((n, box, done)); done.wait()
        return box[0]
    for i in range(4):  # a warm-up call on each of the pool's threads
        call(i, 8)
    t = time.perf_counter()
    r = call(4, tokens)
    for q in inboxes: q.put(None)
else:
    if mode.startswith("async after a sync call"):
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

MODES = [
    "sync",
    "async",
    "async after a sync call",
    "sync, a thread pool",
    "async after a sync call, pools kept",
    "sync, a thread pool, pools kept",
]


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
