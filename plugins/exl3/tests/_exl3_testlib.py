"""Shared helpers for the EXL3 tests: literal scalar simulations of the CUDA kernels, random layers, and the
cached GPTQModel peer run."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import torch

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parents[2]
CACHE_DIR = Path(os.environ.get("ANYQUANT_FIXTURE_CACHE", REPO_ROOT / ".cache" / "test-fixtures")) / "exl3"
WORKER = TESTS_DIR / "peer_worker.py"

MARKERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}


# ------------------------------------------------------------------------------------------------------------
# literal scalar simulations (pure Python ints, written from the kernel sources, independent of the library)


def sim_pack_trellis_tile(idx: list[int], k: int) -> list[int]:
    """``pack_trellis_kernel<K>`` for one tile (256 indices) -> 16·K uint16 as stored (after ``SWAP16``)."""
    packed_size = 256 * k // 16
    s_packed = [0] * packed_size
    for t in range(16):  # 16 spans of 16 weights
        i, j, kk, buf = 16 * t, k * t, 32, 0
        for _ in range(16):
            v = idx[i] & ((1 << k) - 1)
            kk -= k
            buf |= v << kk
            buf &= 0xFFFFFFFF
            if kk <= 16:
                s_packed[j] = buf >> 16
                buf = (buf << 16) & 0xFFFFFFFF
                kk += 16
                j += 1
            i += 1
    out = []
    for t in range(packed_size // 2):  # uint32 view of shared memory (little endian), then SWAP16
        word = s_packed[2 * t] | (s_packed[2 * t + 1] << 16)
        swapped = ((word >> 16) | (word << 16)) & 0xFFFFFFFF
        out += [swapped & 0xFFFF, swapped >> 16]
    return out


def sim_dq_tile(u16: list[int], k: int) -> list[int]:
    """``dq<bits, cb>`` window extraction (``exl3_dq.cuh``) for every t_offset of one tile: 256 states."""
    nw = k * 256 // 32
    ptr = [u16[2 * t] | (u16[2 * t + 1] << 16) for t in range(nw)]
    states = []
    for t_offset in range(256):
        b0 = t_offset * k + k - 16 + 256 * k
        b1 = b0 + 16
        i0 = b0 // 32
        i1 = (b1 - 1) // 32
        s0 = (i1 + 1) * 32 - b1
        a = ptr[i0 % nw]
        b = ptr[i1 % nw]
        states.append((((a << 32) | b) >> s0) & 0xFFFF)  # __funnelshift_r(b, a, s0) & 0xffff (s0 < 32)
    return states


def _frac_d(i: int, ka: int, mask: int) -> int:
    return ka + ((mask >> (i & 15)) & 1)


def _frac_s(i: int, ka: int, mask: int, bpb: int) -> int:
    s = (i >> 4) * bpb
    for j in range((i & 15) + 1):
        s += _frac_d(j, ka, mask)
    return s


def sim_pack_frac_tile(idx: list[int], ka: int, mask: int = 0xAAAA) -> list[int]:
    """``pack_trellis_frac_kernel`` for one tile -> uint16 words as stored."""
    bpb = 16 * ka + bin(mask).count("1")
    nw = bpb // 2
    words = [0] * nw
    pos = 0
    for i in range(256):
        d = _frac_d(i, ka, mask)
        v = idx[i] & ((1 << d) - 1)
        for b in range(d - 1, -1, -1):
            if (v >> b) & 1:
                words[pos >> 5] |= 1 << (31 - (pos & 31))
            pos += 1
    out = []
    for w in words:
        out += [w & 0xFFFF, w >> 16]
    return out


def sim_unpack_frac_tile(u16: list[int], ka: int, mask: int = 0xAAAA) -> list[int]:
    """``unpack_trellis_frac_kernel`` (``frac_window(words, nw, frac_s(i) - 16)``) for one tile."""
    bpb = 16 * ka + bin(mask).count("1")
    nw = bpb // 2
    words = [u16[2 * t] | (u16[2 * t + 1] << 16) for t in range(nw)]
    ring = nw * 32
    out = []
    for i in range(256):
        start = (_frac_s(i, ka, mask, bpb) - 16) % ring
        wi, o = start >> 5, start & 31
        v = (words[wi] << 32) | words[(wi + 1) % nw]
        out.append((v >> (48 - o)) & 0xFFFF)
    return out


def fp16_round(x: float) -> float:
    """Round a double to the nearest fp16 (ties to even) and back."""
    return struct.unpack("<e", struct.pack("<e", x))[0]


def fp16_bits_value(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def sim_codebook(state: int, codebook: str) -> float:
    """``decode_3inst<cb>`` (``codebook.cuh``) for one state, fp16 result as a float."""
    if codebook in ("3inst", "mcg"):
        x = (state * 89226354 + 64248484) if codebook == "3inst" else state * 0xCBAC1FED
        x &= 0xFFFFFFFF
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        return fp16_round(fp16_bits_value(x & 0xFFFF) + fp16_bits_value(x >> 16))  # __hadd
    x = (state * 0x83DCD12D) & 0xFFFFFFFF
    total = 0x6400 + sum((x >> s) & 0xFF for s in (0, 8, 16, 24))  # __dp4a(x, 0x01010101, 0x6400)
    h = fp16_bits_value(total)
    return fp16_round(h * fp16_bits_value(0x1EEE) + fp16_bits_value(0xC931))  # __hfma (exact in double)


# ------------------------------------------------------------------------------------------------------------
# random layers


def random_layer(seed: int, k_pad: int, n_pad: int, k_bits: float, codebook: str = "3inst") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    words = int(16 * k_bits)
    tensors = {
        "trellis": torch.randint(-32768, 32768, (k_pad // 16, n_pad // 16, words), dtype=torch.int16, generator=gen),
        "suh": (torch.randn(k_pad, generator=gen) * 0.05).half(),
        "svh": (torch.randn(n_pad, generator=gen) * 1.5).half(),
    }
    if codebook in MARKERS:
        value = MARKERS[codebook]
        tensors[codebook] = torch.tensor(value - (1 << 32) if value >= 1 << 31 else value, dtype=torch.int32)
    return tensors


# ------------------------------------------------------------------------------------------------------------
# GPTQModel peer


def peer_available() -> bool:
    return importlib.util.find_spec("gptqmodel") is not None


def _peer_source() -> bytes:
    spec = importlib.util.find_spec("gptqmodel")
    if spec is None or not spec.submodule_search_locations:
        return b""
    root = Path(next(iter(spec.submodule_search_locations)))
    parts = []
    for rel in ("nn_modules/exllamav3_torch.py", "nn_modules/exllamav3.py", "version.py"):
        path = root / rel
        parts.append(path.read_bytes() if path.exists() else b"")
    return b"\0".join(parts)


def _cache_key(cases: dict[str, dict[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    h.update(WORKER.read_bytes())
    h.update(_peer_source())
    for case in sorted(cases):
        for name in sorted(cases[case]):
            t = cases[case][name].contiguous().reshape(-1)
            h.update(f"{case}.{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


def run_peer(cases: dict[str, dict[str, torch.Tensor]], timeout: int = 900) -> dict[str, torch.Tensor]:
    """Decode ``cases`` with GPTQModel in a subprocess; outputs cached by a hash of inputs and sources."""
    from safetensors.torch import load_file, save_file

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    out_path = CACHE_DIR / f"peer-{_cache_key(cases)}.safetensors"
    if not out_path.exists():
        in_path = CACHE_DIR / f"input-{os.getpid()}.safetensors"
        flat = {f"{c}.{n}": t.contiguous() for c, ts in cases.items() for n, t in ts.items()}
        save_file(flat, str(in_path), metadata={"cases": json.dumps(sorted(cases))})
        env = dict(os.environ, TORCH_COMPILE_DISABLE="1", GPTQMODEL_CPU_WORKERS="1")
        try:
            proc = subprocess.run(
                [sys.executable, str(WORKER), str(in_path), str(out_path)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
        finally:
            in_path.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise RuntimeError(f"peer worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return load_file(str(out_path))


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = max(float(b.abs().max()), 1e-30)
    return float((a.double() - b.double()).abs().max()) / scale


# ------------------------------------------------------------------------------------------------------------
# checkpoints


def exl2_from_dense(dense: Path, out: Path) -> dict[str, torch.Tensor]:
    """Pack every decoder linear of ``dense`` as EXL2 4-bit (groups of 32 rows, a random act-order) into the folder
    ``out``; returns each linear's decoded weight by its name."""
    import shutil

    from safetensors.torch import load_file, save_file

    from anyquant_exl3.exl2.dequant import decode_exl2, pack_exl2

    shutil.copytree(dense, out)
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    expected = {}
    for name in [n for n in state if ".layers." in n and n.endswith("proj.weight")]:
        w = state.pop(name)  # [out, in]
        n_out, k = w.shape
        n_pad = -(-n_out // 32) * 32
        perm = torch.randperm(k, generator=gen)
        wp = torch.zeros(k, n_pad)
        wp[:, :n_out] = w.t()[perm]
        groups = k // 32
        q_scale_max = wp.abs().reshape(groups, 32, n_pad).amax(dim=(1, 2)) / 8 + 1e-3
        codes = torch.full((groups, n_pad), 15, dtype=torch.int64)  # qscale 16: scale = q_scale_max
        scale = (q_scale_max.half().float() / 256 * 256)[:, None].repeat_interleave(32, 0)
        q = torch.clamp(torch.round(wp / scale) + 8, 0, 15).to(torch.int64)
        packed = pack_exl2(q, [4] * groups, [32] * groups, codes, q_scale_max, torch.argsort(perm))
        prefix = name.removesuffix(".weight")
        state.update({f"{prefix}.{key}": value for key, value in packed.items()})
        expected[prefix] = decode_exl2(
            **{k2: packed[k2] for k2 in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")},
            out_features=n_out,
        )
    (out / "model.safetensors").unlink()
    save_file(state, out / "output.safetensors")
    return expected
