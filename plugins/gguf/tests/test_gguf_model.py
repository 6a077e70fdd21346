"""A LlamaForCausalLM built from anyquant_gguf's config + tensors vs transformers' GGUF load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant_gguf.qlinear import GGUFLinear
from anyquant_gguf.reader import tokenizer_from_gguf

pytestmark = pytest.mark.model

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def prompt_ids(gguf_path: Path) -> torch.Tensor:
    tok = tokenizer_from_gguf(gguf_path)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def reference(hf_gguf_model: Any, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = hf_gguf_model(prompt_ids).logits
    return logits, _greedy(hf_gguf_model, prompt_ids)


def _greedy(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=2,
        )
    return out[0, ids.shape[1] :]


@pytest.mark.parametrize("backend", ["dequantized", "packed"])
def test_anyquant_load_matches_transformers(
    gguf_path: Path, prompt_ids: torch.Tensor, reference: tuple, backend: str
) -> None:
    """anyquant.load's logits equal transformers' gguf load within 1e-5; greedy tokens identical."""
    ref_logits, ref_tokens = reference
    model = anyquant.load(gguf_path, backend=backend)
    assert (model.format, model.backend, model.detection.variant) == ("gguf", backend, "Q4_1")
    packed = [m for m in model.module.modules() if isinstance(m, GGUFLinear)]
    assert len(packed) == 210 and all(m.qtype.name == "Q4_1" for m in packed)
    assert all(m.mode == ("on-the-fly" if backend == "packed" else "dequant-at-load") for m in packed)
    with torch.no_grad():
        logits = model.module(prompt_ids).logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    tokens = model.generator.generate_ids(prompt_ids[0].tolist(), model.params(max_new_tokens=NEW_TOKENS))
    if tokens[-1] in model.generator.eos_ids:  # the reference suppresses eos (min_new_tokens) and goes on
        tokens = tokens[:-1]
    assert len(tokens) >= 6 and tokens == ref_tokens.tolist()[: len(tokens)]


def test_default_backend_against_transformers(gguf_path: Path, prompt_ids: torch.Tensor, reference: tuple) -> None:
    """The default load (cpu-fast on a CPU with the int4 kernel): a short prompt runs the bfloat16
    int4 kernel (measured max |diff| / max |ref| 3.2e-2 on this prompt), a long one the prompt path (a bfloat16
    GEMM where the CPU has AMX or AVX512-BF16, within the same tolerance; ``cpu_fast_prefill="float32"``: the exact
    weights in float32); greedy text equals transformers' on this prompt (elsewhere it can leave it at a near-tie)."""
    from anyquant_cpu.engine import fast_cpu_capable

    ref_logits, ref_tokens = reference
    model = anyquant.load(gguf_path)
    if not fast_cpu_capable()[0]:
        assert model.backend == "dequantized"
        return
    assert (model.backend, model.info["embedding"]) == ("cpu-fast", "packed")
    with torch.no_grad():
        logits = model.module(prompt_ids).logits
        long = prompt_ids.repeat(1, 3)  # over 64 tokens: the prompt path
        want = anyquant.load(gguf_path, backend="dequantized").module(long).logits
        got = model.module(long).logits
        assert float((got - want).abs().max()) < 5e-2 * float(want.abs().max())
        exact = anyquant.load(gguf_path, cpu_fast_prefill="float32").module(long).logits
        torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5)
    assert float((logits - ref_logits).abs().max()) < 5e-2 * float(ref_logits.abs().max())
    assert bool((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() > 0.9)
    tokens = model.generator.generate_ids(prompt_ids[0].tolist(), model.params(max_new_tokens=NEW_TOKENS))
    if tokens[-1] in model.generator.eos_ids:
        tokens = tokens[:-1]
    assert len(tokens) >= 6 and tokens == ref_tokens.tolist()[: len(tokens)]


def test_chat_through_the_default_model_api() -> None:
    path = anyquant.default_model()
    model = anyquant.load(path)
    text = model.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12)
    assert "Paris" in text


@pytest.mark.parametrize("backend", [None, "cpu-fast", "packed"])
def test_export_dense_of_the_default_model(gguf_path: Path, tmp_path: Path, backend: str | None) -> None:
    """export_dense writes a dense, tied checkpoint with the exact weights whatever the backend (the
    default one, cpu-fast, keeps the embedding and the tied head packed: both are dequantized)."""
    from safetensors.torch import load_file

    kwargs = {} if backend is None else {"backend": backend}
    if backend == "cpu-fast":
        from anyquant_cpu.engine import fast_cpu_capable

        if not fast_cpu_capable()[0]:
            pytest.skip(fast_cpu_capable()[1])
    out = anyquant.export_dense(gguf_path, tmp_path / "dense", dtype="float32", **kwargs)
    assert anyquant.detect(out).format == "dense"
    tensors = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "lm_head.weight" not in tensors  # tied, as the GGUF is
    exact = anyquant.load(gguf_path, backend="dequantized").module
    for name in ("model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        module = exact.get_submodule(name)
        want = module.dequantize() if hasattr(module, "dequantize") else module.weight
        assert torch.equal(tensors[f"{name}.weight"], want.float()), name


def test_export_dense_refuses_a_module_without_a_dense_form(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend module export_dense cannot dequantize is an error, and nothing is written."""
    from anyquant_gguf.qlinear import GGUFTiedHead

    monkeypatch.delattr(GGUFTiedHead, "dequantize")
    with pytest.raises(anyquant.UnsupportedBackendError, match=r"no dense form .*lm_head\.qweight"):
        anyquant.export_dense(gguf_path, tmp_path / "dense", backend="packed")
    assert not (tmp_path / "dense").exists()


def test_default_backends_shared_decode_is_each_request_alone(gguf_path: Path) -> None:
    """A server's shared step on the default load (cpu-fast: the block kernel, the kernel's norms and attention, the
    block head with its exact top rows): three requests of different lengths stepped together give each the logits,
    bit for bit, that it gets decoded alone; and with torch's attention instead (the modules with ``decode_kernel``
    off) the first step's logits stay within the quantized activations' noise."""
    from anyquant_cpu.engine import fast_cpu_capable
    from anyquant_cpu.kernels import attention_available

    model = anyquant.load(gguf_path)
    if not fast_cpu_capable()[0] or not attention_available():
        pytest.skip("no cpu-fast kernels here")
    module = model.module
    assert model.info["cpu_fast"]["kernel_attention"] == 30  # every layer
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 40000, (1, n), generator=gen) for n in (5, 70, 33)]

    def run(alone: bool) -> list[torch.Tensor]:
        with torch.inference_mode():
            outs = [module(ids, use_cache=True) for ids in prompts]
            caches = [out.cache for out in outs]
            tokens = [int(out.logits[0, -1].argmax()) for out in outs]
            positions = [ids.shape[1] for ids in prompts]
            got = []
            for _ in range(10):
                ids_t, pos_t = torch.tensor([[t] for t in tokens]), torch.tensor([[p] for p in positions])
                if alone:
                    rows = [
                        module(ids_t[i : i + 1], position_ids=pos_t[i : i + 1], cache=c, use_cache=True)
                        for i, c in enumerate(caches)
                    ]
                    logits = torch.cat([out.logits[:, -1] for out in rows])
                else:
                    logits = module.decode_rows(ids_t, pos_t, caches)
                got.append(logits)
                tokens, positions = [int(t) for t in logits.argmax(-1)], [p + 1 for p in positions]
        return got

    together, alone = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    for layer in module.model.layers:
        layer.self_attn.decode_kernel = False
    module.__dict__.pop("_step", None)
    first = run(True)[0]  # the first step (the greedy paths may part later)
    # the int8-quantized activations turn the attention's last-bit differences into up to ~0.5 % of the largest logit
    # (measured 0.14 of 26.5); the kernel itself is judged against float64 in anyquant-cpu's test_decode_attention
    assert float((alone[0] - first).abs().max()) < 1e-2 * float(first.abs().max())
    assert torch.equal(alone[0].argmax(-1), first.argmax(-1))


def test_default_backends_decode_does_not_depend_on_the_thread_count(gguf_path: Path) -> None:
    """The default load's prompt and decode steps give the same logits bit for bit at 1, 2 and 3 threads: the block
    kernel's rows, its norms and its attention (each head's sums on one thread; torch's attention over one query
    changed with the threads: 0.11 of a logit apart at 1 and 2 threads on this model)."""
    from anyquant_cpu.engine import fast_cpu_capable
    from anyquant_cpu.kernels import attention_available

    model = anyquant.load(gguf_path)
    if not fast_cpu_capable()[0] or not attention_available():
        pytest.skip("no cpu-fast kernels here")
    module, threads = model.module, torch.get_num_threads()
    ids = torch.randint(100, 40000, (1, 40), generator=torch.Generator().manual_seed(0))

    def run() -> torch.Tensor:
        with torch.inference_mode():
            out = module(ids, use_cache=True)
            cache, rows, position = out.cache, [out.logits[0, -1]], ids.shape[1]
            for _ in range(12):
                token = torch.tensor([[int(rows[-1].argmax())]])
                out = module(token, position_ids=torch.tensor([[position]]), cache=cache, use_cache=True)
                rows.append(out.logits[0, -1])
                position += 1
        return torch.stack(rows)

    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(run())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
