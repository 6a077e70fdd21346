"""Memory-saving pieces of anyquant-gguf: packed embedding and tied head, chunked on-the-fly
linears, released file pages, the int4 (``cpu-fast``) path, and the load's peak RSS."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

import anyquant
from anyquant_cpu import kernels
from anyquant_gguf import qlinear
from anyquant_gguf.qlinear import (
    GGUFEmbedding,
    GGUFLinear,
    GGUFRows,
    GGUFTiedHead,
    chunked_linear,
    dequantize_blocks_torch,
    int4_codes_scales_offsets,
)
from anyquant_gguf.reader import UnsupportedGGUFType, open_gguf, release_pages
from tests.decoding import logits_after_prompt


def _raw(qtype: Q, shape: tuple[int, int], seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if qtype == Q.Q4_K:  # gguf has no Q4_K quantizer: random bytes with finite float16 d / dmin
        n = shape[0] * shape[1] // 256
        data = rng.integers(0, 256, (n, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        for offset in (0, 2):
            data[:, offset : offset + 2] = (
                (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
            )
        return torch.from_numpy(data).reshape(-1)
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    return torch.from_numpy(quantize(values, qtype)).reshape(-1)


# --------------------------------------------------------------------------- modules


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_embedding_equals_dequantized_rows(qtype: Q) -> None:
    shape = (40, 256)
    raw = _raw(qtype, shape, 1)
    table = dequantize_blocks_torch(raw, qtype, shape)
    emb = GGUFEmbedding(raw, qtype, shape)
    ids = torch.tensor([[0, 5, 39, 5], [1, 2, 3, 0]])
    out = emb(ids)
    assert out.shape == (2, 4, 256) and out.dtype == torch.float32
    assert torch.equal(out, table[ids])
    assert torch.equal(emb.dequantize(), table)
    assert GGUFEmbedding(raw, qtype, shape, dtype=torch.bfloat16)(ids).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bytes"):
        GGUFEmbedding(raw[:-1], qtype, shape)


def test_chunked_forward_equals_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = (300, 128)
    raw = _raw(Q.Q8_0, shape, 3)
    weight = dequantize_blocks_torch(raw, Q.Q8_0, shape)
    bias = torch.randn(300)
    monkeypatch.setattr(qlinear, "CHUNK_ABOVE", 1000)
    monkeypatch.setattr(qlinear, "CHUNK_WEIGHTS", 64 * 128)  # 5 slices, the last one short
    x = torch.randn(2, 7, 128)
    head = GGUFTiedHead(raw, Q.Q8_0, shape)
    torch.testing.assert_close(head(x), F.linear(x, weight), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head(x[:, :1]), F.linear(x[:, :1], weight), rtol=1e-6, atol=1e-6)
    lin = GGUFLinear(raw, Q.Q8_0, shape, bias=bias)
    torch.testing.assert_close(lin(x), F.linear(x, weight, bias), rtol=1e-6, atol=1e-6)
    assert lin(x).shape == (2, 7, 300)
    torch.testing.assert_close(chunked_linear(x, raw.view(300, -1), Q.Q8_0, shape, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_int4_codes_scales_offsets_are_exact(qtype: Q) -> None:
    shape = (64, 512)
    raw = _raw(qtype, shape, 4)
    codes, scales, offsets = int4_codes_scales_offsets(raw, qtype, shape)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scales.shape == offsets.shape == (64, 16)
    w = codes.reshape(64, 16, 32).to(torch.float32).mul_(scales.unsqueeze(-1)).add_(offsets.unsqueeze(-1))
    assert torch.equal(w.reshape(shape), dequantize_blocks_torch(raw, qtype, shape))


def _fast_or_skip() -> Any:
    fastcpu = pytest.importorskip("anyquant_cpu.engine")
    ok, reason = fastcpu.fast_cpu_capable()
    if not ok:
        pytest.skip(reason)
    return fastcpu


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_int4_linear(qtype: Q) -> None:
    _fast_or_skip()
    shape = (192, 512)
    raw = _raw(qtype, shape, 5)
    weight = dequantize_blocks_torch(raw, qtype, shape)
    lin = qlinear.gguf_int4_linear(raw, qtype, shape, bias=torch.ones(192), small_rows=4)
    assert torch.equal(lin.dequantize(), weight)  # the exact weight of the many-rows path
    x = torch.randn(32, 512)
    torch.testing.assert_close(lin(x), F.linear(x, weight) + 1, rtol=1e-5, atol=1e-5)
    few, ref = lin(x[:2]), F.linear(x[:2], weight) + 1  # the int4 kernel: bfloat16 activations
    assert float((few - ref).abs().max()) < 2e-2 * float(ref.abs().max())
    with pytest.raises(UnsupportedGGUFType):
        qlinear.gguf_int4_linear(_raw(Q.Q8_0, (32, 64), 6), Q.Q8_0, (32, 64))


def test_release_pages_keeps_values(tmp_path: Path) -> None:
    values = np.random.default_rng(7).standard_normal((512, 1024)).astype(np.float32)
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("a.weight", quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("b.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(tmp_path / "t.gguf")
    tensors = {t.name: torch.from_numpy(t.data.reshape(-1).view(np.uint8)) for t in reader.tensors}
    before = {name: t.clone() for name, t in tensors.items()}
    release_pages(reader, tensors["a.weight"])
    release_pages(reader, torch.zeros(3))  # not in the map: ignored
    release_pages(reader)
    for name, t in tensors.items():
        assert torch.equal(t, before[name])  # read back from the file


# --------------------------------------------------------------------------- a tiny tied model


@pytest.fixture()
def tiny_tied(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A random llama with a tied head, Q8_0 embedding and Q4_0/Q4_1/Q8_0 linears."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    names = {
        "embed_tokens": ("token_embd", Q.Q8_0),
        "norm": ("output_norm", Q.F32),
        "input_layernorm": ("attn_norm", Q.F32),
        "post_attention_layernorm": ("ffn_norm", Q.F32),
        "q_proj": ("attn_q", Q.Q4_1),
        "k_proj": ("attn_k", Q.Q4_1),
        "v_proj": ("attn_v", Q.Q4_0),
        "o_proj": ("attn_output", Q.Q4_1),
        "gate_proj": ("ffn_gate", Q.Q4_1),
        "up_proj": ("ffn_up", Q.Q4_0),
        "down_proj": ("ffn_down", Q.Q8_0),
    }
    writer = GGUFWriter(str(tmp_path / "tied.gguf"), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(128)
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        parts = hf_name.split(".")
        gguf, qtype = names[parts[-2]]
        name = f"{gguf}.weight" if parts[1] in ("embed_tokens", "norm") else f"blk.{parts[2]}.{gguf}.weight"
        array = value.float().numpy()
        if parts[-2] in ("q_proj", "k_proj"):  # llama.cpp's interleaved-pair rows
            array = array.reshape(4, 2, 8, 64).swapaxes(1, 2).reshape(64, 64)
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "tied.gguf", model


def _load(path: Path, backend: str, **extra: Any) -> Any:
    from anyquant_gguf.loader import GGUFLoader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GGUFLoader, "tokenizer", lambda self, probe, options: None)  # no vocabulary in the file
        return anyquant.load(path, backend=backend, device="cpu", **extra)


def test_packed_backend_keeps_embedding_and_head_packed(tiny_tied: tuple[Path, torch.nn.Module]) -> None:
    path, _ = tiny_tied
    dense = _load(path, "dequantized")
    packed = _load(path, "packed")
    assert packed.info["embedding"] == "packed" and dense.info["embedding"] == "dense"
    emb, head = packed.module.get_input_embeddings(), packed.module.get_output_embeddings()
    assert isinstance(emb, GGUFEmbedding) and isinstance(head, GGUFTiedHead)
    assert emb.qweight.data_ptr() == head.qweight.data_ptr()  # one copy of the tied table
    assert not any(p.numel() >= 128 * 64 for p in packed.module.parameters())  # nothing dense that size
    assert packed.module.config.tie_word_embeddings is False
    ids = torch.tensor([[1, 5, 9, 100, 127, 3, 4, 8]])
    with torch.no_grad():
        ref = dense.module(ids).logits
        torch.testing.assert_close(packed.module(ids).logits, ref, rtol=1e-5, atol=1e-5)
        dense_emb = _load(path, "packed", embedding="dense")
        assert dense_emb.info["embedding"] == "dense"
        assert isinstance(dense_emb.module.get_input_embeddings(), torch.nn.Embedding)
        torch.testing.assert_close(dense_emb.module(ids).logits, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="embedding="):
        _load(path, "packed", embedding="int3")


def test_cpu_fast_backend(tiny_tied: tuple[Path, torch.nn.Module]) -> None:
    _fast_or_skip()
    path, _ = tiny_tied
    dense = _load(path, "dequantized")
    fast = _load(path, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_prefill="float32")  # exact prompts
    from anyquant_cpu.engine import PrepackedBf16Linear, bf16_gemm_is_fast, bf16_head_status

    info = fast.info["cpu_fast"]
    q8 = {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}  # Q8_0: no int4 layout
    if kernels.available():  # the compiled GGUF-block kernel reads Q4_0 and Q8_0 alike (interleaved at load)
        assert (info["converted"], info["interleaved"], info["dequantized"], info["bf16"]) == (14, 14, {}, {})
    elif bf16_head_status()[0]:  # host-dependent: AMX / AVX512-BF16 -> bfloat16 prepacked, 2 bytes per weight
        assert info["converted"] == 12
        assert info["bf16"] == dict.fromkeys(q8, "Q8_0") and not info["dequantized"]
        for name in q8:
            layer = fast.module.get_submodule(name)
            assert isinstance(layer, PrepackedBf16Linear) and isinstance(layer.source, GGUFLinear)
            assert (
                layer.source.weight_cache is None
                and layer.packed_bytes() == 2 * layer.source.qweight.numel() // 34 * 32
            )
            x = torch.randn(1, layer.in_features)
            want = F.linear(x.bfloat16(), layer.dequantize().bfloat16()).float()  # the bfloat16 product
            torch.testing.assert_close(layer(x), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
            long = torch.randn(5, layer.in_features)  # over small_rows: the exact float32 path
            assert torch.equal(layer(long), layer.source(long))
    else:
        assert info["converted"] == 12
        assert set(info["dequantized"]) == q8 and not info["bf16"]
        assert "Q8_0" in info["dequantized"]["model.layers.0.mlp.down_proj"]
    ids = torch.tensor([[1, 5, 9, 100, 127, 3, 4, 8]])  # 8 rows > small_rows: the prompt path
    with torch.no_grad():
        ref = dense.module(ids).logits
        torch.testing.assert_close(fast.module(ids).logits, ref, rtol=1e-5, atol=1e-5)
        few = fast.module(ids[:, :2]).logits  # the int4 kernel (bfloat16) or the GGUF-block kernel
        assert float((few - ref[:, :2]).abs().max()) < 5e-2 * float(ref.abs().max())
        default = _load(path, "cpu-fast", cpu_fast_small_rows=4)  # prompts: a bfloat16 GEMM where it is fast
        assert default.info["cpu_fast"]["prefill_dtype"] == ("bfloat16" if bf16_gemm_is_fast() else "compute dtype")
        assert fast.info["cpu_fast"]["prefill_dtype"] == "float32"
        auto = default.module(ids).logits
        assert float((auto - ref).abs().max()) < 5e-2 * float(ref.abs().max())
    assert _load(path, "cpu-fast", embedding="packed").info["embedding"] == "packed"


@pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")
def test_block_kernel_on_the_file_s_blocks(tiny_tied: tuple[Path, torch.nn.Module]) -> None:
    """cpu-fast with the compiled GGUF-block kernel: every Q4_0/Q4_1/Q8_0 linear holds the file's blocks in the
    kernel's interleaved form (``cpu_fast_interleave=False``: the file's bytes, read in place) and the tied Q8_0
    head reads the file's; both forms give bitwise the same logits, the TorchScript decode step calls the kernel and
    equals the module path bit for bit, decode stays close to the exact weights and its greedy tokens are theirs."""
    from anyquant_cpu import step as step_mod
    from anyquant_cpu.engine import FastHead
    from anyquant_cpu.kernels.linear import BlockLinear
    from anyquant_cpu.step import DecodeStep

    path, _ = tiny_tied
    dense = _load(path, "dequantized")
    fast = _load(path, "cpu-fast", cpu_fast_small_rows=4)
    layers = fast.module.model.layers
    linears = [m for m in fast.module.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 14 and {m.type_name for m in linears} == {"Q4_0", "Q4_1", "Q8_0"}
    head = fast.module.get_output_embeddings()
    assert isinstance(head, FastHead) and type(head).__name__ == "GGUFBlockHead" and head.packed == []
    import gguf

    stock = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")  # gguf's own reader
    down = torch.from_numpy(np.array(stock.data)).view(torch.uint8)
    assert all(m.interleaved for m in linears)
    assert torch.equal(layers[0].mlp.down_proj.raw_blocks(), down.reshape(-1))  # the file's blocks, given back
    assert not torch.equal(layers[0].mlp.down_proj.blocks, down.reshape(-1))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    got = logits_after_prompt(fast, ids, 6)
    in_place = _load(path, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_interleave=False)
    assert in_place.info["cpu_fast"]["in_place"] == 14
    assert torch.equal(in_place.module.model.layers[0].mlp.down_proj.blocks, down.reshape(-1))  # the file's bytes
    stock_q = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    q_rows = torch.from_numpy(np.array(stock_q.data)).view(torch.uint8)  # as stored: permuted, 4 heads of 16 rows
    q_hf = q_rows.reshape(4, 8, 2, -1).transpose(1, 2).reshape(-1)  # llama.cpp's permutation undone
    assert not torch.equal(q_hf, q_rows.reshape(-1))
    # Q/K: the interleaving copy reads the permuted rows in HF order itself (no un-permuted copy first)
    assert torch.equal(layers[0].self_attn.q_proj.raw_blocks(), q_hf)
    assert torch.equal(in_place.module.model.layers[0].self_attn.q_proj.blocks, q_hf)
    assert torch.equal(logits_after_prompt(in_place, ids, 6), got)
    with torch.no_grad():  # prompts: the exact weight, dequantized from either form
        assert torch.equal(in_place.module(ids).logits, fast.module(ids).logits)
    step = fast.module.__dict__["_step"]
    assert isinstance(step, DecodeStep)
    assert all(function is step_mod.compiled_layer("ggml") for function, _ in step.layers)
    fast.module.__dict__["_step"] = None  # the module path
    assert torch.equal(logits_after_prompt(fast, ids, 6), got)
    ref = logits_after_prompt(dense, ids, 6)
    assert float((got - ref).abs().max()) < 2e-2 * float(ref.abs().max())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    one = _load(path, "cpu-fast", cpu_fast_small_rows=4, cpu_fast_activation_passes=1)
    assert {m.passes for m in one.module.modules() if isinstance(m, BlockLinear)} == {1}
    with pytest.raises(Exception, match="cpu_fast_activation_passes"):
        _load(path, "cpu-fast", cpu_fast_activation_passes=3)
    with pytest.raises(Exception, match="cpu_fast_interleave"):
        _load(path, "cpu-fast", cpu_fast_interleave="maybe")


def test_auto_backend(tiny_tied: tuple[Path, torch.nn.Module], tiny_qwen2: tuple[Path, torch.nn.Module]) -> None:
    """auto: cpu-fast (packed embedding) where the int4 kernel runs and the file has int4-kernel
    linears; dequantized (exact) for a file without any, and wherever the kernel does not run."""
    from anyquant_cpu.engine import fast_cpu_capable

    path, _ = tiny_tied
    auto = _load(path, "auto")
    if fast_cpu_capable()[0]:
        assert (auto.backend, auto.info["embedding"]) == ("cpu-fast", "packed")
        assert auto.info["cpu_fast"]["converted"] == (14 if kernels.available() else 12)
    else:
        assert (auto.backend, auto.info["embedding"]) == ("dequantized", "dense")
    assert _load(path, "cpu-fast", embedding="dense").info["embedding"] == "dense" or not fast_cpu_capable()[0]
    f32_only, _ = tiny_qwen2
    assert _load(f32_only, "auto").backend == "dequantized"


# --------------------------------------------------------------------------- the real model


def _mapping_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.model
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_file_pages_released_by_dequantized_backend(gguf_path: Path) -> None:
    """In a fresh process: other tests' models in this one keep their own mappings of the file.

    The forward matters: a float tensor left as a view of the map (the norms) faults in on first
    use, and the kernel's fault-around then maps the cached file pages around it as well (this
    kept ~17-28 MB resident when the file was hot in the page cache)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import torch
        import anyquant
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_gguf_memory import _mapping_rss_kib
        path = Path({str(gguf_path)!r})
        limit = 0.05 * path.stat().st_size / 1024
        model = anyquant.load(path, backend="dequantized")
        assert _mapping_rss_kib(path) < limit, _mapping_rss_kib(path)
        with torch.no_grad():
            model.module(torch.tensor([[1, 2, 3]]))
        assert _mapping_rss_kib(path) < limit, _mapping_rss_kib(path)  # dense weights only
        packed = anyquant.load(path, backend="packed")
        with torch.no_grad():
            packed.module(torch.tensor([[1, 2, 3]]))
        assert _mapping_rss_kib(path) > 0.9 * path.stat().st_size / 1024  # the packed weights
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.model
def test_real_model_packed_embedding_and_cpu_fast(gguf_path: Path) -> None:
    packed = anyquant.load(gguf_path, backend="packed")
    assert isinstance(packed.module.get_input_embeddings(), GGUFEmbedding)
    assert isinstance(packed.module.get_output_embeddings(), GGUFTiedHead)
    assert packed.module.get_input_embeddings().qtype == Q.Q8_0
    dense = anyquant.load(gguf_path, backend="dequantized")
    ids = packed.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = dense.module(ids).logits
        torch.testing.assert_close(packed.module(ids).logits, ref, rtol=1e-5, atol=1e-5)
    try:
        _fast_or_skip()
    except pytest.skip.Exception:
        return
    fast = anyquant.load(gguf_path, backend="cpu-fast")
    assert fast.info["cpu_fast"]["converted"] == 210 and not fast.info["cpu_fast"]["dequantized"]
    text = fast.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12)
    assert "Paris" in text


@pytest.mark.model
def test_cpu_fast_tied_head_is_prepacked_and_keeps_the_exact_greedy_path(gguf_path: Path) -> None:
    """cpu-fast's tied Q8_0 head: a bfloat16 copy prepacked for decode (over the embedding's GGUF bytes,
    decoded a slice at a time for prompts) whose largest logits are recomputed exactly: the greedy tokens
    are the exact backend's (with the bare bfloat16 product, the France prompt answered "L'Étoile")."""
    from anyquant_cpu.engine import FastHead, bf16_head_status

    if not bf16_head_status()[0]:
        pytest.skip(bf16_head_status()[1])
    fast = anyquant.load(gguf_path, backend="cpu-fast")
    head, emb = fast.module.get_output_embeddings(), fast.module.get_input_embeddings()
    assert isinstance(head, FastHead) and isinstance(head.source, GGUFRows) and head.tied_to_input_embedding
    assert isinstance(emb, GGUFEmbedding) and emb.qweight.data_ptr() == head.source.qweight.data_ptr()  # one table
    exact = GGUFTiedHead(head.source.qweight, head.source.qtype, head.source.shape)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        got, want = head(x), exact(x)
    top = want.topk(8, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-4)
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # the rest: bfloat16's class
    # the same cpu-fast body with the exact head: the head changes no greedy token
    ref = anyquant.load(gguf_path, backend="cpu-fast")
    ref.module.set_output_embeddings(exact)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    for prompt in prompts:
        chat = [{"role": "user", "content": prompt}]
        assert fast.generate(chat, max_new_tokens=24) == ref.generate(chat, max_new_tokens=24), prompt


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    import torch, transformers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    import anyquant, anyquant_gguf.loader, anyquant_gguf.qlinear, anyquant_gguf.tokenizer
    anyquant.detect(sys.argv[1])
    base = hwm()
    model = anyquant.load(sys.argv[1], backend=sys.argv[2])
    print(json.dumps({"delta": hwm() - base}))
    """
)


@pytest.mark.model
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc/self/status")
def test_load_peak_rss(gguf_path: Path) -> None:
    """Peak RSS of a load above the imported runtime, in a fresh process (measured: packed ~85 MiB,
    dequantized ~590 MiB for 540 MiB of float32 weights, cpu-fast ~270 MiB)."""

    def delta(backend: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _PEAK_SCRIPT, str(gguf_path), backend], capture_output=True, text=True, check=True
        )
        return float(json.loads(out.stdout.strip().splitlines()[-1])["delta"])

    packed, dense = delta("packed"), delta("dequantized")
    assert packed < 160 and dense < 700
    assert packed < 0.3 * dense


@pytest.mark.model
def test_the_loader_keeps_nothing_of_a_load(gguf_path: Path) -> None:
    """One load's state (the cpu-fast record, the tensor source, the backend's facts) lives in its context:
    the registry's loader, shared by every load, holds only the reader cache, empty between loads."""
    from anyquant.api import default_registry, get_loader

    fast = anyquant.load(gguf_path)
    assert fast.backend == "cpu-fast" and fast.info["cpu_fast"]["converted"] == 210
    assert anyquant.load(gguf_path, backend="dequantized").info["embedding"] == "dense"
    assert vars(get_loader(anyquant.detect(gguf_path), default_registry())) == {"_readers": None}
