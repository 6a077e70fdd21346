"""anyquant_cpu.engine: packing matches torch's int4 kernel, weights are exact, forward within tolerance."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from anyquant.errors import ParameterError
from anyquant_cpu import engine as fastcpu
from anyquant_cpu.engine import (
    FastCPUPlan,
    FastInt4Linear,
    contiguous_group_size,
    int4_codes_from_cols,
    int4_codes_from_rows,
    int4pack_status,
    kernel_group_size,
    pack_int4_blocked,
    unsupported_reason,
)
from anyquant_runtime.packing import pack_cols, pack_rows, unpack_cols, unpack_rows

needs_kernel = pytest.mark.skipif(not int4pack_status().available, reason=int4pack_status().reason)

#: the two paths' tolerances (max |y - y_ref| / max |y_ref|): bfloat16 kernel, float32 GEMM
FEW_ROWS_TOL = 2e-2
MANY_ROWS_TOL = 1e-5


def _case(
    k: int, n: int, group: int, *, seed: int = 0, scale_dtype: torch.dtype = torch.float16, shuffle: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """codes [K, N], zeros [G, N], scales [G, N], g_idx, and the reference weight [N, K] (the GPTQ rule)."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (groups, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).to(scale_dtype)
    g_idx = torch.arange(k) // group
    if shuffle:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    diff = (codes - zeros[g_idx]).to(torch.float32)
    ref = (diff * scales[g_idx].to(torch.float32)).to(scale_dtype).t().contiguous()
    return codes, zeros, scales, (g_idx.to(torch.int32) if shuffle else None), ref


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_codes_from_words_match_the_bit_unpackers() -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (64, 24), generator=gen, dtype=torch.int32)
    assert torch.equal(int4_codes_from_rows(pack_rows(codes, 4)).int(), unpack_rows(pack_rows(codes, 4), 4))
    assert torch.equal(int4_codes_from_cols(pack_cols(codes, 4)).int(), unpack_cols(pack_cols(codes, 4), 4))
    assert int4_codes_from_rows(pack_rows(codes, 4)).dtype == torch.uint8


@needs_kernel
@pytest.mark.parametrize("n", [64, 128, 192])
def test_our_packing_is_the_kernels_layout(n: int) -> None:
    codes = torch.randint(0, 16, (n, 96), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert torch.equal(pack_int4_blocked(codes.t(), int4pack_status().block_n), packed)


def test_group_helpers() -> None:
    assert kernel_group_size(64) == 64 and kernel_group_size(576) == 64 and kernel_group_size(512) == 256
    assert kernel_group_size(16) is None
    assert contiguous_group_size(None, 256, 4) == 64
    assert contiguous_group_size(torch.tensor([0, 1, 1, 0]), 4, 2) == 2
    assert contiguous_group_size(torch.tensor([0, 1, 1, 1]), 4, 2) is None
    status = fastcpu.Int4PackStatus(True, block_n=64)
    assert unsupported_reason(4, 256, 64, 64, status=status) is None
    assert "4-bit" in str(unsupported_reason(3, 256, 64, 64, status=status))
    assert "32" in str(unsupported_reason(4, 256, 64, 16, status=status))
    assert "unequal" in str(unsupported_reason(4, 256, 64, None, status=status))
    assert "cannot" in str(unsupported_reason(4, 256, 64, 64, status=fastcpu.Int4PackStatus(False, "cannot")))


@needs_kernel
@pytest.mark.parametrize(
    ("k", "n", "group", "shuffle", "scale_dtype"),
    [
        (256, 192, 64, False, torch.float16),
        (256, 192, 32, True, torch.float16),  # desc_act: permuted groups
        (128, 48, 128, False, torch.float16),  # N padded to the kernel's block
        (576, 64, 576, False, torch.float16),  # per-channel: the kernel repeats 64-wide groups
        (512, 64, 512, True, torch.bfloat16),
        (256, 64, 64, False, torch.float32),
    ],
)
def test_weights_exact_and_both_paths_within_tolerance(
    k: int, n: int, group: int, shuffle: bool, scale_dtype: torch.dtype
) -> None:
    codes, zeros, scales, g_idx, ref = _case(k, n, group, shuffle=shuffle, scale_dtype=scale_dtype)
    bias = torch.randn(n)
    layer = FastInt4Linear(codes, zeros, scales, g_idx, bias, small_rows=4)
    assert layer.dequantize().dtype == scale_dtype
    assert torch.equal(layer.dequantize(), ref)
    assert (layer.perm is not None) == (shuffle and group < k)  # one group needs no permutation
    x = torch.randn(2, 20, k)
    want = x @ ref.float().t() + bias
    assert _rel(layer(x), want) < MANY_ROWS_TOL  # 40 rows: dequantized float32 GEMM
    few = layer(x[:1, :3])
    assert few.shape == (1, 3, n) and few.dtype == torch.float32
    assert _rel(few, want[:1, :3]) < FEW_ROWS_TOL  # int4 kernel, bfloat16
    layer.prefill_dtype = torch.bfloat16
    assert _rel(layer(x), want) < FEW_ROWS_TOL


@needs_kernel
def test_other_compute_dtypes_and_casts_leave_packed_data_alone() -> None:
    codes, zeros, scales, _, ref = _case(128, 64, 32)
    layer = FastInt4Linear(codes, zeros, scales, compute_dtype=torch.bfloat16)
    x = torch.randn(5, 128)
    for rows in (1, 5):
        y = layer(x[:rows].to(torch.bfloat16))
        assert y.dtype == torch.bfloat16
        assert _rel(y, x[:rows] @ ref.float().t()) < FEW_ROWS_TOL
    before = {name: (b.dtype, b.clone()) for name, b in layer.named_buffers()}
    layer.half().to("cpu")
    for name, b in layer.named_buffers():
        assert b.dtype == before[name][0] and torch.equal(b, before[name][1]), name
    assert torch.equal(layer.dequantize(), ref)


@needs_kernel
def test_packed_memory_is_about_half_a_byte_per_weight() -> None:
    codes, zeros, scales, _, _ = _case(1536, 576, 64)
    layer = FastInt4Linear(codes, zeros, scales)
    assert layer.packed_bytes() / (1536 * 576) < 0.65


@needs_kernel
@pytest.mark.parametrize(
    ("case", "kept"),
    [
        ("fp16 scales, zeros 0..15", {"scale_residual": torch.int8}),  # 1 byte per group column, zeros derived
        ("fp16 scales, symmetric", {"scale_residual": torch.int8, "zeros": (1, 1)}),
        ("bf16 scales", {}),  # the kernel's own scales are exact
        ("fp32 scales, zeros 0..15", {"scales": torch.float32}),
        ("a zero scale", {"scale_residual": torch.int8, "zeros": (4, 64)}),  # zeros not recoverable there
        ("zeros up to 255", {"scale_residual": torch.int8, "zeros": (4, 64)}),
        ("fp16 scales near 65504", {"scale_residual": torch.int8}),  # bf16 65536: float16 inf, one ulp off
        ("fp16 subnormal scales", {"scale_residual": torch.int8}),
    ],
)
def test_exact_scales_and_zeros_kept_compactly_and_exactly(case: str, kept: dict[str, Any]) -> None:
    """The many-rows path's exact scales and zeros: only what ``scales_and_zeros`` cannot give back is
    kept, and the exact weight is bitwise the reference whichever way."""
    scale_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(case[:4], torch.float16)
    codes, zeros, scales, _, _ = _case(256, 64, 64, scale_dtype=scale_dtype, seed=3)
    if case == "fp16 scales, symmetric":
        zeros = torch.full_like(zeros, 8)
    elif case == "a zero scale":
        scales[1, 5] = 0
    elif case == "zeros up to 255":
        zeros = torch.randint(0, 256, zeros.shape, generator=torch.Generator().manual_seed(4))
    elif case == "fp16 scales near 65504":
        scales[0, 0] = 65504.0
    elif case == "fp16 subnormal scales":
        scales = (scales.float() * 2e-3).to(torch.float16)
        assert bool((scales.float().abs() < 6.1e-5).any())
    layer = FastInt4Linear(codes, zeros, scales)
    buffers = {n: b for n, b in layer.named_buffers() if n in ("scales", "scale_residual", "zeros")}
    assert {n: b.dtype if n != "zeros" else tuple(b.shape) for n, b in buffers.items()} == kept
    assert torch.equal(layer.exact_scales(), scales) and layer.exact_scales().dtype == scale_dtype
    assert torch.equal(layer.exact_zeros().expand_as(zeros), zeros.to(torch.uint8))
    ref = ((codes.view(4, 64, 64) - zeros.unsqueeze(1)).float() * scales.float().unsqueeze(1)).to(scale_dtype)
    assert torch.equal(layer.dequantize(), ref.view(256, 64).t())


@needs_kernel
def test_rejects_what_it_cannot_run() -> None:
    codes, zeros, scales, _, _ = _case(128, 64, 32)
    with pytest.raises(ValueError, match="unequal"):
        FastInt4Linear(codes, zeros, scales, torch.zeros(128, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match"):
        FastInt4Linear(codes, zeros[:, :32], scales)


def test_plan_options() -> None:
    auto = FastCPUPlan.from_options({"cpu_fast_prefill": "auto"}).prefill_dtype
    assert FastCPUPlan.from_options({}).prefill_dtype == auto  # the default
    assert FastCPUPlan.from_options({"cpu_fast_prefill": "float32"}).prefill_dtype == torch.float32
    assert FastCPUPlan.from_options({"cpu_fast_prefill": None}).prefill_dtype is None  # the compute dtype
    assert FastCPUPlan.from_options({"cpu_fast_prefill": "bfloat16"}).prefill_dtype == torch.bfloat16
    assert FastCPUPlan.from_options({"cpu_fast_small_rows": "8"}).small_rows == 8
    auto = FastCPUPlan.from_options({"cpu_fast_prefill": "auto"}).prefill_dtype
    assert auto == (torch.bfloat16 if fastcpu.bf16_gemm_is_fast() else None)
    with pytest.raises(ValueError, match="cpu_fast_prefill"):
        FastCPUPlan.from_options({"cpu_fast_prefill": "int8"})
    assert FastCPUPlan.from_options({}).head is True
    assert FastCPUPlan.from_options({"cpu_fast_head": "dense"}).head is False
    with pytest.raises(ParameterError, match="cpu_fast_head"):
        FastCPUPlan.from_options({"cpu_fast_head": "int8"})
    for rows in (0, -1, "x", 2.5, True):
        with pytest.raises(ParameterError, match="cpu_fast_small_rows"):
            FastCPUPlan.from_options({"cpu_fast_small_rows": rows})


def test_plan_reads_only_the_declared_options() -> None:
    """The options the backend registers (what load() accepts for cpu-fast) are exactly what the plan reads."""
    from anyquant_cpu.options import OPTIONS

    class Recorder(dict):  # type: ignore[type-arg]
        def get(self, key, default=None):  # type: ignore[no-untyped-def, override]
            read.add(key)
            return default

    read: set[str] = set()
    FastCPUPlan.from_options(Recorder())
    assert read == set(OPTIONS)


# --------------------------------------------------------------------------- the LM head

needs_bf16_head = pytest.mark.skipif(not fastcpu.bf16_head_status()[0], reason=fastcpu.bf16_head_status()[1])
needs_fast_head = pytest.mark.skipif(fastcpu.head_kind("auto")[0] is None, reason=fastcpu.head_kind("auto")[1])
#: the fast head's decode forms, each skipped where it cannot run
HEAD_FORMS = [
    pytest.param(kind, marks=pytest.mark.skipif(not fastcpu.head_status(kind)[0], reason=fastcpu.head_status(kind)[1]))
    for kind in ("bfloat16", "q8_0")
]
#: what install_fast_head records for each decode form
HEAD_NAMES = {"bfloat16": "bfloat16 prepacked", "q8_0": "Q8_0 blocks"}


def test_compact_keeps_every_value() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen)
    assert fastcpu._compact(w) is w  # float32 values: no narrower dtype holds them
    h = w.half().float()
    assert fastcpu._compact(h).dtype == torch.float16 and torch.equal(fastcpu._compact(h).float(), h)
    b = w.bfloat16().float()
    b[0, 0] = 2.0**100  # out of float16's range, exact in bfloat16
    assert fastcpu._compact(b).dtype == torch.bfloat16 and torch.equal(fastcpu._compact(b).float(), b)
    assert fastcpu._compact(w.half()).dtype == torch.float16


@pytest.mark.parametrize("decode", HEAD_FORMS)
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "in place"])
def test_fast_head_paths(decode: str, interleave: bool) -> None:
    if decode == "bfloat16" and not interleave:
        pytest.skip("interleave concerns the Q8_0 blocks only")
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(20000, 96, generator=gen) * 0.05).half().float()  # 3 slices of CHUNK_ROWS
    bias = torch.randn(20000, generator=gen)
    head = fastcpu.FastHead(fastcpu._compact(w), bias, small_rows=4, decode=decode, interleave=interleave)
    assert head.exact.dtype == torch.float16 and torch.equal(head.weight, w)
    x = torch.randn(2, 5, 96, generator=gen)  # 10 rows: the exact path
    ref = torch.nn.functional.linear(x, w, bias)
    assert head(x).shape == (2, 5, 20000) and _rel(head(x), ref) < MANY_ROWS_TOL
    few = head(x[:, :2])  # 4 rows: bfloat16, or the kernel on the Q8_0 copy
    assert _rel(few, ref[:, :2]) < FEW_ROWS_TOL and not torch.equal(few, ref[:, :2])
    top = ref[:, :2].topk(fastcpu.FastHead.EXACT_TOP // 2, dim=-1).indices  # recomputed from the exact weight
    torch.testing.assert_close(few.gather(-1, top), ref[:, :2].gather(-1, top), rtol=1e-5, atol=1e-5)
    if decode == "q8_0":  # the rest: the kernel's product on gguf's own Q8_0 blocks of the weight, bit for bit
        from gguf import GGMLQuantizationType, quants

        from anyquant_cpu import kernels

        blocks = torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0))
        assert head.packed_bytes() == w.numel() * 2 + blocks.numel()  # the float16 table and the Q8_0 copy
        want = kernels.gemv(x[:, :2].reshape(4, 96), blocks, "Q8_0", 20000, 96, passes=1) + bias
        rest = torch.ones_like(want, dtype=torch.bool).scatter_(-1, want.topk(64).indices, False)  # not recomputed
        assert rest.sum() == 4 * (20000 - 64) and torch.equal(few.reshape(4, -1)[rest], want[rest])
    assert head.half() is head and head.exact.dtype == torch.float16  # casts leave it alone
    with pytest.raises(RuntimeError, match="CPU only"):
        head.to("meta")


def _tiny_llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())  # a float16 checkpoint, loaded in float32
    return model


@pytest.mark.parametrize("kind", HEAD_FORMS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_install_fast_head(tied: bool, kind: str) -> None:
    model = _tiny_llama(tied)
    ids = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
        info = fastcpu.install_fast_head(model, small_rows=64, kind=kind)
        assert info == {
            "head": HEAD_NAMES[kind],
            **({"interleaved": True} if kind == "q8_0" else {}),
            "exact_dtype": "float16",
            "exact_in": "memory",
            "embedding_dtype": "float16",
            "embedding_in": "memory",
            "tied": tied,
        }
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(emb, fastcpu.CompactEmbedding) and isinstance(head, fastcpu.FastHead)
        assert (emb.table.data_ptr() == head.exact.data_ptr()) is tied  # one table when tied
        got = model(ids).logits  # 70 rows: exact embedding, exact head
        assert _rel(got, ref) < MANY_ROWS_TOL
        few = model(ids[:, :8]).logits  # the fast head's decode form
        assert _rel(few, ref[:, :8]) < FEW_ROWS_TOL


def test_head_kind_falls_back_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: Q8_0 blocks where the kernel runs, else bfloat16, else none (with both reasons)."""
    runs = {"q8_0": True, "bfloat16": True}
    monkeypatch.setattr(fastcpu, "head_status", lambda kind: (runs[kind], "" if runs[kind] else f"no {kind}"))
    monkeypatch.setattr(fastcpu, "block_kernel_is_fast", lambda: True)
    assert fastcpu.head_kind("auto") == ("q8_0", "") and fastcpu.head_kind("bfloat16") == ("bfloat16", "")
    runs["q8_0"] = False
    assert fastcpu.head_kind("auto") == ("bfloat16", "") and fastcpu.head_kind("q8_0") == (None, "no q8_0")
    runs["bfloat16"] = False
    assert fastcpu.head_kind("auto") == (None, "no q8_0; no bfloat16")
    runs["q8_0"] = True  # a kernel on its scalar path: auto does not take it, asked for it runs
    monkeypatch.setattr(fastcpu, "block_kernel_is_fast", lambda: False)
    assert fastcpu.head_kind("auto")[0] is None and fastcpu.head_kind("q8_0") == ("q8_0", "")
    assert fastcpu.head_kind("dense") == (None, "cpu_fast_head='dense'")
    with pytest.raises(ParameterError, match="cpu_fast_head"):
        fastcpu.FastCPUPlan.from_options({"cpu_fast_head": "float8"})


def test_install_fast_head_leaves_other_heads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_llama(True)
    monkeypatch.setattr(fastcpu, "head_status", lambda kind: (False, "no AMX"))
    assert fastcpu.install_fast_head(model, kind="bfloat16") == {"head": "dense", "reason": "no AMX"}
    monkeypatch.undo()
    if fastcpu.head_kind("auto")[0] is None:
        return
    model.lm_head = torch.nn.Identity()
    assert fastcpu.install_fast_head(model)["head"] == "dense"
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)


def _build_tiny(tmp_path: Any, *, keep: bool, tied: bool, tables: dict[str, Any] | None = None) -> torch.nn.Module:
    import json

    from anyquant.probe import Probe
    from anyquant.testing.tiny import make_tiny_dense
    from anyquant_runtime.build import build_model
    from anyquant_runtime.tensors import SafetensorsSource

    path = make_tiny_dense(tmp_path / "tiny", dtype="float16", tie_word_embeddings=tied)
    probe = Probe.open(path)
    config = json.loads((path / "config.json").read_text())
    return build_model(
        config,
        SafetensorsSource(probe),
        dtype=torch.float32,
        keep_embedding_dtype=keep,
        runtime="native",
        file_tables=tables,
    )


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_build_can_keep_the_embedding_16_bit(tmp_path: Any, tied: bool) -> None:
    kept = _build_tiny(tmp_path, keep=True, tied=tied)
    plain = _build_tiny(tmp_path / "b", keep=False, tied=tied)
    emb = kept.get_input_embeddings().weight
    assert emb.dtype == torch.float16 and plain.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(emb.float(), plain.get_input_embeddings().weight)
    assert (kept.get_output_embeddings().weight is emb) is tied
    others = [p for n, p in kept.named_parameters() if "embed_tokens" not in n and "lm_head" not in n]
    assert others and all(p.dtype == torch.float32 for p in others)


@needs_bf16_head
def test_halving_pieces() -> None:
    """The file-backed head's prepacked pieces: each half of what is left, the last two equal."""
    assert fastcpu._halving_pieces(49152, 4) == [(0, 24576), (24576, 12288), (36864, 6144), (43008, 6144)]
    assert fastcpu._halving_pieces(259, 4) == [(0, 128), (128, 64), (192, 67)]
    assert fastcpu._halving_pieces(100, 4) == [(0, 100)]
    for rows in (1, 64, 1000, 128256, 151936):
        pieces = fastcpu._halving_pieces(rows, 4)
        assert sum(c for _, c in pieces) == rows and all(c > 0 for _, c in pieces) and len(pieces) <= 4
        assert [s for s, _ in pieces] == [sum(c for _, c in pieces[:i]) for i in range(len(pieces))]


@needs_fast_head  # without a fast head the build keeps no 16-bit embedding for finish() to handle
@pytest.mark.parametrize("converted", [1, 0], ids=["fast head", "head stays dense"])
def test_plan_finish_takes_over_or_restores_a_kept_embedding(tmp_path: Any, converted: int) -> None:
    model = _build_tiny(tmp_path, keep=True, tied=True)
    ref = _build_tiny(tmp_path / "ref", keep=False, tied=True)
    plan = fastcpu.FastCPUPlan(small_rows=4)
    plan.converted = converted  # (no int4 layers in a dense model: pretend some ran, or none)
    assert plan.keeps_embedding_dtype()
    plan.finish(model, torch.float32)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits  # 20 rows > small_rows: the exact paths
    assert torch.equal(got, want)
    if converted:
        assert isinstance(model.get_input_embeddings(), fastcpu.CompactEmbedding)
        assert plan.head_info["head"] == HEAD_NAMES[str(fastcpu.head_kind("auto")[0])]
    else:
        assert model.get_input_embeddings().weight.dtype == torch.float32
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("kind", HEAD_FORMS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_file_tables_head_and_embedding_read_from_the_file(tmp_path: Any, tied: bool, kind: str) -> None:
    """The build leaves the embedding (and an untied head) in the file; the fast head and the embedding read
    them from there: the same logits, bit for bit, as with the tables in memory, and no table in memory."""
    from anyquant_runtime.tensors import FileRows

    tables: dict[str, Any] = {}
    model = _build_tiny(tmp_path, keep=True, tied=tied, tables=tables)
    assert set(tables) == ({"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"}))
    assert all(isinstance(t, FileRows) and t.dtype == torch.float16 for t in tables.values())
    assert model.get_input_embeddings().weight.is_meta and model.get_output_embeddings().weight.is_meta
    ref = _build_tiny(tmp_path / "ref", keep=True, tied=tied)
    infos = []
    for m, t in ((model, tables), (ref, None)):
        plan = fastcpu.FastCPUPlan(small_rows=4, head_kind=kind)
        plan.converted = 1
        plan.finish(m, torch.float32, tables=t)
        infos.append((plan.head_info["exact_in"], plan.head_info["embedding_in"]))
    assert infos == [("file", "file"), ("memory", "memory")]
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, fastcpu.CompactEmbedding) and isinstance(head, fastcpu.FastHead)
    assert emb.file is not None and head.file is not None and emb.table is None and head.exact is None
    assert (emb.file is head.file) is tied
    assert not any(b.is_meta for b in model.buffers()) and not any(p.is_meta for p in model.parameters())
    if kind == "bfloat16":
        assert head.packed_bytes() == head.out_features * head.in_features * 2  # the prepacked copy alone
        assert len(head.packed) == 3  # 259 rows: 128, 64, 67
    else:
        assert head.packed_bytes() == head.out_features * head.in_features // 32 * 34  # the Q8_0 copy alone
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)  # 20 rows: the exact paths
        assert torch.equal(model(ids[:, :3]).logits, ref(ids[:, :3]).logits)  # 3 rows: the decode copy
    assert torch.equal(head.weight, ref.get_output_embeddings().weight)
    assert torch.equal(emb.weight, ref.get_input_embeddings().weight)


@pytest.mark.parametrize("converted", [1, 0], ids=["fast head", "head stays dense"])
def test_file_tables_filled_when_no_fast_head_takes_them(tmp_path: Any, converted: int, monkeypatch: Any) -> None:
    """No fast head (no bfloat16 kernel, or no int4 layer): the tables left in the file are read in, tied
    parameters stay tied, and the model equals the plain build."""
    if converted:
        monkeypatch.setattr(fastcpu, "head_status", lambda kind: (False, "no AMX"))
    tables: dict[str, Any] = {}
    model = _build_tiny(tmp_path, keep=True, tied=True, tables=tables)
    ref = _build_tiny(tmp_path / "ref", keep=False, tied=True)
    plan = fastcpu.FastCPUPlan(small_rows=4)
    plan.converted = converted
    plan.finish(model, torch.float32, tables=tables)
    assert plan.head_info["head"] == "dense"
    weight = model.get_input_embeddings().weight
    assert not weight.is_meta and weight.dtype == torch.float32
    assert model.get_output_embeddings().weight is weight
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_file_rows(tmp_path: Any) -> None:
    import pickle

    from safetensors.torch import save_file

    from anyquant.errors import CheckpointError
    from anyquant.probe import Probe
    from anyquant_runtime.tensors import SafetensorsSource

    path = tmp_path / "t.safetensors"
    table = torch.randn(37, 24).to(torch.bfloat16)
    save_file({"a": torch.arange(5, dtype=torch.int32), "t": table, "v": torch.ones(3)}, str(path))
    source = SafetensorsSource(Probe.open(path))
    rows = source.file_rows("t")
    assert rows is not None and source.file_rows("a") is None and source.file_rows("v") is None  # 2-D floats only
    ids = torch.tensor([[0, 36, 5], [5, 1, 2]])
    assert torch.equal(rows.rows(ids), table[ids]) and torch.equal(rows.read_all(), table)
    assert torch.equal(rows.slice(30, 100), table[30:])
    assert torch.equal(pickle.loads(pickle.dumps(rows)).rows(ids), table[ids])
    with pytest.raises(IndexError):
        rows.rows(torch.tensor([37]))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 24 * 2 * 3])  # cut into the table's last rows
    with pytest.raises(CheckpointError, match="truncated"):
        rows.rows(torch.tensor([36]))
    assert torch.equal(rows.rows(torch.tensor([1])), table[1:2])


@needs_bf16_head
def test_prepacked_bf16_linear() -> None:
    """cpu-fast for formats with no int4-kernel layout: the source's weight in bfloat16, prepacked; the exact
    weight and the bias from the source."""

    class Source(torch.nn.Module):
        def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
            super().__init__()
            self.out_features, self.in_features = w.shape
            self.register_buffer("w", w)
            self.register_buffer("bias", b)

        def dequantize(self) -> torch.Tensor:
            return self.w

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    layer = fastcpu.PrepackedBf16Linear(Source(w, b))
    x = torch.randn(2, 5, 64, generator=g)
    want = torch.nn.functional.linear(x, w, b)
    got = layer(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    assert torch.equal(layer.dequantize(), w) and torch.equal(layer.bias, b)
    assert layer.packed_bytes() == 96 * 64 * 2
    with pytest.raises(RuntimeError, match="CPU only"):
        layer.to("meta")


def test_block_kernel_conversion_drops_each_layers_int4_forms_as_it_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``to_block_kernel`` converts a decoder layer at a time and lets go of its torch-int4 linears before the next
    layer's blocks are made (they are gone, not kept in a list to the end: a 1.1B W4A16 load peaked with the whole
    model in both forms), and every few layers hands the heap's free pages back; the converted layers hold the
    torch-int4 ones' weights bit for bit."""
    import gc
    import weakref

    from anyquant_cpu import kernels
    from anyquant_cpu.kernels.linear import GroupInt4BlockLinear

    if not kernels.available():
        pytest.skip("anyquant kernels not built")
    gen = torch.Generator().manual_seed(3)

    def int4(k: int, n: int) -> FastInt4Linear:
        codes = torch.randint(0, 16, (k, n), generator=gen)
        zeros = torch.randint(0, 16, (k // 32, n), generator=gen)
        return FastInt4Linear(codes, zeros, (torch.rand(k // 32, n, generator=gen) * 0.02).half())

    layers = torch.nn.ModuleList()
    for _ in range(6):
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        layer.self_attn.q_proj, layer.mlp.down_proj = int4(64, 32), int4(64, 64)
        layers.append(layer)
    model = torch.nn.Module()
    model.layers = layers
    before = [(layer.self_attn.q_proj.dequantize(), layer.mlp.down_proj.dequantize()) for layer in layers]
    seen: list[tuple[int, weakref.ref[Any]]] = []
    alive_at_each: list[int] = []
    trims: list[int] = []
    made = GroupInt4BlockLinear.from_fast.__func__  # type: ignore[attr-defined]

    def from_fast(cls: Any, layer: Any, interleave: bool = True) -> Any:
        index = next(i for i, lay in enumerate(layers) if layer in (lay.self_attn.q_proj, lay.mlp.down_proj))
        gc.collect()
        alive_at_each.append(sum(1 for i, ref in seen if i < index and ref() is not None))
        seen.append((index, weakref.ref(layer)))
        return made(cls, layer, interleave)

    monkeypatch.setattr(GroupInt4BlockLinear, "from_fast", classmethod(from_fast))
    monkeypatch.setattr("anyquant.plugin.release_free_heap", lambda: trims.append(len(seen)) or True)
    assert fastcpu.to_block_kernel(model)["gq4_layers"] == 12
    assert alive_at_each == [0] * 12  # no earlier layer's torch-int4 linear outlives its conversion
    from anyquant_runtime.build import TRIM_LAYERS

    assert trims == [2 * TRIM_LAYERS * (i + 1) for i in range(6 // TRIM_LAYERS)]
    for layer, (q, down) in zip(layers, before, strict=True):  # the same weights, bit for bit
        assert isinstance(layer.self_attn.q_proj, GroupInt4BlockLinear)
        assert torch.equal(layer.self_attn.q_proj.dequantize(), q)
        assert torch.equal(layer.mlp.down_proj.dequantize(), down)
