"""Aggregate tokens/s of ``anyquant serve`` at 1, 4 and 8 concurrent clients on the bundled model, against
llama.cpp's server (llama-cpp-python's ``llama_cpp.server``) on the same GGUF file, in the same run.

    python bench/serve.py [--clients 1,4,8] [--max-tokens 48] [--rounds 2] [--llama-python /root/llvenv/bin/python]

Each server runs in its own process on a free port; each client sends ``--rounds`` greedy chat completions in a
row (a different question each), through the official ``openai`` client. Aggregate tokens/s = completion
tokens of every answer / wall time of the whole level (prefill included; the prompts are short chat turns).
``llama_cpp.server`` is llama-cpp-python's server (one request at a time, no batching across requests); its AMX
buffer type crashes on some CPUs, so its model parameters are patched with ``use_extra_bufts=False``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
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


def start_anyquant(model: str, port: int, max_batch: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    srcs = [str(ROOT / "core" / "src"), *[str(p / "src") for p in sorted((ROOT / "plugins").iterdir())]]
    env["PYTHONPATH"] = os.pathsep.join([*srcs, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "anyquant.cli", "serve", model, "--port", str(port), "--model-name", "m"]
    cmd += ["--max-batch", str(max_batch)]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    ap.add_argument("--llama-python", default="/root/llvenv/bin/python", help="a Python with llama-cpp-python[server]")
    ap.add_argument("--skip-llama", action="store_true")
    args = ap.parse_args()
    import anyquant

    model = str(anyquant.default_model())
    levels = [int(c) for c in args.clients.split(",")]
    servers: list[tuple[str, Any]] = [("anyquant serve", lambda port: start_anyquant(model, port, max(levels)))]
    llama_ok = not args.skip_llama and shutil.which(args.llama_python) is not None
    if llama_ok:
        servers.append(("llama_cpp.server", lambda port: start_llama(args.llama_python, model, port, args.threads)))
    rows: list[tuple[str, int, float, int, float]] = []
    for name, start in servers:
        port = free_port()
        proc = start(port)
        try:
            base = f"http://127.0.0.1:{port}"
            level(base, 1, 1, 4)  # warm-up: first-call costs out of the table
            for n in levels:
                rate, tokens, wall = level(base, n, args.rounds, args.max_tokens)
                rows.append((name, n, rate, tokens, wall))
                print(f"  {name}: {n} clients: {rate:.1f} tok/s", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"bundled model {Path(model).name}, greedy, max_tokens {args.max_tokens}, {args.rounds} requests per client")
    print(f"{'server':<18} {'clients':>7} {'tok/s':>8} {'tokens':>7} {'wall s':>7} {'x 1 client':>10}")
    for name, n, rate, tokens, wall in rows:
        single = next(r[2] for r in rows if r[0] == name and r[1] == levels[0])
        print(f"{name:<18} {n:>7} {rate:>8.1f} {tokens:>7} {wall:>7.1f} {rate / single:>10.2f}")
    if not llama_ok:
        print("(llama_cpp.server not run: no --llama-python with llama-cpp-python[server])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
