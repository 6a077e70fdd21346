"""Aggregate tokens/s of ``anyquant serve`` at 1, 4 and 8 concurrent clients on the bundled model, against
llama.cpp's server (llama-cpp-python's ``llama_cpp.server``) on the same GGUF file, in the same run; and the cost
of structured output (issue #43: a ``json_schema`` ``response_format``) on ``anyquant serve``'s decode.

    python bench/serve.py [--clients 1,4,8] [--max-tokens 48] [--rounds 2] [--repeats 1]
                          [--llama-python /root/llvenv/bin/python]
                          [--schema-clients 1,8] [--schema-rounds 6] [--skip-schema]
                          [--prefix-chunks 512,256] [--prefix-rounds 3] [--skip-prefix] [--prefix-only]

Each server runs in its own process on a free port; each client sends ``--rounds`` greedy chat completions in a
row (a different question each), through the official ``openai`` client. Aggregate tokens/s = completion
tokens of every answer / wall time of the whole level (prefill included; the prompts are short chat turns).
``llama_cpp.server`` is llama-cpp-python's server (one request at a time, no batching across requests); its AMX
buffer type crashes on some CPUs, so its model parameters are patched with ``use_extra_bufts=False``.

The schema rows stream the same prompts (asking for JSON) greedily with and without ``response_format:
{"type": "json_schema", ...}`` (:data:`SCHEMA`), alternating per round; each stream's decode rate is its tokens
after the first over the time from its first to its last piece of text (prefill left out: a constrained answer
may be shorter, which would otherwise weigh its prefill more); the median over the streams of a level.

The prefix-cache rows (issue #43: time to first token of a repeated 2,000-token system prompt at most 0.2x the
cold request's) time non-streamed ``max_tokens: 1`` chat requests (the prefill, one token, the HTTP round trip)
with a system prompt of about 2,000 tokens, per round: a new system prompt (its first words name the round, so
nothing of it is cached: cold), a second question under it (its whole chunks reused: warm), and that request
again (all of it reused: repeat); medians over ``--prefix-rounds``, one server per ``--prefill-chunk`` of
``--prefix-chunks`` (the cache reuses whole chunks: a smaller chunk leaves less to prefill).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "List three uses of copper.",
    "Describe a cat to a child.",
    "What makes bread rise?",
    "Give advice for a first job interview.",
    "Tell a story about a lost key.",
    "How do bees make honey?",
]
#: the schema of the structured-output rows: room for long answers, so both kinds decode for about as long
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 120},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 160}, "maxItems": 8},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["title", "facts", "rating"],
    "additionalProperties": False,
}
LLAMA_SERVER = """
import sys, llama_cpp
params = llama_cpp.llama_cpp.llama_model_default_params
def patched():
    p = params()
    p.use_extra_bufts = False
    return p
llama_cpp.llama_cpp.llama_model_default_params = patched
from llama_cpp.server.__main__ import main
sys.argv = ["llama_cpp.server"] + sys.argv[1:]
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start_anyquant(model: str, port: int, max_batch: int, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    srcs = [str(ROOT / "core" / "src"), *[str(p / "src") for p in sorted((ROOT / "plugins").iterdir())]]
    env["PYTHONPATH"] = os.pathsep.join([*srcs, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "anyquant.cli", "serve", model, "--port", str(port), "--model-name", "m"]
    cmd += ["--max-batch", str(max_batch), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(proc, f"http://127.0.0.1:{port}/health")
    return proc


def start_llama(python: str, model: str, port: int, threads: int) -> subprocess.Popen[bytes]:
    cmd = [python, "-c", LLAMA_SERVER, "--model", model, "--model_alias", "m", "--port", str(port)]
    cmd += ["--n_ctx", "4096", "--n_threads", str(threads), "--n_threads_batch", str(threads), "--verbose", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(proc, f"http://127.0.0.1:{port}/v1/models")
    return proc


def level(base: str, clients: int, rounds: int, max_tokens: int) -> tuple[float, int, float]:
    """(aggregate completion tokens/s, tokens, wall seconds) for ``clients`` concurrent clients."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=900)

    def one(i: int) -> int:
        total = 0
        for r in range(rounds):
            q = QUESTIONS[(i + r * clients) % len(QUESTIONS)]
            answer = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0
            )
            assert answer.usage is not None
            total += answer.usage.completion_tokens
        return total

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(clients)))
    wall = time.perf_counter() - t0
    return tokens / wall, tokens, wall


def decode_level(base: str, clients: int, rounds: int, max_tokens: int, schema: bool) -> tuple[list[float], int]:
    """(each stream's decode tokens/s, tokens decoded) for ``clients`` concurrent greedy streams, each with
    ``response_format`` :data:`SCHEMA` when ``schema``."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=900)
    extra: dict[str, Any] = {}
    if schema:
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}

    def one(i: int) -> tuple[float, int]:
        q = QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON with a title, facts and a rating."
        first = last = None
        usage = reason = None
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **extra,
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    last = time.perf_counter()
                    first = first or last
                reason = c.finish_reason or reason
        assert usage is not None and first is not None and last is not None
        # tokens sampled after the first one, up to the last text (an end-of-sequence token shows none)
        decoded = usage - 1 - (1 if reason == "stop" else 0)
        return (decoded / (last - first) if last > first and decoded > 0 else 0.0), decoded

    results: list[tuple[float, int]] = []
    for r in range(rounds):
        with ThreadPoolExecutor(clients) as pool:
            results += pool.map(one, [i + r * clients for i in range(clients)])
    return [rate for rate, _ in results if rate > 0], sum(n for _, n in results)


def system_prompt(session: int, rules: int = 95) -> str:
    """About 2,000 tokens of instructions (95 rules: 1,989 to 1,991 with a question in SmolLM2's chat template),
    beginning with ``session``: no two sessions share a chunk."""
    body = " ".join(f"Rule {i}: answer politely and cite section {i} when asked about topic {i}." for i in range(rules))
    return f"Session {session}. {body}"


def prefix_ttft(base: str, rounds: int) -> tuple[list[float], list[float], list[float], int]:
    """Seconds to the first token, per round: (cold, warm, repeat) request times and the warm prompt's tokens."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=1800)

    def timed(system: str, question: str) -> tuple[float, int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        t0 = time.perf_counter()
        answer = client.chat.completions.create(model="m", messages=messages, max_tokens=1, temperature=0)
        assert answer.usage is not None
        return time.perf_counter() - t0, answer.usage.prompt_tokens

    cold, warm, repeat = [], [], []
    tokens = 0
    for r in range(rounds):
        system = system_prompt(r)
        cold.append(timed(system, QUESTIONS[r % len(QUESTIONS)])[0])
        took, tokens = timed(system, QUESTIONS[(r + 1) % len(QUESTIONS)])
        warm.append(took)
        repeat.append(timed(system, QUESTIONS[(r + 1) % len(QUESTIONS)])[0])
        print(
            f"    round {r}: cold {cold[-1]:.2f} s, warm {warm[-1]:.2f} s, repeat {repeat[-1]:.2f} s", file=sys.stderr
        )
    return cold, warm, repeat, tokens


def mask_cost(model: str, rows: int, steps: int) -> tuple[float, float, float]:
    """In this process, without HTTP: greedy batched decode of ``rows`` prompts under :data:`SCHEMA`, timing the
    grammar's work (mask the row's logits, accept its token) apart from the decode step. (mask ms per row-token,
    step ms per step, mask time / step time): the slowdown the mask adds to decode, robust to a busy host's noise
    as both are timed in the same steps."""
    import anyquant
    from anyquant_runtime.grammar import OutputFormat
    from anyquant_serve.batch import DecodeBatch
    from anyquant_serve.scheduler import ModelAdapter

    loaded = anyquant.load(model)
    adapter = ModelAdapter(loaded)
    gen = adapter.generator
    compiled = adapter.grammars().compile(OutputFormat.json_schema(SCHEMA))
    batch = DecodeBatch(loaded.module, gen.cache_kw, gen.device)
    suffix = " Answer in JSON with a title, facts and a rating."
    prompts = [adapter.encode([{"role": "user", "content": QUESTIONS[i % 8] + suffix}], True) for i in range(rows)]
    constraints = [adapter.grammars().constraint(compiled) for _ in prompts]
    last = []
    for key, (ids, c) in enumerate(zip(prompts, constraints, strict=True)):
        logits = batch.prefill(key, ids)[None].float()
        c.mask(logits)
        last.append(int(logits.argmax()))
        c.accept(last[-1])
    masked = 0
    step_s = mask_s = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = batch.step(last).float()
        step_s += time.perf_counter() - t0
        for i, c in enumerate(constraints):
            if c.terminated:  # done: the row goes on unconstrained, untimed
                last[i] = int(logits[i].argmax())
                continue
            row = logits[i : i + 1]
            t0 = time.perf_counter()
            c.mask(row)
            mask_s += time.perf_counter() - t0
            last[i] = int(row.argmax())  # what the sampler does with or without a grammar: not counted
            t0 = time.perf_counter()
            c.accept(last[i])
            mask_s += time.perf_counter() - t0
            masked += 1
    loaded.close()
    return mask_s / max(masked, 1) * 1e3, step_s / steps * 1e3, mask_s / step_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the levels this many times, interleaved (1, 4, 8, 1, 4, 8, ...), and report each level's median: "
        "a spell of other load on a shared host then hits every level alike",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    ap.add_argument("--llama-python", default="/root/llvenv/bin/python", help="a Python with llama-cpp-python[server]")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--schema-clients", default="1,8", help="levels of the json_schema rows")
    ap.add_argument("--schema-rounds", type=int, default=6, help="requests per client, with and without a schema")
    ap.add_argument("--schema-max-tokens", type=int, default=64)
    ap.add_argument("--skip-schema", action="store_true", help="no structured-output rows")
    ap.add_argument("--mask-steps", type=int, default=48, help="decode steps of the in-process mask timing")
    ap.add_argument("--skip-levels", action="store_true", help="only the structured-output rows")
    ap.add_argument("--prefix-chunks", default="512,256", help="--prefill-chunk of each prefix-cache server")
    ap.add_argument("--prefix-rounds", type=int, default=3, help="cold/warm/repeat requests per prefix-cache row")
    ap.add_argument("--skip-prefix", action="store_true", help="no prefix-cache rows")
    ap.add_argument("--prefix-only", action="store_true", help="only the prefix-cache rows")
    args = ap.parse_args()
    import anyquant

    model = str(anyquant.default_model())
    levels = [int(c) for c in args.clients.split(",")]
    servers: list[tuple[str, Any]] = [("anyquant serve", lambda port: start_anyquant(model, port, max(levels)))]
    llama_ok = not args.skip_llama and shutil.which(args.llama_python) is not None
    if llama_ok:
        servers.append(("llama_cpp.server", lambda port: start_llama(args.llama_python, model, port, args.threads)))
    rows: list[tuple[str, int, float, int, float]] = []
    schema_rows: list[tuple[int, float, int, float, int]] = []
    if args.skip_levels:
        servers = servers[:1]
    if args.prefix_only:
        servers, args.skip_schema, args.skip_levels = [], True, True
    for name, start in servers:
        port = free_port()
        proc = start(port)
        try:
            base = f"http://127.0.0.1:{port}"
            level(base, 1, 1, 4)  # warm-up: first-call costs out of the table
            samples: dict[int, list[tuple[float, int, float]]] = {n: [] for n in levels}
            for _ in range(args.repeats if not args.skip_levels else 0):
                for n in levels:
                    rate, tokens, wall = level(base, n, args.rounds, args.max_tokens)
                    samples[n].append((rate, tokens, wall))
                    print(f"  {name}: {n} clients: {rate:.1f} tok/s", file=sys.stderr, flush=True)
            for n, got in samples.items():
                if got:  # the median sample (the lower middle one of an even count)
                    rows.append((name, n, *sorted(got)[(len(got) - 1) // 2]))
            if name == "anyquant serve" and not args.skip_schema:
                decode_level(base, 1, 1, 8, True)  # warm-up: the tokenizer's vocabulary read, the schema compiled
                for n in (int(c) for c in args.schema_clients.split(",")):
                    rates: dict[bool, list[float]] = {False: [], True: []}
                    counts = {False: 0, True: 0}
                    for _ in range(args.schema_rounds):  # alternating: drift in the host's load hits both alike
                        for schema in (False, True):
                            got, count = decode_level(base, n, 1, args.schema_max_tokens, schema)
                            rates[schema] += got
                            counts[schema] += count
                    free, constrained = statistics.median(rates[False]), statistics.median(rates[True])
                    schema_rows.append((n, free, counts[False], constrained, counts[True]))
                    print(
                        f"  schema: {n} clients: {free:.1f} free, {constrained:.1f} json_schema tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            proc.terminate()
            proc.wait(60)
    prefix_rows: list[tuple[int, int, float, float, float]] = []
    for chunk in [] if args.skip_prefix else [int(c) for c in args.prefix_chunks.split(",")]:
        port = free_port()
        proc = start_anyquant(model, port, 4, "--prefill-chunk", str(chunk))
        try:
            print(f"  prefix cache, --prefill-chunk {chunk}:", file=sys.stderr, flush=True)
            cold, warm, repeat, tokens = prefix_ttft(f"http://127.0.0.1:{port}", args.prefix_rounds)
            median = statistics.median
            prefix_rows.append((chunk, tokens, median(cold), median(warm), median(repeat)))
        finally:
            proc.terminate()
            proc.wait(60)
    print(
        f"bundled model {Path(model).name}, greedy, max_tokens {args.max_tokens}, {args.rounds} requests per client"
        + (f", each level's median of {args.repeats} interleaved runs" if args.repeats > 1 else "")
    )
    if rows:
        print(f"{'server':<18} {'clients':>7} {'tok/s':>8} {'tokens':>7} {'wall s':>7} {'x 1 client':>10}")
    for name, n, rate, tokens, wall in rows:
        single = next(r[2] for r in rows if r[0] == name and r[1] == levels[0])
        print(f"{name:<18} {n:>7} {rate:>8.1f} {tokens:>7} {wall:>7.1f} {rate / single:>10.2f}")
    if not llama_ok and not args.skip_levels:
        print("(llama_cpp.server not run: no --llama-python with llama-cpp-python[server])")
    if not args.skip_schema:
        print("structured output: the grammar's mask timed in-process (no HTTP), greedy batched decode")
        print(f"{'rows':>7} {'mask ms/row-token':>17} {'step ms':>8} {'mask / step':>11}")
        for n in (int(c) for c in args.schema_clients.split(",")):
            per_token, step, share = mask_cost(model, n, args.mask_steps)
            print(f"{n:>7} {per_token:>17.3f} {step:>8.1f} {share:>10.1%}")
    if schema_rows:
        print(
            f"structured output: decode tok/s per stream (median), greedy, max_tokens {args.schema_max_tokens}, "
            f"{args.schema_rounds} rounds each"
        )
        print(f"{'clients':>7} {'free tok/s':>10} {'tokens':>7} {'schema tok/s':>12} {'tokens':>7} {'schema/free':>11}")
        for n, free, free_n, constrained, constrained_n in schema_rows:
            print(
                f"{n:>7} {free:>10.1f} {free_n:>7} {constrained:>12.1f} {constrained_n:>7} {constrained / free:>11.2f}"
            )
    if prefix_rows:
        print(
            "prefix cache: time to first token (non-streamed, max_tokens 1) under a new ~2,000-token system prompt "
            f"(cold), a second question under it (warm), that request again (repeat); median of {args.prefix_rounds}"
        )
        print(
            f"{'chunk':>5} {'tokens':>6} {'cold s':>7} {'warm s':>7} {'warm/cold':>9} {'repeat s':>8} {'repeat/cold':>11}"
        )
        for chunk, tokens, cold_s, warm_s, repeat_s in prefix_rows:
            print(
                f"{chunk:>5} {tokens:>6} {cold_s:>7.2f} {warm_s:>7.2f} {warm_s / cold_s:>9.3f} {repeat_s:>8.2f} "
                f"{repeat_s / cold_s:>11.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
