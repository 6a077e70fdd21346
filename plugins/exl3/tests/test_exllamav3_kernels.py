"""The exllamav3 backend on a machine without CUDA: typed errors, backend choice, and the pure-Python glue.

The generator glue runs against a small stand-in for exllamav3's ``Generator``/``Job`` that follows the result
protocol of ``exllamav3/generator/job.py`` (``emit``): streaming results carry ``text``/``token_ids`` once
released; a job ending on a stop token emits no ``token_ids`` and puts its held tokens (stop token last) under
``held``; a stop string ends the job with the text before it. Nothing here imports exllamav3.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import anyquant
from anyquant.protocols import GenerationParams, LoadOptions
from anyquant.testing.fixtures import exl3_mul1
from anyquant.testing.tiny import make_tokenizer
from anyquant_exl3 import exllamav3_kernels as cb
from anyquant_exl3.loader import EXL3Loader

EOS = 258  # <|im_end|> in anyquant.testing.tiny's byte tokenizer


@pytest.fixture(scope="module")
def exl3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return exl3_mul1(tmp_path_factory.mktemp("x") / "exl3")


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")


# ------------------------------------------------------------------------------------------------ no CUDA


@needs_no_cuda
def test_backend_listed_unavailable_without_cuda() -> None:
    info = {b.name: b for b in EXL3Loader().backends()}
    assert list(info) == ["exllamav3", "cpu-fast", "dequantized", "reference"]
    assert not info["exllamav3"].available
    assert "GPU" in info["exllamav3"].reason or "not installed" in info["exllamav3"].reason


@needs_no_cuda
def test_load_exllamav3_without_cuda_is_a_typed_error(exl3_dir: Path) -> None:
    with pytest.raises(anyquant.UnsupportedBackendError, match="exllamav3"):
        anyquant.load(exl3_dir, backend="exllamav3")
    assert "exllamav3" not in sys.modules or torch.cuda.is_available()  # never imported on the way


@needs_no_cuda
def test_tensor_parallel_without_gpus_is_a_typed_error(exl3_dir: Path) -> None:
    with pytest.raises(anyquant.UnsupportedBackendError, match="2 or more CUDA GPUs; no CUDA GPU is visible"):
        anyquant.load(exl3_dir, tensor_parallel=True)
    with pytest.raises(anyquant.UnsupportedBackendError, match="2 or more CUDA GPUs"):
        anyquant.load(exl3_dir, backend="exllamav3", tensor_parallel=True)


def test_tensor_parallel_with_one_gpu_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cb, "gpu_count", lambda: 1)
    with pytest.raises(anyquant.UnsupportedBackendError, match="only 1 CUDA GPU is visible"):
        cb.check_tensor_parallel(LoadOptions(extra={"tensor_parallel": True}))
    monkeypatch.setattr(cb, "gpu_count", lambda: 2)
    assert cb.check_tensor_parallel(LoadOptions(extra={"tensor_parallel": True}))
    assert not cb.check_tensor_parallel(LoadOptions(extra={"tensor_parallel": False}))
    assert not cb.check_tensor_parallel(LoadOptions())


def test_tensor_parallel_needs_the_exllamav3_backend(exl3_dir: Path) -> None:
    with pytest.raises(anyquant.UnsupportedBackendError, match="backend 'reference' has none"):
        anyquant.load(exl3_dir, backend="reference", tensor_parallel=True)


def test_auto_on_cpu_picks_a_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = EXL3Loader()
    avail = cb.BackendInfo("exllamav3", True, devices=("cuda",))  # as the real one: CUDA only
    monkeypatch.setattr("anyquant_exl3.loader._exllamav3_backend", lambda: avail)
    offered = {b.name: b for b in loader.backends()}
    fast = "cpu-fast" if offered["cpu-fast"].available else "dequantized"
    assert loader.choose_backend("auto", torch.device("cpu")) == fast  # exllamav3 is CUDA-only
    monkeypatch.setattr(
        EXL3Loader, "fast_backend_info", lambda self, spec: cb.BackendInfo(spec.name, False, "no AMX", devices=("cpu",))
    )
    assert loader.choose_backend("auto", torch.device("cpu")) == "dequantized"
    assert loader.choose_backend("auto", torch.device("cuda")) == "exllamav3"
    with pytest.raises(anyquant.UnsupportedBackendError, match="CUDA GPUs only"):
        loader.choose_backend("exllamav3", torch.device("cpu"))


def test_backend_info_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cb.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in cb.backend_info().reason
    monkeypatch.undo()
    monkeypatch.setattr(cb.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cb.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cb.torch.cuda, "get_device_capability", lambda i=0: (7, 5))
    monkeypatch.setattr(cb.torch.version, "hip", None)
    assert "sm_75" in cb.backend_info().reason
    monkeypatch.setattr(cb.torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(cb, "_extension_available", lambda: False)
    assert "nvcc" in cb.backend_info().reason
    monkeypatch.setattr(cb, "_extension_available", lambda: True)
    assert cb.backend_info().available


# ------------------------------------------------------------------------------------------------ pure glue


def test_declared_options_are_the_ones_read() -> None:
    from anyquant_exl3.exl2.loader import EXL2Loader
    from anyquant_exl3.loader import EXLLAMAV3_OPTIONS, EXL3Loader

    assert set(cb.EXTRA_OPTIONS) == set(EXLLAMAV3_OPTIONS)  # the backend reads the loader's declaration
    assert set(EXLLAMAV3_OPTIONS) <= set(EXL3Loader().load_options)
    assert not set(EXLLAMAV3_OPTIONS) & set(EXL2Loader().load_options)  # EXL2 has no exllamav3 backend


def test_sampler_spec_mapping() -> None:
    assert cb.sampler_spec(GenerationParams()) == cb.SamplerSpec("argmax")
    assert cb.sampler_spec(GenerationParams(temperature=0.7, top_k=1)).kind == "argmax"
    s = cb.sampler_spec(GenerationParams(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1))
    assert s == cb.SamplerSpec("combo", rep_p=1.1, temperature=0.7, top_k=40, top_p=0.9)
    assert s.kwargs() == {"rep_p": 1.1, "temperature": 0.7, "top_k": 40, "top_p": 0.9}
    greedy_pen = cb.sampler_spec(GenerationParams(repetition_penalty=1.3))
    assert (greedy_pen.kind, greedy_pen.rep_p, greedy_pen.temperature) == ("argmax", 1.3, 0.0)
    for bad in (dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(repetition_penalty=0.0)):
        with pytest.raises(anyquant.ParameterError):  # GenerationParams refuses them when made
            cb.sampler_spec(GenerationParams(temperature=1.0, **bad))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "given", [{"min_p": 0.1}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"logit_bias": {3: 1.0}}]
)
def test_sampler_spec_refuses_what_it_cannot_map(given: dict[str, object]) -> None:
    """exllamav3's sampler here carries repetition penalty, temperature, top-k and top-p only: the other fields are
    refused by name rather than silently ignored."""
    with pytest.raises(anyquant.ParameterError, match=f"{next(iter(given))}: not supported by the exllamav3"):
        cb.sampler_spec(GenerationParams(temperature=1.0, **given))  # type: ignore[arg-type]


def test_make_sampler_picks_argmax_or_combo() -> None:
    xl = SimpleNamespace(ArgmaxSampler=lambda: ("argmax",), ComboSampler=lambda **kw: ("combo", kw))
    assert cb.make_sampler(xl, cb.SamplerSpec("argmax")) == ("argmax",)
    kind, kw = cb.make_sampler(xl, cb.SamplerSpec("argmax", rep_p=1.2))
    assert kind == "combo" and kw["temperature"] == 0.0 and kw["rep_p"] == 1.2
    kind, kw = cb.make_sampler(xl, cb.SamplerSpec("combo", temperature=0.8, top_k=5, top_p=0.5))
    assert kw == {"rep_p": 1.0, "temperature": 0.8, "top_k": 5, "top_p": 0.5}


def test_stop_conditions_and_cache_tokens() -> None:
    assert cb.stop_conditions([2, 1, 2], ("</s>", "", "</s>", "\n\n")) == [1, 2, "</s>", "\n\n"]
    assert cb.stop_conditions([], ()) == []
    assert cb.cache_tokens(None) == cb.DEFAULT_CACHE_TOKENS == 8192
    assert cb.cache_tokens(1000) == 1024
    assert cb.cache_tokens("256") == 256
    assert cb.cache_tokens(1) == 256
    for bad in (0, -5, "x"):
        with pytest.raises(anyquant.AnyquantError):
            cb.cache_tokens(bad)


def test_result_token_ids() -> None:
    assert cb.result_token_ids({"eos": False}) == []
    assert cb.result_token_ids({"eos": False, "token_ids": torch.tensor([[5, 6]])}) == [5, 6]
    held = {"eos": True, "held": {"token_ids": torch.tensor([[7, EOS]])}}
    assert cb.result_token_ids(held) == [7, EOS]
    both = {"eos": True, "token_ids": [[1]], "held": {"token_ids": [[2]]}}
    assert cb.result_token_ids(both) == [1, 2]
    assert cb.result_token_ids({"eos": False, "held": {"token_ids": [[2]]}}) == []


# ------------------------------------------------------------------------------------------------ module


class _FakeModel:
    def __init__(self, vocab_padded: int) -> None:
        self.vocab_padded = vocab_padded
        self.calls: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def forward(self, ids: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        self.calls.append((ids, params))
        return torch.arange(ids.shape[0] * ids.shape[1] * self.vocab_padded, dtype=torch.float16).view(
            ids.shape[0], ids.shape[1], self.vocab_padded
        )


def test_module_forward_trims_vocab_and_returns_fp32() -> None:
    fake = _FakeModel(384)
    module = cb.ExllamaModule(fake, {"vocab_size": 259, "eos_token_id": EOS}, {}, "cuda:0")
    out = module(torch.tensor([1, 2, 3]))
    assert out.logits.shape == (1, 3, 259) and out.logits.dtype == torch.float32
    ids, params = fake.calls[0]
    assert ids.device.type == "cpu" and ids.dtype == torch.long and params == {"attn_mode": "flash_attn_nc"}
    module(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(anyquant.AnyquantError, match="padding mask"):
        module(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(anyquant.AnyquantError, match="past_key_values"):
        module(torch.ones(1, 4, dtype=torch.long), past_key_values=object())
    assert module.config.eos_token_id == EOS


# ------------------------------------------------------------------------------------------------ generator


class _FakeJob:
    def __init__(self, **kw: Any) -> None:
        assert kw["input_ids"].device.type == "cpu" and kw["input_ids"].dim() == 2
        self.kw = kw
        self.identifier = kw["identifier"]
        self.stop_tokens = {c for c in kw["stop_conditions"] or () if isinstance(c, int)}
        self.stop_strings = [c for c in kw["stop_conditions"] or () if isinstance(c, str)]
        self.new = 0
        self.text = ""
        self.emitted = 0


class _FakeGenerator:
    """Emits scripted tokens per job identifier, one per ``iterate()``, following job.py's ``emit`` protocol."""

    def __init__(self, tokenizer: Any, script: dict[int, list[int]]) -> None:
        self.tok = tokenizer
        self.script = script
        self.active: list[_FakeJob] = []
        self.enqueued: list[_FakeJob] = []
        self.cancelled: list[_FakeJob] = []

    def enqueue(self, jobs: list[_FakeJob]) -> None:
        self.active += jobs
        self.enqueued += jobs

    def num_remaining_jobs(self) -> int:
        return len(self.active)

    def cancel(self, job: _FakeJob) -> None:
        if job in self.active:
            self.active.remove(job)
            self.cancelled.append(job)

    def iterate(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = [{"stage": "started", "identifier": j.identifier} for j in self.active[:1]]
        for job in list(self.active):
            token = self.script[job.identifier][job.new]
            job.new += 1
            r: dict[str, Any] = {"stage": "streaming", "identifier": job.identifier, "eos": False}
            if token in job.stop_tokens:
                r.update(eos=True, eos_reason="stop_token", held={"token_ids": torch.tensor([[token]])})
            else:
                job.text += self.tok.decode([token])
                hits = [job.text.find(s) for s in job.stop_strings if s in job.text]
                if hits:
                    r.update(eos=True, text=job.text[job.emitted : min(hits)], token_ids=torch.tensor([[token]]))
                elif job.new >= job.kw["max_new_tokens"]:
                    r.update(eos=True, text=job.text[job.emitted :], token_ids=torch.tensor([[token]]))
                else:  # hold text that may still become a stop string
                    hold = max(
                        [n for s in job.stop_strings for n in range(1, len(s)) if job.text.endswith(s[:n])] or [0]
                    )
                    safe = len(job.text) - hold
                    r.update(text=job.text[job.emitted : safe], token_ids=torch.tensor([[token]]))
                    job.emitted = safe
            if r["eos"]:
                self.active.remove(job)
            results.append(r)
        return results


def _generator(script: dict[int, list[int]]) -> tuple[cb.ExllamaGenerator, _FakeGenerator]:
    tok = make_tokenizer()
    module = cb.ExllamaModule(_FakeModel(384), {"vocab_size": 259, "eos_token_id": EOS}, {}, "cuda:0")
    xl = SimpleNamespace(Job=_FakeJob, ArgmaxSampler=lambda: "argmax", ComboSampler=lambda **kw: ("combo", kw))
    fake = _FakeGenerator(tok, script)
    return cb.ExllamaGenerator(module, tok, xl, fake, extra_eos=[257]), fake


def _ids(text: str) -> list[int]:
    return list(make_tokenizer()(text, add_special_tokens=False)["input_ids"])


def test_generate_stream_and_stop_strings() -> None:
    gen, fake = _generator({0: [*_ids("Hello world. Bye"), EOS]})
    assert gen.generate("hi", GenerationParams(max_new_tokens=50)) == "Hello world. Bye"
    job = fake.enqueued[-1]
    assert job.kw["stop_conditions"] == [257, EOS] and job.kw["sampler"] == "argmax" and job.kw["seed"] is None
    assert job.kw["input_ids"].tolist() == [list(make_tokenizer()("hi")["input_ids"])]
    assert gen.generate("hi", GenerationParams(max_new_tokens=50, stop=(". ",))) == "Hello world"
    assert fake.enqueued[-1].kw["stop_conditions"] == [257, EOS, ". "]
    assert gen.generate("hi", GenerationParams(max_new_tokens=5)) == "Hello"
    pieces = list(gen.stream("hi", GenerationParams(max_new_tokens=50)))
    assert "".join(pieces) == "Hello world. Bye" and len(pieces) > 1
    assert gen.generate("hi", GenerationParams(max_new_tokens=0)) == ""
    assert not fake.active and not gen._busy


def test_sampling_params_reach_the_job() -> None:
    gen, fake = _generator({0: [*_ids("ab"), EOS]})
    gen.generate("x", GenerationParams(temperature=0.5, top_k=3, top_p=0.8, repetition_penalty=1.2, seed=7))
    kw = fake.enqueued[-1].kw
    assert kw["seed"] == 7 and kw["sampler"] == ("combo", {"rep_p": 1.2, "temperature": 0.5, "top_k": 3, "top_p": 0.8})


def test_generate_batch_routes_by_identifier() -> None:
    gen, fake = _generator({0: [*_ids("one"), EOS], 1: [*_ids("second row"), EOS], 2: _ids("abcdefgh")})
    out = gen.generate_batch(["a", "bb", "ccc"], GenerationParams(max_new_tokens=4, seed=3))
    assert out == ["one", "seco", "abcd"]
    assert [j.kw["seed"] for j in fake.enqueued] == [3, 4, 5]
    assert gen.generate_batch([], GenerationParams()) == []


def test_abandoned_stream_cancels_its_job_and_frees_the_generator() -> None:
    gen, fake = _generator({0: _ids("abcdefghijklmnop")})
    it = gen.stream("x", GenerationParams(max_new_tokens=16))
    assert next(it) == "a"
    with pytest.raises(anyquant.AnyquantError, match="already generating"):
        gen.generate("y", GenerationParams(max_new_tokens=2))
    it.close()
    assert fake.cancelled and not fake.active and not gen._busy
    assert gen.generate("x", GenerationParams(max_new_tokens=2)) == "ab"


def test_generate_ids_includes_eos_and_stops() -> None:
    gen, _ = _generator({0: [*_ids("xyz"), EOS, *_ids("never")]})
    assert gen.generate_ids(_ids("p"), GenerationParams(max_new_tokens=20)) == [*_ids("xyz"), EOS]
    gen, _ = _generator({0: _ids("abcdef")})
    assert gen.generate_ids(_ids("p"), GenerationParams(max_new_tokens=3)) == _ids("abc")


def test_error_results_raise() -> None:
    gen, fake = _generator({0: _ids("abc")})

    def boom() -> list[dict[str, Any]]:
        return [{"stage": "error", "error": RuntimeError("kernel failed"), "identifier": 0}]

    fake.iterate = boom  # type: ignore[method-assign]
    with pytest.raises(anyquant.AnyquantError, match="kernel failed"):
        gen.generate("x", GenerationParams(max_new_tokens=3))
    assert not gen._busy and not fake.active


# ------------------------------------------------------------------------------------------------ GPU encoder


def test_encode_device_option_is_validated(tmp_path: Path) -> None:
    from anyquant.testing.tiny import make_tiny_dense

    dense = make_tiny_dense(tmp_path / "d", num_hidden_layers=1)
    with pytest.raises(anyquant.QuantizeError, match="not a torch device"):
        anyquant.quantize(dense, tmp_path / "q", method="exl3", bits=4, quality=False, encode_device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(anyquant.QuantizeError, match="no CUDA GPU"):
            anyquant.quantize(dense, tmp_path / "q", method="exl3", bits=4, quality=False, encode_device="cuda")
    assert not (tmp_path / "q").exists()


def test_hadamard_and_packing_follow_the_tensor_device() -> None:
    from anyquant_exl3.hadamard import had_left, hadamard
    from anyquant_exl3.trellis import pack_states, unpack_states

    x = torch.randn(256, 128)
    assert hadamard(128, torch.float32, "cpu") is hadamard(128, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(had_left(had_left(x)), x, rtol=0, atol=1e-5)
    states = torch.randint(0, 1 << 16, (3, 256), dtype=torch.int32)
    packed = pack_states(states, 4)
    assert packed.device == states.device and packed.dtype == torch.int16
    assert unpack_states(pack_states(unpack_states(packed), 4)).equal(unpack_states(packed))


def test_gpu_batch_tiles_stay_within_the_budget() -> None:
    from anyquant_exl3.quantize import GPU_BATCH_TILES, GPU_VITERBI_BYTES, gpu_batch_tiles
    from anyquant_exl3.trellis import step_bits

    assert gpu_batch_tiles(4) == GPU_BATCH_TILES
    for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 8):
        per_tile = 4 * sum(65536 >> d for d in step_bits(k))
        assert 1 <= gpu_batch_tiles(k) <= GPU_BATCH_TILES
        assert gpu_batch_tiles(k) * per_tile <= GPU_VITERBI_BYTES


def test_close_drops_the_generator_and_stops_a_paused_stream() -> None:
    """Closing the model under a paused stream: the next step is a ModelClosedError (the model behind it is
    unloaded), nothing is run on exllamav3's generator any more, and the generator is released."""
    gen, fake = _generator({0: _ids("abcdefghijklmnop")})
    it = gen.stream("x", GenerationParams(max_new_tokens=16))
    assert next(it) == "a"
    gen.close()
    assert gen.xl_generator is None and gen.module is None
    with pytest.raises(anyquant.ModelClosedError):
        next(it)
    assert not fake.cancelled  # the unloaded generator is not touched again
    with pytest.raises(anyquant.ModelClosedError):
        gen.generate("y", GenerationParams(max_new_tokens=2))


def test_token_steps_takes_core_s_ends() -> None:
    """The override had no ``ends`` parameter (core's ``token_steps(batch, params, ends)`` signature): a caller
    naming its own end ids got a TypeError. They become the job's stop conditions instead of the EOS ids."""
    gen, fake = _generator({0: _ids("abc")})
    steps = list(gen.token_steps([_ids("p")], GenerationParams(max_new_tokens=3), ends=[5, 7]))
    assert fake.enqueued[-1].kw["stop_conditions"] == [5, 7]
    assert [t for (t,) in steps if t is not None] == _ids("abc")
    list(gen.token_steps([_ids("p")], GenerationParams(max_new_tokens=3)))
    assert fake.enqueued[-1].kw["stop_conditions"] == [257, EOS]
