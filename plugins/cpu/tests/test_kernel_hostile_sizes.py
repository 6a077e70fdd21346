"""The compiled ops check every argument (issue #44, item 2): each registered ``torch.ops.anyquant`` op is called with
hostile sizes (rows and columns whose byte count wraps int64, negative and zero sizes, tensors of the wrong size,
dtype, layout or device, out-of-range options) and must raise its own error (a ``RuntimeError`` from
``TORCH_CHECK`` naming the op), never crash, write out of bounds or fail later in an allocation.

``rows * (cols / 32) * block_bytes`` wrapping int64 let a 20-byte tensor pass as 2**62 + 1 rows of Q4_1 (20 * (2**62
+ 1) = 5 * 2**64 + 20), and ``ggml_interleave`` then wrote 2**59 groups into a 20-byte copy. A crash would kill
pytest, so the calls run in a child process (this file run as a script); a case that kills it is reported as a
failure and the child is started again after it.

Skipped where the kernel is not built (anyquant-cpu installed without it; ``make test`` requires it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from anyquant_cpu import kernels

#: 2**62 + 1 rows: times 20 bytes (Q4_1, GQ4) wraps int64 to 20; with two blocks a row, 18 (Q4_0) or 34 (Q8_0)
#: bytes a block wrap it to 36 and 68
WRAP = 2**62 + 1
Q4_0, Q4_1, Q8_0, GQ4 = 2, 3, 8, 100
#: the K-quants' super-blocks of 256 weights: 144 (Q4_K) and 176 (Q5_K) bytes times 2**62+1 rows of one super-block
#: wrap int64 to 144 and 176; Q6_K's 210 to 2**63 + 210 (negative as int64)
Q4_K, Q5_K, Q6_K = 12, 13, 14

#: ops with no argument (nothing to check)
NO_ARGUMENTS = {"kernel_isa", "kernel_threads", "lut_isa"}


def _u8(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def _x(cols: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols)


Case = tuple[str, str, Callable[[], Any], bool]  # (op, what, call, must raise)


def _cases() -> list[Case]:
    ops = torch.ops.anyquant
    gemv, cat = ops.ggml_gemv, ops.ggml_gemv_cat
    interleave, dequantize, rms = ops.ggml_interleave, ops.ggml_dequantize, ops.rms_norm
    q41 = _u8(4 * 20)  # 4 rows x 32 columns of Q4_1: a valid part
    cases: list[Case] = [
        # ggml_gemv(x, blocks, type, rows, cols, isa, passes)
        ("ggml_gemv", "20 bytes as 2**62+1 rows of Q4_1", lambda: gemv(_x(32), _u8(20), Q4_1, WRAP, 32, -1, 2), True),
        ("ggml_gemv", "36 bytes as 2**62+1 rows of Q4_0", lambda: gemv(_x(64), _u8(36), Q4_0, WRAP, 64, -1, 2), True),
        ("ggml_gemv", "68 bytes as 2**62+1 rows of Q8_0", lambda: gemv(_x(64), _u8(68), Q8_0, WRAP, 64, -1, 2), True),
        (
            "ggml_gemv",
            "20 bytes as 2**62+1 interleaved rows",
            lambda: gemv(_x(32), _u8(20), 1003, WRAP, 32, -1, 2),
            True,
        ),
        ("ggml_gemv", "cols 2**63-32", lambda: gemv(_x(32), _u8(18), Q4_0, 4, 2**63 - 32, -1, 2), True),
        ("ggml_gemv", "rows 2**63-1", lambda: gemv(_x(32), _u8(18), Q4_0, 2**63 - 1, 32, -1, 2), True),
        ("ggml_gemv", "negative rows", lambda: gemv(_x(32), q41, Q4_1, -4, 32, -1, 2), True),
        ("ggml_gemv", "zero rows", lambda: gemv(_x(32), _u8(0), Q4_1, 0, 32, -1, 2), True),
        ("ggml_gemv", "negative cols", lambda: gemv(_x(32), q41, Q4_1, 4, -32, -1, 2), True),
        ("ggml_gemv", "cols 48", lambda: gemv(_x(48), q41, Q4_1, 4, 48, -1, 2), True),
        ("ggml_gemv", "blocks a byte short", lambda: gemv(_x(32), q41[:-1], Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "float32 blocks", lambda: gemv(_x(32), torch.zeros(20), Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "int8 blocks", lambda: gemv(_x(32), q41.view(torch.int8), Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "strided blocks", lambda: gemv(_x(32), _u8(160)[::2], Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "x of another width", lambda: gemv(_x(64), q41, Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "0-dim x", lambda: gemv(torch.tensor(1.0), q41, Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "int64 x", lambda: gemv(torch.zeros(1, 32, dtype=torch.long), q41, Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "bool x", lambda: gemv(torch.zeros(1, 32, dtype=torch.bool), q41, Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "x on meta", lambda: gemv(_x(32).to("meta"), q41, Q4_1, 4, 32, -1, 2), True),
        ("ggml_gemv", "type -1", lambda: gemv(_x(32), q41, -1, 4, 32, -1, 2), True),
        ("ggml_gemv", "type 2**62", lambda: gemv(_x(32), q41, 2**62, 4, 32, -1, 2), True),
        ("ggml_gemv", "type 2003", lambda: gemv(_x(32), q41, 2003, 4, 32, -1, 2), True),
        ("ggml_gemv", "passes 3", lambda: gemv(_x(32), q41, Q4_1, 4, 32, -1, 3), True),
        ("ggml_gemv", "isa -2", lambda: gemv(_x(32), q41, Q4_1, 4, 32, -2, 2), True),
        ("ggml_gemv", "isa 2**40", lambda: gemv(_x(32), q41, Q4_1, 4, 32, 2**40, 2), True),
        # ggml_gemv_cat(x, blocks, types, rows, isa, passes)
        (
            "ggml_gemv_cat",
            "a part of 20 bytes as 2**62+1 rows",
            lambda: cat(_x(32), [_u8(20)], [Q4_1], [WRAP], -1, 2),
            True,
        ),
        (
            "ggml_gemv_cat",
            "parts whose rows add past int64",
            lambda: cat(_x(32), [_u8(20), _u8(20)], [Q4_1, GQ4], [WRAP, WRAP], -1, 2),
            True,
        ),
        ("ggml_gemv_cat", "lists of different lengths", lambda: cat(_x(32), [q41, q41], [Q4_1], [4, 4], -1, 2), True),
        ("ggml_gemv_cat", "no parts", lambda: cat(_x(32), [], [], [], -1, 2), True),
        ("ggml_gemv_cat", "negative rows", lambda: cat(_x(32), [q41], [Q4_1], [-4], -1, 2), True),
        ("ggml_gemv_cat", "0-dim x", lambda: cat(torch.tensor(1.0), [q41], [Q4_1], [4], -1, 2), True),
        ("ggml_gemv_cat", "float32 part", lambda: cat(_x(32), [torch.zeros(20)], [Q4_1], [4], -1, 2), True),
        ("ggml_gemv_cat", "passes 0", lambda: cat(_x(32), [q41], [Q4_1], [4], -1, 0), True),
        # ggml_interleave(blocks, type, rows, cols, forward, qk_heads)
        (
            "ggml_interleave",
            "20 bytes as 2**62+1 rows (the write past the copy)",
            lambda: interleave(_u8(20), Q4_1, WRAP, 32, True, 0),
            True,
        ),
        (
            "ggml_interleave",
            "36 bytes as 2**62+1 rows, back",
            lambda: interleave(_u8(36), Q4_0, WRAP, 64, False, 0),
            True,
        ),
        (
            "ggml_interleave",
            "68 bytes as 2**62+1 rows of Q8_0",
            lambda: interleave(_u8(68), Q8_0, WRAP, 64, True, 0),
            True,
        ),
        ("ggml_interleave", "an interleaved type", lambda: interleave(q41, 1003, 4, 32, True, 0), True),
        ("ggml_interleave", "negative qk_heads", lambda: interleave(_u8(16 * 20), Q4_1, 16, 32, True, -1), True),
        (
            "ggml_interleave",
            "qk_heads not dividing rows",
            lambda: interleave(_u8(16 * 20), Q4_1, 16, 32, True, 3),
            True,
        ),
        ("ggml_interleave", "qk_heads backwards", lambda: interleave(_u8(16 * 20), Q4_1, 16, 32, False, 1), True),
        ("ggml_interleave", "qk_heads 2**62", lambda: interleave(_u8(16 * 20), Q4_1, 16, 32, True, 2**62), True),
        ("ggml_interleave", "strided blocks", lambda: interleave(_u8(640)[::2], Q4_1, 16, 32, True, 0), True),
        ("ggml_interleave", "int8 blocks", lambda: interleave(q41.view(torch.int8), Q4_1, 4, 32, True, 0), True),
        ("ggml_interleave", "negative rows", lambda: interleave(q41, Q4_1, -4, 32, True, 0), True),
        # ggml_dequantize(blocks, type, rows, cols, dtype)
        (
            "ggml_dequantize",
            "20 bytes as 2**62+1 rows",
            lambda: dequantize(_u8(20), Q4_1, WRAP, 32, torch.float32),
            True,
        ),
        (
            "ggml_dequantize",
            "68 bytes as 2**62+1 rows of Q8_0",
            lambda: dequantize(_u8(68), Q8_0, WRAP, 64, torch.half),
            True,
        ),
        ("ggml_dequantize", "int32 out", lambda: dequantize(q41, Q4_1, 4, 32, torch.int32), True),
        ("ggml_dequantize", "negative cols", lambda: dequantize(q41, Q4_1, 4, -32, torch.float32), True),
        ("ggml_dequantize", "blocks a byte long", lambda: dequantize(_u8(81), Q4_1, 4, 32, torch.float32), True),
        # rms_norm(x, weight, eps)
        ("rms_norm", "x of another width", lambda: rms(_x(32), torch.ones(16), 1e-6), True),
        ("rms_norm", "0-dim x", lambda: rms(torch.tensor(1.0), torch.ones(1), 1e-6), True),
        ("rms_norm", "float64 x", lambda: rms(_x(16).double(), torch.ones(16), 1e-6), True),
        ("rms_norm", "2-D weight", lambda: rms(_x(32), torch.ones(2, 16), 1e-6), True),
        ("rms_norm", "eps nan", lambda: rms(_x(16), torch.ones(16), float("nan")), True),
        ("rms_norm", "eps -1", lambda: rms(_x(16), torch.ones(16), -1.0), True),
        ("rms_norm", "eps inf", lambda: rms(_x(16), torch.ones(16), float("inf")), True),
        ("rms_norm", "weight on meta", lambda: rms(_x(16), torch.ones(16, device="meta"), 1e-6), True),
    ]
    cases += _experts_cases()
    cases += _k_quant_cases()
    cases += _lut_cases()
    cases += _attention_cases()
    return cases


def _attention_cases() -> list[Case]:
    """``decode_attention``: starts past the buffer (2**62, negative), empty heads, rows the buffers do not hold, zero
    key heads, tensors on the meta device, a window of -1; and calls that fit (value heads of 1,024)."""
    if not kernels.attention_available():
        return []
    op = torch.ops.anyquant.decode_attention

    def att(**kw: Any) -> Callable[[], Any]:
        a = {"q": _x(64, 4).view(1, 4, 64), "k": _x(64, 2).view(1, 2, 64), "v": _x(64, 2).view(1, 2, 64)}
        a |= {"keys": [torch.zeros(1, 2, 8, 64)], "values": [torch.zeros(1, 2, 8, 64)], "starts": [3], "window": 0}
        a |= kw
        return lambda: op(a["q"], a["k"], a["v"], a["keys"], a["values"], a["starts"], a["window"], 0.125)

    wide, meta = torch.zeros(1, 2, 8, 1024), torch.zeros(1, 2, 8, 64, device="meta")
    return [
        ("decode_attention", "start 2**62", att(starts=[2**62]), True),
        ("decode_attention", "start -2**62", att(starts=[-(2**62)]), True),
        ("decode_attention", "value heads of 1024", att(v=_x(1024, 2).view(1, 2, 1024), values=[wide]), False),
        ("decode_attention", "empty value heads", att(v=torch.zeros(1, 2, 0), values=[torch.zeros(1, 2, 8, 0)]), True),
        ("decode_attention", "rows the buffers do not hold", att(q=_x(64, 8).view(2, 4, 64)), True),
        ("decode_attention", "zero key heads", att(k=torch.zeros(1, 0, 64), v=torch.zeros(1, 0, 64)), True),
        ("decode_attention", "buffers on meta", att(keys=[meta], values=[meta]), True),
        ("decode_attention", "window -1", att(window=-1), True),
        ("decode_attention", "no buffers", att(keys=[], values=[], starts=[]), True),
        ("decode_attention", "fits", att(), False),
    ]


def _k_quant_cases() -> list[Case]:
    """The K-quants: sizes that wrap int64 with their super-block sizes, columns not a multiple of 256."""
    ops = torch.ops.anyquant
    gemv, cat = ops.ggml_gemv, ops.ggml_gemv_cat
    interleave, dequantize = ops.ggml_interleave, ops.ggml_dequantize
    q4k = _u8(4 * 144)  # 4 rows x 256 columns of Q4_K: a valid part
    return [
        (
            "ggml_gemv",
            "144 bytes as 2**62+1 rows of Q4_K",
            lambda: gemv(_x(256), _u8(144), Q4_K, WRAP, 256, -1, 2),
            True,
        ),
        (
            "ggml_gemv",
            "176 bytes as 2**62+1 rows of Q5_K",
            lambda: gemv(_x(256), _u8(176), Q5_K, WRAP, 256, -1, 2),
            True,
        ),
        (
            "ggml_gemv",
            "210 bytes as 2**62+1 rows of Q6_K",
            lambda: gemv(_x(256), _u8(210), Q6_K, WRAP, 256, -1, 2),
            True,
        ),
        (
            "ggml_gemv",
            "144 bytes as 2**62+1 interleaved rows of Q4_K",
            lambda: gemv(_x(256), _u8(144), 1000 + Q4_K, WRAP, 256, -1, 2),
            True,
        ),
        ("ggml_gemv", "Q4_K cols 32", lambda: gemv(_x(32), _u8(4 * 18), Q4_K, 4, 32, -1, 2), True),
        ("ggml_gemv", "Q6_K cols 288", lambda: gemv(_x(288), _u8(4 * 210), Q6_K, 4, 288, -1, 2), True),
        ("ggml_gemv", "Q4_K cols 2**63-256", lambda: gemv(_x(256), q4k, Q4_K, 4, 2**63 - 256, -1, 2), True),
        ("ggml_gemv", "Q4_K blocks a byte short", lambda: gemv(_x(256), q4k[:-1], Q4_K, 4, 256, -1, 2), True),
        ("ggml_gemv", "Q4_K read as Q6_K", lambda: gemv(_x(256), q4k, Q6_K, 4, 256, -1, 2), True),
        ("ggml_gemv", "type 15 (Q8_K)", lambda: gemv(_x(256), q4k, 15, 4, 256, -1, 2), True),
        (
            "ggml_gemv_cat",
            "a Q8_0 part of 32 columns beside a Q4_K part",
            lambda: cat(_x(32), [_u8(34), q4k], [Q8_0, Q4_K], [1, 4], -1, 2),
            True,
        ),
        (
            "ggml_interleave",
            "176 bytes as 2**62+1 rows of Q5_K (the write past the copy)",
            lambda: interleave(_u8(176), Q5_K, WRAP, 256, True, 0),
            True,
        ),
        ("ggml_interleave", "an interleaved Q4_K", lambda: interleave(q4k, 1000 + Q4_K, 4, 256, True, 0), True),
        ("ggml_interleave", "Q6_K cols 32", lambda: interleave(_u8(8 * 210), Q6_K, 8, 32, True, 0), True),
        (
            "ggml_dequantize",
            "144 bytes as 2**62+1 rows of Q4_K",
            lambda: dequantize(_u8(144), Q4_K, WRAP, 256, torch.float32),
            True,
        ),
        ("ggml_dequantize", "Q6_K a byte long", lambda: dequantize(_u8(211), Q6_K, 1, 256, torch.float32), True),
        (
            "ggml_experts",
            "a Q4_K down of 32 columns",
            lambda: ops.ggml_experts(
                _x(256),
                torch.zeros(1, 1, dtype=torch.long),
                torch.ones(1, 1),
                [_u8(32 * 144), _u8(32 * 144), _u8(256 * 18)],
                [Q4_K, Q4_K, Q4_K],
                32,
                -1,
                2,
            ),
            True,
        ),
    ]


def _experts_cases() -> list[Case]:
    experts = torch.ops.anyquant.ggml_experts
    hidden, inter = 32, 32
    blocks = [_u8(inter * 34), _u8(inter * 34), _u8(hidden * 34)]  # one expert's gate, up, down: Q8_0
    types = [Q8_0] * 3
    x, index, weights = _x(hidden), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)

    def call(**kw: Any) -> Callable[[], Any]:
        args = {"x": x, "index": index, "weights": weights, "blocks": blocks, "types": types, "intermediate": inter}
        args.update(kw)
        return lambda: experts(
            args["x"],
            args["index"],
            args["weights"],
            args["blocks"],
            args["types"],
            args["intermediate"],
            -1,
            kw.get("passes", 2),
        )

    # empty blocks as a 2**57-wide intermediate over a 1,024-wide hidden: 2**57 x 32 blocks x 20 bytes wraps to 0
    wide = [_u8(0)] * 3
    return [
        (
            "ggml_experts",
            "empty blocks as a 2**57-wide intermediate",
            call(x=_x(1024), blocks=wide, types=[Q4_1] * 3, intermediate=2**57),
            True,
        ),
        ("ggml_experts", "intermediate 2**63-32", call(intermediate=2**63 - 32), True),
        ("ggml_experts", "negative intermediate", call(intermediate=-32), True),
        ("ggml_experts", "intermediate 48", call(intermediate=48), True),
        ("ggml_experts", "intermediate 0", call(intermediate=0), True),
        ("ggml_experts", "int32 index", call(index=index.int()), True),
        ("ggml_experts", "weights of another shape", call(weights=torch.ones(1, 2)), True),
        (
            "ggml_experts",
            "index rows not x's",
            call(index=torch.zeros(2, 1, dtype=torch.long), weights=torch.ones(2, 1)),
            True,
        ),
        ("ggml_experts", "1-D x", call(x=_x(hidden)[0]), True),
        ("ggml_experts", "float64 x", call(x=_x(hidden).double()), True),
        ("ggml_experts", "four blocks", call(blocks=[*blocks, blocks[0]], types=[*types, Q8_0]), True),
        ("ggml_experts", "types shorter", call(types=types[:2]), True),
        ("ggml_experts", "a block a byte short", call(blocks=[blocks[0][:-1], blocks[1], blocks[2]]), True),
        ("ggml_experts", "passes 0", call(passes=0), True),
        ("ggml_experts", "index on meta", call(index=index.to("meta")), True),
        # ids outside [0, experts) are transformers' mark for an expert held elsewhere: skipped, no error
        ("ggml_experts", "expert ids past the experts", call(index=torch.tensor([[2**62]])), False),
        ("ggml_experts", "negative expert ids", call(index=torch.tensor([[-(2**62)]])), False),
    ]


def _lut_cases() -> list[Case]:
    if not kernels.lut_available():
        return []
    lut4, fp8 = torch.ops.anyquant.lut4_gemv, torch.ops.anyquant.fp8_gemv
    x, codes, scales, table = _x(64), _u8(4 * 32).reshape(4, 32), torch.ones(4, 2), torch.zeros(16)
    weight = _u8(4 * 64).reshape(4, 64)

    def l4(**kw: Any) -> Callable[[], Any]:
        a = {"x": x, "codes": codes, "scales": scales, "lut": table, "group": 32, "round": 0, "isa": -1, **kw}
        return lambda: lut4(a["x"], a["codes"], a["scales"], a["lut"], a["group"], a["round"], a["isa"])

    def f8(**kw: Any) -> Callable[[], Any]:
        a = {"x": x, "weight": weight, "scales": scales, "group": 32, "round": 0, "isa": -1, **kw}
        return lambda: fp8(a["x"], a["weight"], a["scales"], a["group"], a["round"], a["isa"])

    def l4d(**kw: Any) -> Callable[[], Any]:
        a = {"codes": codes, "scales": scales, "lut": table, "group": 32, "round": 0, **kw}
        return lambda: torch.ops.anyquant.lut4_dequant(a["codes"], a["scales"], a["lut"], a["group"], a["round"])

    def f8d(**kw: Any) -> Callable[[], Any]:
        a = {"weight": weight, "scales": scales, "group": 32, "round": 0, **kw}
        return lambda: torch.ops.anyquant.fp8_dequant(a["weight"], a["scales"], a["group"], a["round"])

    out = torch.zeros(4, 64)

    def l4o(**kw: Any) -> Callable[[], Any]:
        a = {"codes": codes, "scales": scales, "lut": table, "group": 32, "round": 0, "out": out, **kw}
        return lambda: torch.ops.anyquant.lut4_dequant_out(
            a["codes"], a["scales"], a["lut"], a["group"], a["round"], a["out"]
        )

    def f8o(**kw: Any) -> Callable[[], Any]:
        a = {"weight": weight, "scales": scales, "group": 32, "round": 0, "out": out, **kw}
        return lambda: torch.ops.anyquant.fp8_dequant_out(a["weight"], a["scales"], a["group"], a["round"], a["out"])

    tab = torch.cat((table, scales.reshape(-1)))

    def l4c(**kw: Any) -> Callable[[], Any]:
        a = {"x": x, "codes": [codes, codes], "tables": [tab, tab], "groups": [32, 32], "round": 0, "isa": -1, **kw}
        return lambda: torch.ops.anyquant.lut4_gemv_cat(
            a["x"], a["codes"], a["tables"], a["groups"], a["round"], a["isa"]
        )

    return [
        ("lut4_gemv_cat", "fits", l4c(), False),
        ("lut4_gemv_cat", "no weight", l4c(codes=[], tables=[], groups=[]), True),
        ("lut4_gemv_cat", "a table short", l4c(tables=[tab, tab[:-1]]), True),
        ("lut4_gemv_cat", "a table long", l4c(tables=[tab, torch.cat((tab, tab))]), True),
        ("lut4_gemv_cat", "a 2-D table", l4c(tables=[tab, tab.view(2, -1)]), True),
        ("lut4_gemv_cat", "float64 table", l4c(tables=[tab, tab.double()]), True),
        ("lut4_gemv_cat", "groups shorter", l4c(groups=[32]), True),
        ("lut4_gemv_cat", "group 2**62", l4c(groups=[32, 2**62]), True),
        ("lut4_gemv_cat", "group 0", l4c(groups=[0, 32]), True),
        ("lut4_gemv_cat", "codes of another width", l4c(codes=[codes, _u8(4 * 16).reshape(4, 16)]), True),
        ("lut4_gemv_cat", "1-D codes", l4c(codes=[codes, _u8(128)]), True),
        ("lut4_gemv_cat", "int8 codes", l4c(codes=[codes, codes.view(torch.int8)]), True),
        ("lut4_gemv_cat", "float64 x", l4c(x=x.double()), True),
        ("lut4_gemv_cat", "round 3", l4c(round=3), True),
        ("lut4_gemv_cat", "isa 2**40", l4c(isa=2**40), True),
        # the buffer-writing forms: a bad ``out`` (shape, layout, dtype, device) and the inputs' own checks
        ("lut4_dequant_out", "fits", l4o(), False),
        ("lut4_dequant_out", "out rows not the codes'", l4o(out=torch.zeros(5, 64)), True),
        ("lut4_dequant_out", "out 1-D", l4o(out=torch.zeros(4 * 64)), True),
        ("lut4_dequant_out", "strided out", l4o(out=torch.zeros(4, 128)[:, ::2]), True),
        ("lut4_dequant_out", "int32 out", l4o(out=torch.zeros(4, 64, dtype=torch.int32)), True),
        ("lut4_dequant_out", "out on meta", l4o(out=out.to("meta")), True),
        ("lut4_dequant_out", "int8 codes", l4o(codes=codes.view(torch.int8)), True),
        ("lut4_dequant_out", "K 48", l4o(codes=_u8(4 * 24).reshape(4, 24), out=torch.zeros(4, 48)), True),
        ("lut4_dequant_out", "group 2**62", l4o(group=2**62), True),
        ("lut4_dequant_out", "round 3", l4o(round=3), True),
        ("fp8_dequant_out", "fits", f8o(), False),
        ("fp8_dequant_out", "out rows not the weight's", f8o(out=torch.zeros(3, 64)), True),
        ("fp8_dequant_out", "strided out", f8o(out=torch.zeros(4, 128)[:, ::2]), True),
        ("fp8_dequant_out", "float64 out", f8o(out=torch.zeros(4, 64, dtype=torch.float64)), True),
        ("fp8_dequant_out", "out on meta", f8o(out=out.to("meta")), True),
        ("fp8_dequant_out", "int8 weight", f8o(weight=weight.view(torch.int8)), True),
        ("fp8_dequant_out", "group 0", f8o(group=0), True),
        ("fp8_dequant_out", "round -1", f8o(round=-1), True),
        ("lut4_gemv", "1-D x", l4(x=_x(64)[0]), True),
        ("lut4_gemv", "float64 x", l4(x=x.double()), True),
        ("lut4_gemv", "strided x", l4(x=_x(128)[:, ::2]), True),
        ("lut4_gemv", "x on meta", l4(x=x.to("meta")), True),
        ("lut4_gemv", "int8 codes", l4(codes=codes.view(torch.int8)), True),
        ("lut4_gemv", "codes of another width", l4(codes=_u8(4 * 16).reshape(4, 16)), True),
        ("lut4_gemv", "strided codes", l4(codes=_u8(4 * 64).reshape(4, 64)[:, ::2]), True),
        ("lut4_gemv", "scales rows not the codes'", l4(scales=torch.ones(5, 2)), True),
        ("lut4_gemv", "float16 scales", l4(scales=scales.half()), True),
        ("lut4_gemv", "15-entry table", l4(lut=torch.zeros(15)), True),
        ("lut4_gemv", "float64 table", l4(lut=torch.zeros(16, dtype=torch.float64)), True),
        ("lut4_gemv", "group 0", l4(group=0), True),
        ("lut4_gemv", "group -16", l4(group=-16), True),
        ("lut4_gemv", "group 2**62", l4(group=2**62), True),
        ("lut4_gemv", "group 24", l4(group=24), True),
        ("lut4_gemv", "round 3", l4(round=3), True),
        ("lut4_gemv", "round -1", l4(round=-1), True),
        ("lut4_gemv", "isa 2**40", l4(isa=2**40), True),
        ("lut4_gemv", "isa -2", l4(isa=-2), True),
        ("lut4_gemv", "K 0", l4(x=_x(0), codes=_u8(0).reshape(4, 0), scales=torch.ones(4, 0)), True),
        ("lut4_gemv", "K 48", l4(x=_x(48), codes=_u8(4 * 24).reshape(4, 24)), True),
        ("fp8_gemv", "1-D x", f8(x=_x(64)[0]), True),
        ("fp8_gemv", "float16 x", f8(x=x.half()), True),
        ("fp8_gemv", "x on meta", f8(x=x.to("meta")), True),
        ("fp8_gemv", "int8 weight", f8(weight=weight.view(torch.int8)), True),
        ("fp8_gemv", "bool weight", f8(weight=weight.bool()), True),
        ("fp8_gemv", "float16 weight", f8(weight=torch.zeros(4, 64, dtype=torch.half)), True),
        ("fp8_gemv", "weight of another width", f8(weight=_u8(4 * 32).reshape(4, 32)), True),
        ("fp8_gemv", "strided weight", f8(weight=_u8(4 * 128).reshape(4, 128)[:, ::2]), True),
        ("fp8_gemv", "scales rows not the weight's", f8(scales=torch.ones(3, 2)), True),
        ("fp8_gemv", "group 0", f8(group=0), True),
        ("fp8_gemv", "group 2**62", f8(group=2**62), True),
        ("fp8_gemv", "round 7", f8(round=7), True),
        ("fp8_gemv", "isa 2**40", f8(isa=2**40), True),
        ("fp8_gemv", "isa -2", f8(isa=-2), True),
        ("lut4_dequant", "int8 codes", l4d(codes=codes.view(torch.int8)), True),
        ("lut4_dequant", "1-D codes", l4d(codes=_u8(64)), True),
        ("lut4_dequant", "strided codes", l4d(codes=_u8(4 * 64).reshape(4, 64)[:, ::2]), True),
        ("lut4_dequant", "codes on meta", l4d(codes=codes.to("meta")), True),
        ("lut4_dequant", "K 0", l4d(codes=_u8(0).reshape(4, 0), scales=torch.ones(4, 0)), True),
        ("lut4_dequant", "K 48", l4d(codes=_u8(4 * 24).reshape(4, 24)), True),
        ("lut4_dequant", "scales rows not the codes'", l4d(scales=torch.ones(5, 2)), True),
        ("lut4_dequant", "scales of 2**40 groups", l4d(scales=torch.ones(4, 1).expand(4, 2**40)), True),
        ("lut4_dequant", "15-entry table", l4d(lut=torch.zeros(15)), True),
        ("lut4_dequant", "group 2**62", l4d(group=2**62), True),
        ("lut4_dequant", "group 24", l4d(group=24), True),
        ("lut4_dequant", "round 3", l4d(round=3), True),
        ("fp8_dequant", "int8 weight", f8d(weight=weight.view(torch.int8)), True),
        ("fp8_dequant", "1-D weight", f8d(weight=_u8(64)), True),
        ("fp8_dequant", "weight on meta", f8d(weight=weight.to("meta")), True),
        ("fp8_dequant", "K 24", f8d(weight=_u8(4 * 24).reshape(4, 24)), True),
        ("fp8_dequant", "scales rows not the weight's", f8d(scales=torch.ones(3, 2)), True),
        ("fp8_dequant", "float16 scales", f8d(scales=scales.half()), True),
        ("fp8_dequant", "group 0", f8d(group=0), True),
        ("fp8_dequant", "group -32", f8d(group=-32), True),
        ("fp8_dequant", "round -1", f8d(round=-1), True),
    ]


def _run_cases(start: int) -> None:
    """The child: each case from ``start`` on, a line before it (so that a crash names it) and one with its outcome."""
    if not kernels.available():
        print("UNAVAILABLE", flush=True)
        return
    for index, (_, _, call, _) in enumerate(_cases()):
        if index < start:
            continue
        print(f"START {index}", flush=True)
        try:
            call()
        except Exception as exc:  # the outcome is reported here, judged by the parent
            outcome = {"raised": type(exc).__name__, "message": " ".join(str(exc).split())[:300]}
        else:
            outcome = {"raised": None, "message": ""}
        print("DONE " + json.dumps({"index": index, **outcome}), flush=True)


pytestmark = pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")


def _outcomes() -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Every case's outcome from child processes, and the cases that killed one (with how)."""
    outcomes: dict[int, dict[str, Any]] = {}
    crashes: dict[int, str] = {}
    start, total = 0, len(_cases())
    while start < total:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(start)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        started = start
        for line in done.stdout.splitlines():
            if line.startswith("START "):
                started = int(line.split()[1])
            elif line.startswith("DONE "):
                record = json.loads(line[5:])
                outcomes[record["index"]] = record
        if done.returncode == 0:
            break
        crashes[started] = f"exit status {done.returncode}: {done.stderr.strip()[-300:]}"
        start = started + 1
    return outcomes, crashes


def test_every_registered_op_is_covered() -> None:
    """Every op the library registers (but those without arguments) has hostile cases here."""
    registered = {
        name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("anyquant::")
    }
    covered = {op for op, *_ in _cases()}
    assert registered - NO_ARGUMENTS <= covered, sorted(registered - NO_ARGUMENTS - covered)


def test_every_op_refuses_hostile_sizes_without_crashing() -> None:
    outcomes, crashes = _outcomes()
    problems = []
    for index, (op, what, _, must_raise) in enumerate(_cases()):
        if index in crashes:
            problems.append(f"{op} / {what}: CRASHED ({crashes[index]})")
            continue
        got = outcomes.get(index)
        if got is None:
            problems.append(f"{op} / {what}: no outcome")
        elif must_raise and got["raised"] is None:
            problems.append(f"{op} / {what}: accepted")
        elif must_raise and not any(f"anyquant::{name}" in got["message"] for name in (op, op.removesuffix("_out"))):
            # the op's own check names it (an ``_out`` form shares its op's checks, which name that op); an
            # allocation failing after the checks passed does not
            problems.append(f"{op} / {what}: {got['raised']} not from the op's checks: {got['message']}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    _run_cases(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
