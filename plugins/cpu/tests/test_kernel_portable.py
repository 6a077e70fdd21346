"""The kernel's portable library (built at install beside the native one: both sources compiled with their scalar
paths alone, ``ANYQUANT_PORTABLE``, as any architecture other than x86-64 compiles them: no intrinsic outside the x86
guards), loaded in a process of its own, runs every op and gives bit for bit what the native library's scalar path
(``isa=0``) gives on the same inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from anyquant_cpu import kernels

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.available() or not kernels.lut_available(), reason="anyquant kernels not built"),
]


def _cases() -> dict[str, tuple[str, torch.Tensor, torch.Tensor, int, int]]:
    """Deterministic inputs: name -> (type, activations [3, cols], blocks, rows, cols)."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"):
        _, size, per = kernels.GGML_TYPES[type_name][:3]
        rows, cols = 40, 512
        n = rows * cols // per
        raw = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=gen)
        halves = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2), "MXFP4": ()}
        if type_name == "MXFP4":  # E8M0 exponents around 2^0, and the subnormal scales of 0 and 1
            raw[:, 0] = torch.randint(118, 138, (n,), dtype=torch.uint8, generator=gen)
            raw[:2, 0] = torch.tensor([0, 1], dtype=torch.uint8)
        for at in halves.get(type_name, (0,)):  # float16 scales that are finite and moderate
            value = (torch.rand(n, generator=gen) - 0.3) * 1e-2
            raw[:, at : at + 2] = value.to(torch.float16).view(torch.uint8).view(n, 2)
        x = torch.randn(3, cols, generator=gen)
        out[type_name] = (type_name, x, raw.reshape(-1).contiguous(), rows, cols)
    return out


def _outputs() -> dict[str, torch.Tensor]:
    """Every op on :func:`_cases` by the scalar path of the library loaded in this process."""
    from anyquant_cpu.kernels.lut import lut4_codes

    got = {}
    for name, (type_name, x, blocks, rows, cols) in _cases().items():
        for passes in (1, 2):
            got[f"{name}.p{passes}"] = kernels.gemv(x, blocks, type_name, rows, cols, isa=0, passes=passes)
        got[f"{name}.deq"] = torch.ops.anyquant.ggml_dequantize(
            blocks, kernels.GGML_TYPES[type_name][0], rows, cols, torch.float32
        )
    gen = torch.Generator().manual_seed(11)
    codes = lut4_codes(torch.randint(0, 16, (24, 256), dtype=torch.uint8, generator=gen))
    scales = torch.rand(24, 256 // 32, generator=gen) + 0.1
    lut = torch.randn(16, generator=gen)
    x = torch.randn(2, 256, generator=gen)
    for rnd in (0, 1, 2):
        got[f"lut4.r{rnd}"] = torch.ops.anyquant.lut4_gemv(x, codes, scales, lut, 32, rnd, 0)
        got[f"lut4_dequant.r{rnd}"] = torch.ops.anyquant.lut4_dequant(codes, scales, lut, 32, rnd)
        table = torch.cat((lut, scales.reshape(-1)))
        got[f"lut4_cat.r{rnd}"] = torch.ops.anyquant.lut4_gemv_cat(x, [codes, codes], [table, table], [32, 32], rnd, 0)
    fp8 = torch.randint(0, 256, (24, 256), dtype=torch.uint8, generator=gen)
    fp8[(fp8 & 0x7F) == 0x7F] = 0  # no NaN codes
    got["fp8"] = torch.ops.anyquant.fp8_gemv(x, fp8, scales, 32, 0, 0)
    got["fp8_dequant"] = torch.ops.anyquant.fp8_dequant(fp8, scales, 32, 0)
    keys, values = torch.randn(2, 2, 40, 16, generator=gen).half(), torch.randn(2, 2, 40, 16, generator=gen).half()
    q, k, v = (
        torch.randn(2, 4, 16, generator=gen),
        torch.randn(2, 2, 16, generator=gen),
        torch.randn(2, 2, 16, generator=gen),
    )
    got["decode_attention"] = torch.ops.anyquant.decode_attention(q, k, v, [keys], [values], [30], 0, 0.25, 0)
    got["decode_attention.keys"] = keys
    return got


def _child(out: str) -> None:
    """In the portable process: load, report the paths and the outputs (a safetensors file, no pickle)."""
    from safetensors.torch import save_file

    assert kernels.portable()
    lib = kernels.library()
    assert lib is not None and lib.name == "_kernels_portable.so", lib
    assert kernels.available() and kernels.lut_available() and kernels.attention_available()
    got = _outputs()
    got["isa"] = torch.tensor([kernels.isa(), kernels.lut_isa()])
    save_file({k: v.contiguous() for k, v in got.items()}, out)


def test_the_portable_build_runs_every_op_as_the_scalar_path(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "portable.safetensors"
    env = {**os.environ, "ANYQUANT_KERNELS_PORTABLE": "1"}
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_kernel_portable as t; t._child({str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    portable = load_file(str(out))
    assert portable.pop("isa").tolist() == [0, 0]  # scalar paths only: no vector path compiled in
    here = _outputs()
    assert set(portable) == set(here)
    for name, value in here.items():
        assert bool(torch.isfinite(value).all()), name
        bits = torch.int16 if value.dtype == torch.float16 else torch.int32
        assert torch.equal(portable[name].view(bits), value.view(bits)), name  # bit for bit
    # and the outputs are real numbers of the right scale (not zeros): the scalar path against the exact weights
    x = _cases()["Q8_0"][1]
    exact = here["Q8_0.deq"].double()
    want = x.double() @ exact.T
    err = float((here["Q8_0.p2"].double() - want).abs().max()) / float(want.abs().max())
    assert 0 < float(want.abs().max()) and err < 1e-4, err
    assert np.isfinite(here["Q6_K.p2"].numpy()).all()
