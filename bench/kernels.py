"""Microbench: anyquant's GGUF-block GEMV (``torch.ops.anyquant.ggml_gemv``, int8 activations) against
torch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``, bfloat16 activations) on a 1.1B
Llama-shaped model's decode shapes (or SmolLM2-135M's: ``--shapes smollm2``), at 1 and 2 threads.
``--type GQ4``: the 4-bit shapes as GQ4 blocks (GPTQ / AWQ int4 repacked, what cpu-fast decodes them with
where the kernel is built) instead of Q4_0. ``--shapes kquants``: a Q4_K_M file's K-quants on the kernel (issue #42),
the 1.1B model's gate/up and down as Q4_0, Q4_K and Q6_K blocks in the kernel's interleaved form (as cpu-fast holds
them), against what cpu-fast ran them with before: torch's int4 kernel for Q4_K, a bfloat16 copy prepacked for
oneDNN for Q6_K (2 bytes a weight).

    python -m anyquant_cpu.kernels         # the kernel (built when anyquant-cpu is installed) loads?
    python bench/kernels.py [--threads 1,2] [--rows 1] [--type Q4_0|Q4_1|GQ4] [--shapes 1b|smollm2|kquants]

Each case cycles through enough copies of the weight (>= 256 MiB in all) that no call finds it in a cache,
as in a decode step that walks every layer. GB/s counts the weight bytes as stored (GGUF blocks: 18 bytes per
32 Q4_0 weights, 144 per 256 Q4_K, 210 per 256 Q6_K; torch's int4: 16 bytes of codes + 4 of bf16 scale and offset
per group of 32, i.e. 20; bfloat16: 2 bytes a weight), and
"% bound" divides by a torch copy's bandwidth (read + write) at the same thread count.
"""

from __future__ import annotations

import argparse
import time

import torch
from _measure import bandwidth

from anyquant_cpu import kernels

SHAPES = [  # (name, out rows N, in cols K, type)
    ("q/o 2048x2048", 2048, 2048, "Q4_0"),
    ("k/v 256x2048", 256, 2048, "Q4_0"),
    ("gate/up 5632x2048", 5632, 2048, "Q4_0"),
    ("down 2048x5632", 2048, 5632, "Q4_0"),
    ("head 49152x2048", 49152, 2048, "Q8_0"),
]
SMOLLM2 = [  # SmolLM2-135M: hidden 576, 9 heads of 64 (3 kv heads), intermediate 1536
    ("q/o 576x576", 576, 576, "Q4_0"),
    ("k/v 192x576", 192, 576, "Q4_0"),
    ("gate/up 1536x576", 1536, 576, "Q4_0"),
    ("down 576x1536", 576, 1536, "Q4_0"),
]
KQUANTS = [  # the 1.1B model's MLP shapes as a Q4_K_M file holds them (gate/up Q4_K, down Q4_K or Q6_K), and Q4_0
    ("gate/up 5632x2048", 5632, 2048, "Q4_0"),
    ("gate/up 5632x2048", 5632, 2048, "Q4_K"),
    ("gate/up 5632x2048", 5632, 2048, "Q6_K"),
    ("down 2048x5632", 2048, 5632, "Q4_0"),
    ("down 2048x5632", 2048, 5632, "Q4_K"),
    ("down 2048x5632", 2048, 5632, "Q6_K"),
]
POOL = 256 * 2**20


def random_blocks(n: int, k: int, type_name: str, gen: torch.Generator) -> torch.Tensor:
    _, size, weights = kernels.GGML_TYPES[type_name]
    raw = torch.randint(0, 256, (n, k // weights, size), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // weights, generator=gen) * 0.01 + 1e-3).to(torch.float16)
    at = 208 if type_name == "Q6_K" else 0  # the K-quants: random 6-bit scales (and mins), a float16 d (and dmin)
    raw[..., at : at + 2] = scales.unsqueeze(-1).view(torch.uint8)
    if type_name == "Q4_1":
        raw[..., 2:4] = (-8 * scales).unsqueeze(-1).view(torch.uint8)
    if type_name in ("Q4_K", "Q5_K"):  # dmin
        raw[..., 2:4] = scales.unsqueeze(-1).view(torch.uint8)
    if type_name == "GQ4":  # zero points 0..15, as float16
        zeros = torch.randint(0, 16, (n, k // 32), generator=gen).to(torch.float16)
        raw[..., 2:4] = zeros.unsqueeze(-1).view(torch.uint8)
    return raw.reshape(-1)


def timed(fn, calls: int, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn(0)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def case(name: str, n: int, k: int, type_name: str, rows: int, bw: float, interleave: bool = False) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    nbytes = kernels.block_nbytes(type_name, n, k)
    copies = max(2, -(-POOL // nbytes))
    pool = [random_blocks(n, k, type_name, gen) for _ in range(copies)]
    code = kernels.GGML_TYPES[type_name][0]
    if interleave:  # the kernel's interleaved form, as cpu-fast holds the blocks by default
        pool = [torch.ops.anyquant.ggml_interleave(b, code, n, k, True, 0) for b in pool]
        code += kernels.INTERLEAVED
    x = torch.randn(rows, k, generator=gen)
    out = []
    times = {}
    for passes in (2, 1):

        def ggml(i: int, passes: int = passes) -> None:
            torch.ops.anyquant.ggml_gemv(x, pool[i % copies], code, n, k, -1, passes)

        t = times[passes] = timed(ggml, 2 * copies)
        form = " (interleaved)" if interleave else ""
        out.append(
            f"| {name if passes == 2 else ''} {type_name} | ggml_gemv{form} passes={passes} | {t * 1e6:.0f} | "
            f"{nbytes / t / 1e9:.1f} | {nbytes / t / bw:.0%} |"
        )
    pool.clear()
    ours = times[2]
    if type_name in ("Q5_K", "Q6_K"):  # cpu-fast's path for them without the kernel: bfloat16 prepacked (oneDNN)
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        bbytes = w.nbytes
        bcopies = max(2, -(-POOL // bbytes))
        reorder, linear = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
        bpool = [reorder(w.clone(), None) for _ in range(bcopies)]
        xb = x.to(torch.bfloat16)

        def bf16(i: int) -> None:
            linear(xb, bpool[i % bcopies], None, "none", [], "").float()

        t = timed(bf16, 2 * bcopies)
        out.append(
            f"| | bfloat16 prepacked (oneDNN) | {t * 1e6:.0f} | {bbytes / t / 1e9:.1f} | {bbytes / t / bw:.0%} |"
            f" {t / ours:.2f}x passes=2's time |"
        )
        bpool.clear()
    if type_name in ("Q4_0", "Q4_1", "GQ4", "Q4_K"):  # Q4_K: cpu-fast's path for it without the kernel
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        sz = torch.rand(k // 32, n, 2, generator=gen).to(torch.bfloat16)
        tbytes = packed.nbytes + sz.nbytes
        tcopies = max(2, -(-POOL // tbytes))
        tpool = [(packed.clone(), sz.clone()) for _ in range(tcopies)]
        xb = x.to(torch.bfloat16)

        def torch_int4(i: int) -> None:
            p, s = tpool[i % tcopies]
            torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, 32, s).float()

        t = timed(torch_int4, 2 * tcopies)
        out.append(
            f"| | torch int4pack (bf16 x) | {t * 1e6:.0f} | {tbytes / t / 1e9:.1f} | {tbytes / t / bw:.0%} |"
            f" {t / ours:.2f}x passes=2's time |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", type=int, default=1, help="activation rows (decode: 1)")
    parser.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q4_1", "GQ4"], help="the 4-bit shapes' block type")
    parser.add_argument("--shapes", default="1b", choices=["1b", "smollm2", "kquants"])
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("anyquant kernels do not load: python -m anyquant_cpu.kernels says why")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bw = bandwidth()
        print(
            f"\n## {threads} thread(s), {args.rows} row(s); copy bandwidth {bw / 1e9:.1f} GB/s; "
            f"path {kernels.ISA_NAMES[kernels.isa()]}\n"
        )
        print("| shape | op | us | GB/s | % bound | |\n|---|---|---|---|---|---|")
        if args.shapes == "kquants":
            for name, n, k, type_name in KQUANTS:
                print("\n".join(case(name, n, k, type_name, args.rows, bw, interleave=True)), flush=True)
            continue
        for name, n, k, type_name in SHAPES if args.shapes == "1b" else SMOLLM2:
            type_name = args.type if type_name == "Q4_0" else type_name
            print("\n".join(case(name, n, k, type_name, args.rows, bw)), flush=True)


if __name__ == "__main__":
    main()
