"""Packed layouts (anyquant_runtime.layouts): a format's linear describes its weight, the CPU engine
(``FastCPUPlan.convert``) checks and builds the fast module; formats hold no engine code.

The toy linears here belong to no format: a ``QuantLinearBase`` with a ``dequantize()`` and ``packed_layouts()``
gets the engine's module where its kernel runs (its output within the engine's tolerance of its own exact weight),
else its exact path with the reasons recorded. Kernel-dependent expectations branch on what runs here."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from anyquant_cpu import engine, kernels
from anyquant_cpu.engine import (
    FastCPUPlan,
    FastInt4Linear,
    PrepackedBf16Linear,
    bf16_head_status,
    fast_cpu_reasons,
    fast_linear,
    int4pack_status,
    layout_kinds_run,
    layout_unsupported,
    layouts_run,
)
from anyquant_cpu.kernels import lut
from anyquant_runtime.layouts import Affine4Blocks, Decoded, E4M3Groups, Int4Groups, Int8Blocks, Layout, Table4
from anyquant_runtime.qlinear import QuantLinearBase

ROOT = Path(__file__).resolve().parents[3]
#: the formats whose linears describe packed layouts (their src holds no CPU-engine code)
FORMATS = ("gptq", "awq", "compressed_tensors", "fp8", "bnb", "mlx", "mxfp4", "gguf")
#: relative to max |y|: torch's int4 kernel (bfloat16 activations), a bfloat16 copy; exact weights in float32
BF16_TOL = 2e-2
EXACT_TOL = 1e-5
#: the table kernel: exact weights and float32 activations, only the summation order differs
TABLE_TOL = 1e-4
#: bitsandbytes' nf4 values, rounded
NF4 = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379, 0.4407]
NF4 += [0.5626, 0.7230, 1.0]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _never() -> torch.Tensor:
    raise AssertionError("a refused layout's tensors are not formed")


class ToyTable(QuantLinearBase):
    """``w = bf16(table[q] * scale[o, i // 32])``: a 4-bit table format of no plugin."""

    packed_names = ("codes", "scales")
    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, n: int, k: int, *, seed: int = 0, extra: Sequence[str] = ()) -> None:
        super().__init__(k, n)
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.tensor(NF4)
        self.extra = extra
        self.formed = 0
        self.set_packed(
            torch.randn(n, generator=gen),
            codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
            scales=torch.rand(n, k // 32, generator=gen) + 0.5,
        )

    def dequantize(self) -> torch.Tensor:
        if self._weight is not None:  # dequantized mode: the packed tensors are dropped
            return self._weight
        w = self.table[self.codes.long()] * self.scales.repeat_interleave(32, dim=1)
        return w.to(torch.bfloat16)

    def _codes(self) -> torch.Tensor:
        self.formed += 1
        return self.codes

    def packed_layouts(self) -> list[Layout]:
        table = Table4(
            self.in_features,
            self.out_features,
            32,
            codes=self._codes,
            scales=self.scales,
            table=self.table,
            round_to=torch.bfloat16,
            bias=self._buffers.get("bias"),
        )
        return [table, *(Decoded(self) for _ in self.extra)]


class ToyInt4(QuantLinearBase):
    """``w = f16((q - z) * s)`` per group of 64 inputs: GPTQ's arithmetic in a format of no plugin."""

    packed_names = ("codes", "zeros", "scales")
    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor

    def __init__(self, n: int, k: int, *, bits: int = 4, group: int = 64) -> None:
        super().__init__(k, n)
        gen = torch.Generator().manual_seed(1)
        self.bits, self.group = bits, group
        self.set_packed(
            None,
            codes=torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8),
            zeros=torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.uint8),
            scales=(torch.rand(k // group, n, generator=gen) * 0.02 + 1e-3).half(),
        )

    def dequantize(self) -> torch.Tensor:
        z = self.zeros.repeat_interleave(self.group, 0).float()
        w = (self.codes.float() - z) * self.scales.repeat_interleave(self.group, 0).float()
        return w.half().t().contiguous()

    def packed_layouts(self) -> list[Layout]:
        return [
            Int4Groups(
                self.in_features,
                self.out_features,
                codes=self.codes if self.bits == 4 else _never,
                zeros=self.zeros,
                scales=self.scales,
                bits=self.bits,
                group_size=self.group,
            )
        ]


class Refusing(ToyTable):
    def __init__(self, why: str | Callable[[], list[Layout]]) -> None:
        super().__init__(64, 64)
        self.why = why

    def packed_layouts(self) -> list[Layout] | str:  # type: ignore[override]
        return self.why if isinstance(self.why, str) else self.why()


class Plain(QuantLinearBase):
    """A format that describes no layout: the default keeps it exact."""

    def dequantize(self) -> torch.Tensor:
        return torch.ones(self.out_features, self.in_features)


def _exact(layer: QuantLinearBase, x: torch.Tensor) -> torch.Tensor:
    bias = layer._buffers.get("bias")
    return F.linear(x, layer.dequantize().float(), bias)


# ---------------------------------------------------------------- (a) a layout that runs gets the engine's module


def test_a_table_layout_runs_on_the_table_kernel_or_its_exact_path() -> None:
    layer, plan = ToyTable(48, 128), FastCPUPlan(small_rows=4)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(2))
    want = _exact(layer, x)
    fast = plan.convert("toy", layer)
    if kernels.lut_available():
        assert type(fast).__name__ == "Lut4Linear" and plan.converted == 1 and not plan.fallback
        assert layer.formed == 1  # the codes formed once, for the layout that ran
        assert torch.equal(fast.dequantize(), layer.dequantize())  # type: ignore[operator]
        with torch.no_grad():
            assert _rel(fast(x[:3]), want[:3]) < TABLE_TOL  # decode: the kernel
            assert _rel(fast(x), want) < EXACT_TOL  # prompts: the exact weight
    else:
        assert fast is layer and layer.mode == "dequantized" and plan.converted == 0
        assert "table kernel" in plan.fallback["toy"] and layer.formed == 0
        with torch.no_grad():
            assert _rel(fast(x), want) < EXACT_TOL


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


class ToyMXFP4(QuantLinearBase):
    """``w = round_to(E2M1[q] * 2**e[o, i // 32])``: MXFP4 as a 4-bit table layout, of no plugin."""

    packed_names = ("codes", "exps")
    codes: torch.Tensor
    exps: torch.Tensor

    def __init__(self, n: int, k: int, *, table: Sequence[float] = E2M1, scale: float = 1.0, low: int = -8) -> None:
        super().__init__(k, n, compute_dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(5)
        self.table, self.scale = torch.tensor(table), scale
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        codes[0, :16] = 8  # E2M1's negative zero
        self.set_packed(None, codes=codes, exps=torch.randint(low, 3, (n, k // 32), generator=gen))

    def _scales(self) -> torch.Tensor:
        return torch.ldexp(torch.full(self.exps.shape, self.scale), self.exps.float())

    def dequantize(self) -> torch.Tensor:
        s = self._scales().repeat_interleave(32, dim=1)
        return (self.table[self.codes.long()] * s).to(torch.bfloat16)

    def packed_layouts(self) -> list[Layout]:
        return [Table4(self.in_features, self.out_features, 32, self.codes, self._scales, self.table, torch.bfloat16)]


def test_mxfp4_runs_as_ggml_blocks_on_the_block_kernel() -> None:
    """A table layout that is MXFP4 (E2M1, a power-of-two scale per 32) runs as GGML MXFP4 blocks where the block
    kernel is fast: its weights bit for bit (negative zeros included), decode within 1e-4 of the exact output with
    no bias, prompts exact. Any other table or scale stays on the table kernel."""
    from anyquant_cpu.engine import MXFP4BlockLinear, block_kernel_is_fast

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    layer = ToyMXFP4(96, 256)
    want = _exact(layer, x)
    fast = FastCPUPlan(small_rows=4).convert("mx", layer)
    if not block_kernel_is_fast():
        pytest.skip("the block kernel is not built (or not vectorized) here")
    assert type(fast) is MXFP4BlockLinear and fast.packed_bytes() == 96 * 256 // 32 * 17
    exact = layer.dequantize()
    assert torch.equal(fast.dequantize().view(torch.int16), exact.view(torch.int16))  # -0.0 kept
    with torch.no_grad():
        got = torch.cat([fast(x[i : i + 4]) for i in range(0, 64, 4)])  # decode: the kernel
        assert _rel(got, want) < 1e-4
        assert abs(float((got * want).sum() / (want * want).sum()) - 1) < 2e-6
        assert _rel(fast(x), want) < EXACT_TOL  # prompts: the exact weight
    for other in (ToyMXFP4(96, 256, scale=1.5), ToyMXFP4(96, 256, table=NF4), ToyMXFP4(96, 256, low=-140)):
        kept = FastCPUPlan(small_rows=4).convert("other", other)
        assert type(kept).__name__ == ("Lut4Linear" if kernels.lut_available() else "ToyMXFP4")


def test_the_first_layout_that_runs_wins() -> None:
    """[Table4, Decoded]: the table kernel where it is built, else a bfloat16 copy where that runs fast."""
    layer, plan = ToyTable(48, 64, extra=("decoded",)), FastCPUPlan(small_rows=4)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    want = _exact(layer, x)
    fast = plan.convert("toy", layer)
    if kernels.lut_available():
        assert type(fast).__name__ == "Lut4Linear"
    elif bf16_head_status()[0]:
        assert type(fast) is PrepackedBf16Linear and fast.source is layer
        with torch.no_grad():
            assert _rel(fast(x), want) < BF16_TOL
    else:
        assert fast is layer and "; " in plan.fallback["toy"]  # both layouts' reasons


def test_an_int4_layout_runs_on_torchs_int4_kernel() -> None:
    layer, plan = ToyInt4(96, 256), FastCPUPlan(small_rows=4)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    want = _exact(layer, x)
    fast = plan.convert("toy", layer)
    if not int4pack_status().available:
        assert fast is layer and plan.fallback["toy"] == int4pack_status().reason
        return
    assert type(fast) is FastInt4Linear and plan.converted == 1
    assert fast.group_size == 64 and fast.small_rows == 4
    assert torch.equal(fast.dequantize(), layer.dequantize())
    with torch.no_grad():
        assert _rel(fast(x[:2]), want[:2]) < BF16_TOL
        assert _rel(fast(x), want) < EXACT_TOL


def test_fast_linear_takes_the_plans_options() -> None:
    layer = ToyTable(32, 64)
    (layout,) = layer.packed_layouts()
    fast = fast_linear(layout, small_rows=7, prefill_dtype=torch.bfloat16, compute_dtype=torch.float16)
    if isinstance(fast, str):
        assert fast == layout_unsupported(layout) and not kernels.lut_available()
        return
    assert fast.small_rows == 7 and fast.prefill_dtype == torch.bfloat16
    assert fast.bias is not None and fast.bias.dtype == torch.float16
    assert layout_unsupported(layout) is None and fast_cpu_reasons(layer) is None


# ---------------------------------------------------------------- (b) no layout runs: the exact path, the reasons


def test_a_layers_own_reason_keeps_it_exact() -> None:
    layer, plan = Refusing("the packed tensors were dropped"), FastCPUPlan()
    x = torch.randn(2, 64)
    want = _exact(layer, x)
    out = plan.convert("model.layers.0.mlp.up_proj", layer)
    assert out is layer and layer.mode == "dequantized"
    assert plan.fallback == {"model.layers.0.mlp.up_proj": "the packed tensors were dropped"}
    assert plan.converted == 0 and plan.summary()["dequantized_layers"] == plan.fallback
    with torch.no_grad():
        assert torch.equal(out(x), want)


def test_refused_layouts_are_recorded_and_never_formed() -> None:
    """Rows the table kernel cannot take (48 is not a multiple of 32) and 3-bit integer groups: every layout's
    reason is recorded, joined, and no layout's tensors are formed."""
    bad_table = Table4(48, 64, 16, codes=_never, scales=_never, table=_never, round_to=torch.bfloat16)
    three_bit = Int4Groups(64, 64, codes=_never, zeros=_never, scales=_never, bits=3, group_size=32)
    layer, plan = Refusing(lambda: [bad_table, three_bit]), FastCPUPlan()
    assert plan.convert("toy", layer) is layer and layer.mode == "dequantized"
    reasons = plan.fallback["toy"].split("; ")
    assert len(reasons) == 2
    table_reason, int4_reason = reasons
    if kernels.lut_available():
        assert "rows of 48" in table_reason
    else:
        assert "not built" in table_reason
    if int4pack_status().available:
        assert "3-bit" in int4_reason and "4-bit" in int4_reason


def test_a_format_without_layouts_stays_exact() -> None:
    layer, plan = Plain(32, 8), FastCPUPlan()
    assert plan.convert("toy", layer) is layer and layer.mode == "dequantized"
    assert "describes no packed layout" in plan.fallback["toy"]
    assert fast_cpu_reasons(layer) == plan.fallback["toy"]


def test_the_layers_conveniences_ask_the_engine() -> None:
    """``fast_cpu_unsupported()``/``to_fast_cpu()`` on any QuantLinearBase: the engine's answer for that layer."""
    refused = Refusing("FP4 input activations (NVFP4 W4A4) run on the exact path")
    assert refused.fast_cpu_unsupported() == "FP4 input activations (NVFP4 W4A4) run on the exact path"
    with pytest.raises(ValueError, match="W4A4"):
        refused.to_fast_cpu()
    layer = ToyInt4(64, 128)
    if int4pack_status().available:
        assert layer.fast_cpu_unsupported() is None
        fast = layer.to_fast_cpu(small_rows=2)
        assert type(fast) is FastInt4Linear and fast.small_rows == 2


def test_a_layout_of_another_vocabulary_is_refused_loudly() -> None:
    with pytest.raises(TypeError, match="not a packed layout"):
        layout_unsupported(object())  # type: ignore[arg-type]


# ---------------------------------------------------------------- (c) a loader's count, from the layouts' metadata


def _kernels(monkeypatch: pytest.MonkeyPatch, *, block: bool, table: bool, fp8: bool, bf16: bool) -> None:
    """Which of the compiled kernels (and oneDNN's bfloat16 path) run here, as the engine asks."""
    monkeypatch.setattr(engine, "block_kernel_is_fast", lambda: block)
    monkeypatch.setattr(kernels, "lut_available", lambda: table)
    monkeypatch.setattr(lut, "fp8_kernel_runs", lambda: fp8)
    monkeypatch.setattr(engine, "bf16_head_status", lambda: (bf16, "" if bf16 else "no bfloat16 here"))


def test_layouts_run_counts_the_layers_the_engine_takes_from_their_metadata() -> None:
    """A loader describes its layers from the headers (tensor fields None) and core counts them, as it would convert
    them: integer groups where torch's int4 kernel runs and the groups fit, never 3-bit ones or groups of 16."""
    fits = Int4Groups(256, 64, None, None, None, group_size=64)
    three_bit = Int4Groups(256, 64, None, None, None, bits=3, group_size=64)
    small_groups = Int4Groups(256, 64, None, None, None, group_size=16)
    int4 = int4pack_status().available
    assert layouts_run([[fits]]) == int(int4)
    assert layouts_run([[fits], [three_bit], [small_groups], "its input activations are quantized"]) == int(int4)
    assert layouts_run([]) == 0
    if int4:
        assert layout_unsupported(fits, metadata_only=True) is None
        assert "4-bit" in str(layout_unsupported(three_bit, metadata_only=True))
        assert "multiple of 32" in str(layout_unsupported(small_groups, metadata_only=True))
        # no group size in the metadata: the groups are not known before the tensors
        assert "group_size" in str(layout_unsupported(Int4Groups(256, 64, None, None, None), metadata_only=True))


def test_layouts_run_follows_the_kernels_built_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kind counts where its kernel runs and its shapes fit; a layer counts once, by its first layout that runs
    (a table the kernel cannot take falls to its bfloat16 copy). Callables are never formed."""
    table = Table4(128, 48, 32, _never, _never, _never, torch.bfloat16)
    bad_table = Table4(48, 48, 16, _never, _never, _never, torch.bfloat16)  # rows of 48: not 32s
    eight = Int8Blocks(128, 48, 128, _never, _never, torch.bfloat16)
    affine = Affine4Blocks(128, 48, 64, _never, _never, _never)
    fp8 = E4M3Groups(128, 48, 128, None, None, torch.bfloat16, rows=128)
    odd_fp8 = E4M3Groups(200, 48, 200, None, None, torch.bfloat16)  # 200 inputs: not 16s
    layers: list[Sequence[Layout] | str] = [[table], [bad_table, Decoded(None)], [eight], [affine], [fp8], [odd_fp8]]

    _kernels(monkeypatch, block=False, table=False, fp8=False, bf16=False)
    assert layouts_run(layers) == 0
    assert layout_kinds_run(E4M3Groups, Decoded) == (
        False,
        "FP8 weights run on the compiled kernel's fp8_gemv, which has no vector path here (AVX512F); no bfloat16 here",
    )
    _kernels(monkeypatch, block=False, table=False, fp8=False, bf16=True)
    assert layouts_run(layers) == 1 and layout_kinds_run(E4M3Groups, Decoded) == (True, "")
    assert layout_kinds_run(Decoded) == (True, "") and not layout_kinds_run(Table4)[0]
    _kernels(monkeypatch, block=True, table=True, fp8=True, bf16=False)
    assert layouts_run(layers) == 4  # table, Q8_0, Q4_1, FP8; the 48-wide table and the 200-wide FP8 do not fit
    assert layout_kinds_run(Table4) == (True, "") and layout_kinds_run(Int8Blocks, Affine4Blocks) == (True, "")
    assert "rows of 48" in str(layout_unsupported(bad_table, metadata_only=True))
    _kernels(monkeypatch, block=True, table=True, fp8=True, bf16=True)
    assert layouts_run(layers) == 5


def test_the_metadata_check_leaves_the_tensor_checks_to_the_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scales float16 does not hold exactly: the layer counts (its metadata fits Q8_0 blocks), the conversion
    refuses it; a description without tensors cannot be built."""
    _kernels(monkeypatch, block=True, table=False, fp8=False, bf16=False)
    codes = torch.zeros(48, 64, dtype=torch.int8)
    inexact = Int8Blocks(64, 48, 32, codes, torch.full((48, 2), 1e-9), torch.float32)
    assert layout_unsupported(inexact, metadata_only=True) is None and layouts_run([[inexact]]) == 1
    assert "float16" in str(layout_unsupported(inexact))
    with pytest.raises(ValueError, match="metadata"):
        fast_linear(Int8Blocks(64, 48, 32, None, None, torch.float32))
    with pytest.raises(TypeError, match="not a packed layout"):
        layout_kinds_run(object)  # type: ignore[arg-type]


def test_ready_q8_0_blocks_are_taken_as_they_are() -> None:
    """An ``Int8Blocks`` that carries the format's own Q8_0 blocks runs them without forming its codes and scales
    again: the same weights as the codes' and scales' blocks, bit for bit."""
    from anyquant_cpu.engine import block_kernel_is_fast
    from anyquant_cpu.kernels.linear import q8_0_blocks

    if not block_kernel_is_fast():
        pytest.skip("the block kernel is not built (or not vectorized) here")
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(8))
    blocks = q8_0_blocks(w).view(48, 2, 34)
    codes = blocks[..., 2:].contiguous().view(torch.int8).flatten(1)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    ready = fast_linear(Int8Blocks(64, 48, 32, _never, _never, torch.float32, q8_0=lambda: blocks))
    packed = fast_linear(Int8Blocks(64, 48, 32, codes, scales, torch.float32))
    assert not isinstance(ready, str) and not isinstance(packed, str)
    assert torch.equal(ready.raw_blocks(), packed.raw_blocks()) and torch.equal(ready.dequantize(), packed.dequantize())


def _q4_0(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q4_0 blocks (18 bytes: a float16 ``d``, then weight ``i`` in the low and ``16 + i`` in the high nibble of
    byte ``i``) and their weight ``d * (q - 8)``."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, 1, generator=gen) * 0.1 + 0.01).to(torch.float16)
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen, dtype=torch.uint8)
    blocks = torch.cat([d.view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)], -1)
    return blocks.reshape(-1), (d.float() * (q.float() - 8)).reshape(rows, cols)


def _permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order (what a "llama" GGUF file stores)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_gguf_blocks_run_as_stored_else_repacked_with_q_k_rows_in_the_models_order() -> None:
    """``GGUFBlocks``: the GGUF-block kernel on the stored blocks (interleaved or in place), else (``as_stored=False``)
    Q4_0 repacked for torch's int4 kernel; permuted Q/K rows (``qk_heads``) come back in the model's order on every
    path (the interleaving copy's heads of 16s rows, else un-permuted first); other types have no int4 path."""
    from anyquant_cpu.engine import GGUFBlockLinear, GGUFInt4Linear
    from anyquant_runtime.layouts import GGUFBlocks

    rows, cols, heads = 128, 64, 4
    blocks, weight = _q4_0(rows, cols, 9)
    stored = _permute_qk(blocks.view(rows, -1), heads).reshape(-1)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    for qk_heads, data in ((None, blocks), (heads, stored), (16, _permute_qk(blocks.view(rows, -1), 16))):
        for as_stored, interleave in ((True, True), (True, False), (False, True)):
            lay = GGUFBlocks(cols, rows, "Q4_0", 2, data, qk_heads=qk_heads, as_stored=as_stored)
            fast = fast_linear(lay, small_rows=4, interleave=interleave)
            if isinstance(fast, str):
                assert not as_stored or not kernels.available(), fast
                assert as_stored or not int4pack_status().available
                continue
            assert type(fast) is (GGUFBlockLinear if as_stored and kernels.available() else GGUFInt4Linear)
            assert torch.equal(fast.dequantize(), weight), (qk_heads, as_stored, interleave)
            with torch.no_grad():
                assert _rel(fast(x), x @ weight.t()) < BF16_TOL
    eight = GGUFBlocks(64, 32, "Q8_0", 8, _never, as_stored=False)
    assert layout_unsupported(eight) == "Q8_0 has no int4 kernel"
    assert layouts_run([[GGUFBlocks(64, 32, "Q6_K", 14, None)]]) == 0  # 64 columns: not a super-block of 256


# ---------------------------------------------------------------- (d) the formats hold no engine code


def _format_sources() -> list[Path]:
    return [p for name in FORMATS for p in sorted((ROOT / "plugins" / name / "src").rglob("*.py"))]


def test_the_formats_write_no_cpu_engine_code() -> None:
    """The eight formats describe their layouts; the engine's methods and modules appear in none of their sources."""
    engine = re.compile(
        r"to_fast_cpu|fast_cpu_unsupported|PrepackedBf16Linear|Lut4Linear|E4M3Linear|FastInt4Linear|"
        r"q8_0_from_codes|q4_1_from_codes|BlockLinear"
    )
    sources = _format_sources()
    assert len(sources) > 6
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sources
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if engine.search(line)
    ]
    assert not found, found


def test_the_formats_loaders_hold_no_kernel_knowledge() -> None:
    """The loaders decide ``auto`` by describing their layers as layouts (:func:`layouts_run`): none of them asks
    whether a kernel is built or which shapes it takes."""
    kernel = re.compile(
        r"kernels\.|fp8_kernel_runs|lut_available|block_kernel_is_fast|bf16_head_status|unsupported_reason"
    )
    loaders = [ROOT / "plugins" / name / "src" for name in FORMATS]
    files = [p for src in loaders for p in sorted(src.glob("*/loader.py"))]
    assert len(files) == len(FORMATS)
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if kernel.search(line)
    ]
    assert not found, found


def test_importing_the_layouts_imports_no_torch() -> None:
    code = "import sys, anyquant_runtime.layouts\nassert 'torch' not in sys.modules\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_layout_classes_are_frozen_descriptions() -> None:
    layout = Int4Groups(64, 64, codes=_never, zeros=_never, scales=_never)
    with pytest.raises(AttributeError):
        layout.bits = 3  # type: ignore[misc]
    assert layout.bits == 4 and layout.group_size is None and layout.g_idx is None and layout.bias is None
    assert isinstance(Decoded(nn.Linear(2, 2)).source, nn.Linear)


def test_every_layout_is_named_among_the_kinds_backends_register() -> None:
    """Each layout class's ``kind`` is one of :data:`anyquant.protocols.LAYOUT_KINDS` (a registered backend's
    ``layouts``), and anyquant-cpu's ``cpu-fast`` registers every one of them."""
    import anyquant_cpu.plugin
    from anyquant import Registry
    from anyquant.protocols import LAYOUT_KINDS
    from anyquant_runtime import layouts

    kinds = {
        cls.kind
        for cls in (
            layouts.Int4Groups,
            layouts.Affine4Blocks,
            layouts.Int8Blocks,
            layouts.Table4,
            layouts.E4M3Groups,
            layouts.GGUFBlocks,
            layouts.Decoded,
        )
    }
    assert len(kinds) == 7 and kinds <= set(LAYOUT_KINDS)
    registry = Registry(entry_points=False, plugins=[("anyquant-cpu", anyquant_cpu.plugin)])
    assert kinds <= set(registry.backends()["cpu-fast"].layouts)
