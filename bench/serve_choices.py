"""Time to first token of a request for ``n`` choices of one long prompt in ``anyquant serve``'s scheduler
(in-process, the bundled model): the prompt prefilled once and its cache copied, against one prefill per choice.

    python bench/serve_choices.py [--n 4] [--prompt-tokens 512] [--rounds 3]

Each round submits the n choices together (``Scheduler.submit_many``, as the HTTP side does) with
``max_tokens: 1`` and waits for every choice to end; the best round of each way is printed.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from _measure import _unshadow

_unshadow()  # bench/gguf.py would shadow the gguf package the bundled model loads with

import anyquant  # noqa: E402
from anyquant_serve.batch import DecodeBatch  # noqa: E402
from anyquant_serve.scheduler import ModelAdapter, Request, Scheduler  # noqa: E402


def _round(scheduler: Scheduler, model: Any, ids: list[int], n: int) -> float:
    done = threading.Event()
    ends: list[Any] = []

    def finish(f: Any) -> None:
        ends.append(f)
        if len(ends) == n:
            done.set()

    works = [Request(ids, model.params(), 1, lambda text: None, finish) for _ in range(n)]
    start = time.perf_counter()
    scheduler.submit_many(works)
    done.wait()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with anyquant.load(anyquant.default_model()) as model:
        adapter = ModelAdapter(model)
        text = " ".join(f"item {i} is a number of the list." for i in range(args.prompt_tokens))
        ids = adapter.encode(text, chat=False)[: args.prompt_tokens]
        fork = DecodeBatch.fork
        for label, shared in (("one prefill, cache copied", True), ("one prefill per choice", False)):
            DecodeBatch.fork = fork if shared else (lambda self, key, source: False)  # type: ignore[method-assign]
            scheduler = Scheduler(adapter, max_batch=args.n, max_queue=args.n)
            _round(scheduler, model, ids, args.n)  # warm-up
            best = min(_round(scheduler, model, ids, args.n) for _ in range(args.rounds))
            scheduler.close(60)
            print(f"n={args.n}, {len(ids)}-token prompt, {label}: {best:.3f} s to every choice's first token")
        DecodeBatch.fork = fork  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
