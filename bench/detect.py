"""Detection cost on a checkpoint shaped like a 70B model, against the bare cost of its headers.

Writes sparse safetensors shards (real headers, no data: the files have their full size on disk
but occupy none) for Llama-3-70B quantized with GPTQ 4-bit g128, and the same tensor layout with
tiny shapes. Prints a table: anyquant's detection (probe + every plugin's claim + resolution)
vs. reading and json-parsing every header with nothing else ("bare"), and vs. the safetensors
library's own Rust header parse listing every dtype and shape ("rust"). Goal: within 1.5x of the
bare cost, and the same time whatever the weight bytes.

Two columns split the probe: "checked" is :func:`anyquant.headers.read_safetensors_header` on
every shard (the parse plus the per-tensor checks the probe owes: known dtype, integer shape,
offsets inside the file, byte count, no overlap, no duplicate name) and nothing else; "probe" adds
the config files, the index, the suffix index and the directory's safety checks.

    python bench/detect.py [--repeat 20] [--shards 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from anyquant import Probe, Registry
from anyquant.headers import read_safetensors_header
from anyquant.testing.fixtures import write_safetensors

LAYERS, HIDDEN, INTER, VOCAB, KV = 80, 8192, 28672, 128256, 1024
LINEARS = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV),
    "self_attn.v_proj": (HIDDEN, KV),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTER),
    "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}


def layout(scale: int) -> dict[str, tuple[str, list[int]]]:
    """GPTQ 4-bit g128 tensors of a 70B Llama; ``scale`` divides every dimension (1 = real size)."""
    t: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("F16", [VOCAB // scale, HIDDEN // scale])}
    for i in range(LAYERS):
        for name, (k, n) in LINEARS.items():
            k, n = k // scale, n // scale
            p = f"model.layers.{i}.{name}"
            t[f"{p}.qweight"] = ("I32", [k // 8, n])
            t[f"{p}.qzeros"] = ("I32", [max(k // 128, 1), n // 8])
            t[f"{p}.scales"] = ("F16", [max(k // 128, 1), n])
            t[f"{p}.g_idx"] = ("I32", [k])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{i}.{norm}.weight"] = ("F16", [HIDDEN // scale])
    t["model.norm.weight"] = ("F16", [HIDDEN // scale])
    t["lm_head.weight"] = ("F16", [VOCAB // scale, HIDDEN // scale])
    return t


def write_checkpoint(root: Path, scale: int, shards: int) -> int:
    tensors = list(layout(scale).items())
    per = -(-len(tensors) // shards)
    for s in range(shards):
        part = dict(tensors[s * per : (s + 1) * per])
        write_safetensors(root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", part, {"format": "pt"})
    cfg = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "quantization_config": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "sym": True,
            "desc_act": False,
            "checkpoint_format": "gptq",
        },
    }
    (root / "config.json").write_text(json.dumps(cfg))
    return sum(f.stat().st_size for f in root.glob("*.safetensors"))


def bare(root: Path) -> None:
    for f in sorted(root.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            json.loads(fh.read(n))


def checked(root: Path) -> None:
    for f in sorted(root.glob("*.safetensors")):
        read_safetensors_header(f, f.name)


def rust_reference(root: Path) -> None:
    """The safetensors library's own header parse (Rust), listing every tensor's dtype and shape."""
    from safetensors import safe_open

    for f in sorted(root.glob("*.safetensors")):
        with safe_open(f, "np") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                sl.get_dtype(), sl.get_shape()


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm the page cache and imports
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--shards", type=int, default=9)
    args = ap.parse_args()
    reg = Registry()
    reg.formats()  # plugin discovery is a one-time cost, not detection's
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, scale in (("70B-shaped (sparse)", 1), ("same layout, tiny", 64)):
            root = Path(d) / label.split()[0].replace("-", "_") / str(scale)
            root.mkdir(parents=True)
            size = write_checkpoint(root, scale, args.shards)
            n_tensors = len(Probe.open(root).tensors)
            t_bare = timed(lambda root=root: bare(root), args.repeat)
            t_rust = timed(lambda root=root: rust_reference(root), args.repeat)
            t_checked = timed(lambda root=root: checked(root), args.repeat)
            t_probe = timed(lambda root=root: Probe.open(root), args.repeat)
            t_detect = timed(lambda root=root: reg.detect(Probe.open(root)), args.repeat)
            assert reg.detect(Probe.open(root)).format == "gptq"
            rows.append((label, size, n_tensors, t_bare, t_rust, t_checked, t_probe, t_detect))
    print(
        f"{'checkpoint':<22} {'bytes':>16} {'tensors':>8} {'bare ms':>9} {'rust ms':>8} {'checked ms':>11} "
        f"{'probe ms':>9} {'detect ms':>10} {'checked/bare':>13} {'detect/bare':>12} {'detect/rust':>12}"
    )
    for label, size, n, tb, tr, tc, tp, td in rows:
        print(
            f"{label:<22} {size:>16,} {n:>8} {tb * 1e3:>9.2f} {tr * 1e3:>8.2f} {tc * 1e3:>11.2f} {tp * 1e3:>9.2f} "
            f"{td * 1e3:>10.2f} {tc / tb:>12.2f}x {td / tb:>11.2f}x {td / tr:>11.2f}x"
        )
    print("bare: read + json.loads of every header; rust: safetensors.safe_open listing every dtype and shape")
    print("checked: read_safetensors_header on every shard (parse + per-tensor checks, nothing else)")
    big, tiny = rows[0][-1], rows[1][-1]
    print(
        f"detect time, 70B-shaped vs tiny files: {big / tiny:.2f}x (weight bytes ratio {rows[0][1] / rows[1][1]:,.0f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
