"""Core's runtime on dense checkpoints: transformers is the judge."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import torch

import anyquant
from anyquant.testing.tiny import make_tiny_dense


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def reference(tiny: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def loaded(tiny: Path):  # type: ignore[no-untyped-def]
    return anyquant.load(tiny)


def test_logits_equal_transformers(loaded, reference) -> None:  # type: ignore[no-untyped-def]
    model, tok = reference
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(loaded.module(ids).logits, model(ids).logits)


@pytest.mark.parametrize("prompt", ["Hello, my name is", "1 2 3", "a"])
def test_greedy_tokens_equal_transformers(loaded, reference, prompt: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = reference
    ids = tok(prompt, return_tensors="pt").input_ids
    want = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
    got = loaded.generator.generate_ids(ids[0].tolist(), loaded.params(max_new_tokens=24))
    assert got == want[: len(got)] and len(got) == len(want)


def test_untied_head_is_not_tied(loaded) -> None:  # type: ignore[no-untyped-def]
    m = loaded.module
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()


def test_missing_head_is_tied(tmp_path: Path) -> None:
    root = make_tiny_dense(tmp_path / "m", tie_word_embeddings=True)
    model = anyquant.load(root).module
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_stream_concatenates_to_generate(loaded) -> None:  # type: ignore[no-untyped-def]
    full = loaded.generate("Once upon", max_new_tokens=20)
    pieces = list(loaded.stream("Once upon", max_new_tokens=20))
    assert "".join(pieces) == full and len(pieces) > 1


def test_stop_strings_cut_and_are_never_streamed(loaded) -> None:  # type: ignore[no-untyped-def]
    full = loaded.generate("Once upon", max_new_tokens=30)
    stop = full[5:8]
    assert len(stop) == 3
    cut = loaded.generate("Once upon", max_new_tokens=30, stop=[stop])
    assert cut == full[: full.find(stop)]
    assert "".join(loaded.stream("Once upon", max_new_tokens=30, stop=[stop])) == cut


def test_batch_equals_one_by_one(loaded) -> None:  # type: ignore[no-untyped-def]
    prompts = ["Hi", "A much longer prompt than the first one", "xyz"]
    batch = loaded.generate_batch(prompts, max_new_tokens=12)
    single = [loaded.generate(p, max_new_tokens=12) for p in prompts]
    assert batch == single


def test_sampling_is_seeded(loaded) -> None:  # type: ignore[no-untyped-def]
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    assert loaded.generate("Hello", **kw) == loaded.generate("Hello", **kw)
    assert loaded.generate("Hello", **kw) != loaded.generate("Hello", **{**kw, "seed": 8})


def test_chat_template_applies(loaded) -> None:  # type: ignore[no-untyped-def]
    params = loaded.params()
    ids = loaded.generator.encode([{"role": "user", "content": "Hi"}], params)
    text = loaded.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nHi<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_sample_next_filters() -> None:
    from anyquant.protocols import GenerationParams
    from anyquant_runtime.generate import sample_next

    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0]])
    hist = torch.tensor([[1]])
    assert sample_next(logits, GenerationParams(), hist, None).item() == 1
    assert sample_next(logits, GenerationParams(repetition_penalty=2.0), hist, None).item() == 2
    rng = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, GenerationParams(temperature=1.0, top_k=1), hist, rng).item() for _ in range(20)}
    assert picks == {1}


def test_shape_mismatch_is_a_typed_error(tmp_path: Path) -> None:
    import json

    root = make_tiny_dense(tmp_path / "m")
    cfg = json.loads((root / "config.json").read_text())
    cfg["intermediate_size"] = 512
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(anyquant.CheckpointError, match="shape"):
        anyquant.load(root)


def test_meta_parameters_acts_only_in_its_thread() -> None:
    """The register_parameter patch is process-wide while a build holds it, but another thread building
    modules meanwhile gets real, initialised parameters."""
    import threading

    from torch import nn

    from anyquant_runtime.build import meta_parameters

    original = nn.Module.register_parameter
    inside, built, seen = threading.Event(), threading.Event(), {}

    def other() -> None:
        inside.wait()
        seen["lin"] = nn.Linear(4, 4)
        built.set()

    t = threading.Thread(target=other)
    t.start()
    with meta_parameters():
        assert nn.Module.register_parameter is not original
        inside.set()
        built.wait(30)
        mine = nn.Linear(4, 4)
    t.join()
    assert mine.weight.is_meta
    assert not seen["lin"].weight.is_meta and bool(seen["lin"].weight.abs().sum() > 0)
    assert nn.Module.register_parameter is original


def test_meta_parameters_interleaved_builds_restore_the_original() -> None:
    """Two builds whose contexts interleave (A enters, B enters, A leaves, B leaves) leave torch as it was:
    a save/restore pair per build would leave A's patch installed for good."""
    import threading

    from torch import nn

    from anyquant_runtime.build import meta_parameters

    original = nn.Module.register_parameter
    b_inside, a_left, b_meta = threading.Event(), threading.Event(), {}

    def build_b() -> None:
        with meta_parameters():
            b_inside.set()
            a_left.wait(30)
            b_meta["lin"] = nn.Linear(2, 2).weight.is_meta  # still meta after A left

    t = threading.Thread(target=build_b)
    with meta_parameters():
        t.start()
        b_inside.wait(30)
    a_left.set()
    assert not nn.Linear(2, 2).weight.is_meta  # this thread is out: real parameters
    t.join()
    assert b_meta["lin"] is True
    assert nn.Module.register_parameter is original


def test_native_build_patches_nothing(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native decoder is built under torch.device("meta") (a thread-local mode): torch's classes are the
    same during the build as outside it."""
    import json

    from torch import nn

    from anyquant_runtime import native
    from anyquant_runtime.build import skeleton

    saved = nn.Module.register_parameter, nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    during = []
    init = native.NativeCausalLM.__init__

    def spy(self, config):  # type: ignore[no-untyped-def]
        during.append((nn.Module.register_parameter, nn.Linear.reset_parameters, nn.Embedding.reset_parameters))
        init(self, config)

    monkeypatch.setattr(native.NativeCausalLM, "__init__", spy)
    model = skeleton(json.loads((tiny / "config.json").read_text()), runtime="native")
    assert during == [saved]
    assert all(p.is_meta for p in model.parameters())
    assert not model.inv_freq.is_meta  # computed on the CPU


@pytest.mark.parametrize(
    "content",
    ['{"version": "1.0", "model": {', '{"version": "1.0"}', "not json at all"],
    ids=["truncated", "no-model", "garbage"],
)
def test_broken_tokenizer_is_a_typed_error(tiny: Path, tmp_path: Path, content: str) -> None:
    import shutil

    from anyquant.errors import CheckpointError

    root = tmp_path / "m"
    shutil.copytree(tiny, root)
    (root / "tokenizer.json").write_text(content)
    with pytest.raises(CheckpointError, match=r"tokenizer files .* cannot be loaded"):
        anyquant.load(root)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "abc"}, "hidden_size must be a positive integer"),
        ({"hidden_size": 64.5}, "hidden_size must be a positive integer"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer"),
        ({"num_hidden_layers": 10**9}, "holds only"),  # would build for ever
        ({"num_attention_heads": 0}, "num_attention_heads must be"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be"),
        ({"vocab_size": None}, "has no vocab_size"),
        ({"head_dim": 2**30}, "larger than any model"),  # the rotary table is a real tensor
        # issue #27 item 11: these loaded before
        ({"max_position_embeddings": -5}, "max_position_embeddings must be a positive integer"),
        ({"max_position_embeddings": "x"}, "max_position_embeddings must be a positive integer"),
        ({"max_position_embeddings": 1e300}, "max_position_embeddings must be a positive integer"),
        ({"rms_norm_eps": [1]}, "rms_norm_eps must be a non-negative number"),
        ({"rope_theta": "x"}, "rope_theta must be"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta must be"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, "rope_theta must be positive"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 1e4,
                    "factor": 0.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "factor must be positive",
        ),  # both loaded before, with every rotary angle 0 (or inf)
        # YaRN's parameters (DeepSeek's mscales): these failed deep in the rotary tables
        *(
            (
                {
                    "rope_parameters": {
                        "rope_type": "yarn",
                        "rope_theta": 1e4,
                        "factor": 4.0,
                        "original_max_position_embeddings": 64,
                        **bad,
                    }
                },
                said,
            )
            for bad, said in (
                ({"mscale_all_dim": "x"}, "mscale_all_dim must be a non-negative number"),
                ({"beta_fast": "a"}, "beta_fast must be a non-negative number"),
                ({"beta_slow": -1}, "beta_slow must be a non-negative number"),
                ({"attention_factor": 0}, "attention_factor must be positive"),
                ({"original_max_position_embeddings": 0}, "original_max_position_embeddings must be positive"),
            )
        ),
        # per layer type, as transformers 5 writes Gemma3's: each value is checked
        ({"rope_parameters": {"rope_type": "default", "rope_theta": {"global": 1e6, "local": -1.0}}}, "rope_theta"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 0.0}}}, "positive"),
    ],
)
@pytest.mark.parametrize("runtime", ["native", "transformers"])
def test_hostile_config_is_a_config_error_before_the_build(
    tiny: Path, tmp_path: Path, change: dict, message: str, runtime: str
) -> None:
    import json
    import shutil
    import time

    from anyquant.errors import ConfigError

    root = tmp_path / "m"
    shutil.copytree(tiny, root)
    cfg = json.loads((root / "config.json").read_text())
    cfg.update({k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        cfg.pop(k)
    (root / "config.json").write_text(json.dumps(cfg))
    if runtime == "transformers" and change.get("vocab_size", 1) is None:
        pytest.skip("transformers' classes default a missing vocab_size (then the tensor shapes disagree)")
    if runtime == "native" and change.get("rope_parameters", {}).get("rope_type") == "yarn":
        pytest.skip("the native decoder runs YaRN for DeepSeek only; this Llama's config is checked on the other row")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        anyquant.load(root, runtime=runtime)
    assert time.perf_counter() - t0 < 30


def test_check_config_accepts_real_configs(tiny: Path) -> None:
    import json

    from anyquant_runtime.build import check_config

    cfg = json.loads((tiny / "config.json").read_text())
    check_config(cfg, tensors=100, native=True)
    check_config({**cfg, "head_dim": None, "num_key_value_heads": None, "rope_scaling": {"factor": 8.0}}, tensors=100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": "5"}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -3}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 2.0}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"seed": True}, "seed"),
        ({"max_tokens": 5}, "unknown generation parameter"),
    ],
)
def test_bad_generation_parameters_are_parameter_errors(loaded, kwargs: dict, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(anyquant.ParameterError, match=message):
        loaded.generate("Hello", **kwargs)
    with pytest.raises(ValueError):  # a ParameterError is a ValueError too
        loaded.params(**kwargs)


def test_good_generation_parameters_pass(loaded) -> None:  # type: ignore[no-untyped-def]
    p = loaded.params(max_new_tokens=0, temperature=0, top_k=0, top_p=1, stop="x", seed=3, chat=False)
    assert p.stop == ("x",) and p.max_new_tokens == 0
    assert loaded.params(stop=["a", "b"]).stop == ("a", "b") and loaded.params(stop=None).stop == ()
    assert loaded.generate("Hello", max_new_tokens=0) == ""


@pytest.mark.parametrize("device", ["tpu9", "cuda", "cuda:3"])
def test_unusable_device_is_a_parameter_error(tiny: Path, device: str) -> None:
    if torch.cuda.is_available() and device.startswith("cuda"):
        pytest.skip("a CUDA GPU is visible")
    with pytest.raises(anyquant.ParameterError, match="device="):
        anyquant.load(tiny, device=device)


def test_unknown_load_option_is_a_parameter_error(tiny: Path) -> None:
    with pytest.raises(anyquant.ParameterError, match=r"unknown load option\(s\) \['cpu_fast_table'\].*'runtime'"):
        anyquant.load(tiny, cpu_fast_table="memory")  # a dense checkpoint's loader reads only runtime=
    assert anyquant.load(tiny, runtime="transformers").info["runtime"] == "transformers"


def test_loader_without_declared_options_takes_any(tiny: Path) -> None:
    """A third-party loader that does not declare ``load_options`` gets every keyword unchecked."""
    from anyquant_runtime.dense import DenseLoader

    class Permissive(DenseLoader):
        pass

    Permissive.load_options = None  # type: ignore[assignment]
    from anyquant.api import _check_options

    _check_options(Permissive(), {"anything": 1}, "dense")
    with pytest.raises(anyquant.ParameterError):
        _check_options(DenseLoader(), {"anything": 1}, "dense")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user"}], "chat message 0 is"),
        (["Hi"], "chat message 0 is 'Hi'"),
        ([{"role": 1, "content": "x"}], "string 'role'"),
        ([], "no chat messages"),
    ],
)
def test_malformed_chat_messages_are_parameter_errors(loaded, messages: list, message: str) -> None:  # type: ignore[no-untyped-def]
    """Before, jinja2's UndefinedError (or a TypeError) came out of the chat template."""
    with pytest.raises(anyquant.ParameterError, match=message):
        loaded.generate(messages, max_new_tokens=2)


def test_bad_prompts_and_dtype_are_parameter_errors(loaded, tiny: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(anyquant.ParameterError, match="empty prompt"):
        loaded.generate("", max_new_tokens=2)
    with pytest.raises(anyquant.ParameterError, match="chat=False needs a string prompt"):
        loaded.generate([{"role": "user", "content": "Hi"}], max_new_tokens=2, chat=False)
    with pytest.raises(anyquant.ParameterError, match="dtype 'int8' is not one of"):
        anyquant.load(tiny, dtype="int8")


def test_generation_stays_within_the_context(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A prompt longer than max_position_embeddings is refused; a long generation stops at the context (with a
    warning) with the same tokens as far as it goes; a prompt that fills the context still gets its one token."""
    path = make_tiny_dense(tmp_path / "short", max_position_embeddings=32)
    short = anyquant.load(path)
    unbounded = anyquant.load(path)
    unbounded.generator.context = None  # what the generator did before: run past the context
    gen = short.generator
    assert gen.context == 32
    ids = list(range(100, 120))  # 20 tokens: 13 more fit (the 13th is never fed back)
    with caplog.at_level("WARNING", logger="anyquant_runtime.generate"):
        got = gen.generate_ids(ids, short.params(max_new_tokens=50))
    assert len(got) == 13 and "stops at the model's context of 32 tokens" in caplog.text
    assert got == unbounded.generator.generate_ids(ids, unbounded.params(max_new_tokens=50))[:13]
    assert len(gen.generate_ids(list(range(100, 132)), short.params(max_new_tokens=5))) == 1
    with pytest.raises(anyquant.ParameterError, match="the prompt is 33 tokens; this model's context is 32"):
        gen.generate_ids(list(range(100, 133)), short.params(max_new_tokens=5))


def test_no_forward_after_the_last_token(loaded) -> None:  # type: ignore[no-untyped-def]
    """n new tokens take n forwards (the prompt's, then n - 1 single tokens), not n + 1."""
    calls = []
    handle = loaded.module.register_forward_hook(lambda m, a, out: calls.append(1))
    try:
        got = loaded.generator.generate_ids([72, 101, 108], loaded.params(max_new_tokens=5))
    finally:
        handle.remove()
    assert len(got) == 5 and len(calls) == 5


def test_sampling_leaves_torchs_global_generator_alone(loaded) -> None:  # type: ignore[no-untyped-def]
    """Unseeded sampling used to call torch.seed(), reseeding the process's generator under the application."""
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    loaded.generate("Hello", max_new_tokens=3, temperature=0.9)
    loaded.generate("Hello", max_new_tokens=3, temperature=0.9, seed=5)
    assert torch.equal(torch.rand(3), want)


def test_batch_rows_sample_as_alone_with_seed_plus_row(loaded) -> None:  # type: ignore[no-untyped-def]
    kw = {"max_new_tokens": 6, "temperature": 1.0, "seed": 123}
    a, b = "Hello there", "The cat"
    rows = loaded.generate_batch([a, b], **kw)
    assert rows[0] == loaded.generate(a, **kw)
    assert rows[1] == loaded.generate(b, **{**kw, "seed": 124})
    assert loaded.generate_batch([a], **kw) == [rows[0]]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.generate(None), "a prompt is a string"),
        (lambda m: m.generate(123), "a prompt is a string"),
        (lambda m: m.generate(b"hello"), "a prompt is a string"),
        (lambda m: m.generate_batch("abc"), "takes a list of prompts"),
        (lambda m: m.generate_batch(None), "takes a list of prompts"),
        (lambda m: m.generate_batch([None]), "a prompt is a string"),
        (lambda m: m.stream(""), "empty prompt"),  # at the call, not at the first next()
        (lambda m: m.generate("x", temperature=1, seed=2**64), "seed"),
        (lambda m: m.generate("x", temperature=1, seed=-1), "seed"),
    ],
)
def test_bad_prompts_are_parameter_errors(loaded, call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(anyquant.ParameterError, match=match):
        call(loaded)


def test_batch_accepts_any_iterable_of_prompts(loaded) -> None:  # type: ignore[no-untyped-def]
    assert loaded.generate_batch(p for p in ["a", "b"]) == loaded.generate_batch(["a", "b"])


def test_bad_paths_and_runtimes(tiny: Path) -> None:
    with pytest.raises(anyquant.ProbeError, match=r"str or os\.PathLike"):
        anyquant.load(None)  # type: ignore[arg-type]
    with pytest.raises(anyquant.ParameterError, match="runtime 'bogus'"):
        anyquant.load(tiny, runtime="bogus")


LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
GROWING_TEMPLATE = "{% for i in range(100000) %}{{ 'x' * 1000000 ~ i }}{% endfor %}"  # a new 1 MB string each time
HUGE_TEMPLATE = "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}"  # one folded constant, joined: 100 GB


def test_runaway_chat_templates_are_stopped(loaded, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint's template that loops for hours (10**10 empty iterations) or renders 100 GB of text
    is stopped within its budget with a CheckpointError; the tokenizer's template otherwise renders as
    transformers renders it, and a tracer set before (a debugger's, coverage's) is put back."""
    from anyquant_runtime import chat

    messages = [{"role": "user", "content": "Hi"}]
    expected = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.render_chat(loaded.tokenizer, messages, add_generation_prompt=True) == expected
    monkeypatch.setattr(chat, "CHAT_TEMPLATE_SECONDS", 0.5)
    monkeypatch.setattr(chat, "CHAT_TEMPLATE_MAX_BYTES", 256 << 20)
    monkeypatch.setattr(loaded.tokenizer, "chat_template", LOOPING_TEMPLATE)

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        return None

    t0 = time.monotonic()
    sys.settrace(tracer)
    try:
        with pytest.raises(anyquant.CheckpointError, match=r"chat template ran for more than 0.5 s"):
            loaded.generate(messages, max_new_tokens=2)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert time.monotonic() - t0 < 5
    monkeypatch.setattr(loaded.tokenizer, "chat_template", GROWING_TEMPLATE)
    monkeypatch.setattr(chat, "CHAT_TEMPLATE_SECONDS", 60.0)
    monkeypatch.setattr(chat, "CHAT_TEMPLATE_MIN_CHARS", 1 << 40)  # the memory budget, not the output's, is tested
    with pytest.raises(anyquant.CheckpointError, match=r"chat template grew the process's memory by \d+ MiB"):
        loaded.generate(messages, max_new_tokens=2)
    monkeypatch.setattr(loaded.tokenizer, "chat_template", HUGE_TEMPLATE)
    with pytest.raises(anyquant.CheckpointError, match=r"chat template ran out of memory"):
        loaded.generate(messages, max_new_tokens=2)
    assert sys.gettrace() is None
    assert loaded.generate("Hi", max_new_tokens=2)  # plain prompts never render the template


@pytest.mark.parametrize(
    "change", [{"hidden_act": 5}, {"tie_word_embeddings": "no"}, {"attention_dropout": "x"}, {"eos_token_id": "x"}]
)
def test_configs_transformers_refuses_are_config_errors(tiny: Path, tmp_path: Path, change: dict) -> None:
    """transformers' own config checks (huggingface_hub's StrictDataclassError, not a ValueError) came out
    of load() raw."""
    import json
    import shutil

    root = tmp_path / "m"
    shutil.copytree(tiny, root)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(anyquant.ConfigError, match=r"is not a 'llama' config that transformers .* can build"):
        anyquant.load(root, runtime="transformers")


def test_unknown_model_type_says_upgrade(tiny: Path, tmp_path: Path) -> None:
    import json
    import shutil

    root = tmp_path / "m"
    shutil.copytree(tiny, root)
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "model_type": "llama99"}))
    with pytest.raises(anyquant.CheckpointError, match=r"does not know model_type 'llama99'\. Upgrade transformers"):
        anyquant.load(root, runtime="transformers")


def _rewrite(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    (weights,) = root.glob("*.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_weights_that_contradict_the_config_fail_at_load(tiny: Path, tmp_path: Path) -> None:
    """Each used to load: a boolean norm weight as 0/1 floats, a missing head (with tie_word_embeddings:
    false) tied to the embedding, and layers past num_hidden_layers dropped with a warning."""
    import json
    import shutil

    def copy(name: str) -> Path:
        shutil.copytree(tiny, tmp_path / name)
        return tmp_path / name

    norm = "model.layers.0.input_layernorm.weight"
    root = copy("bool")
    _rewrite(root, lambda t: t.__setitem__(norm, t[norm] > 0))
    with pytest.raises(anyquant.CheckpointError, match=f"'{norm}' is bool in the checkpoint"):
        anyquant.load(root)
    root = copy("headless")
    assert json.loads((root / "config.json").read_text())["tie_word_embeddings"] is False
    _rewrite(root, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(anyquant.MissingTensorError, match="tie_word_embeddings: false, but the checkpoint has no"):
        anyquant.load(root)
    root = copy("short")
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(
        anyquant.CheckpointError, match=r"num_hidden_layers=1, but the checkpoint has tensors of layer\(s\) 1"
    ):
        anyquant.load(root)
    # multi-token-prediction layers past num_hidden_layers are the model's own (DeepSeek-V3, GLM-4.5)
    (root / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}))
    assert anyquant.load(root).info["unused_tensors"]
    root = copy("partial")
    up = "model.layers.0.mlp.up_proj"
    _rewrite(root, lambda t: t.__setitem__(f"{up}.bias", t.pop(f"{up}.weight")[:, 0].clone()))
    with pytest.raises(
        anyquant.MissingTensorError, match=r"up_proj.weight' is not in the checkpoint, and its module has only bias"
    ):
        anyquant.load(root)


def test_misuse_gets_its_own_error_class(tiny: Path, tmp_path: Path) -> None:
    """These raised the bare base class, which a host cannot tell from any other anyquant error: a closed
    model (now ModelClosedError), chat messages to a tokenizer without a chat template (CheckpointError),
    a plugin whose loader is no Loader (PluginError)."""
    import dataclasses
    import shutil

    from anyquant import FormatSpec, Registry, hookimpl
    from anyquant.api import detect, get_loader

    model = anyquant.load(tiny)
    model.close()
    with pytest.raises(anyquant.ModelClosedError, match="was closed"):
        model.generate("Hi", max_new_tokens=1)
    bare = tmp_path / "no-template"
    shutil.copytree(tiny, bare)
    for name in ("chat_template.jinja", "chat_template.json"):
        (bare / name).unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    with anyquant.load(bare) as model:
        assert model.generate("Hi", max_new_tokens=1) is not None  # a plain string still works
        with pytest.raises(anyquant.CheckpointError, match="no chat template"):
            model.generate([{"role": "user", "content": "Hi"}], max_new_tokens=1)

    class Plugin:
        @hookimpl
        def anyquant_register_formats(self, register):  # type: ignore[no-untyped-def]
            register(FormatSpec(name="fakefmt", loader="types:SimpleNamespace", description="no Loader"))

    reg = Registry(entry_points=False, plugins=[("fake", Plugin())])
    detection = dataclasses.replace(detect(tiny, registry=reg), format="fakefmt")
    with pytest.raises(anyquant.PluginError, match="does not implement the Loader protocol"):
        get_loader(detection, reg)


def test_torch_device_and_dtype_objects_are_accepted(tiny: Path) -> None:
    """``load``'s types admit ``torch.device``/``torch.dtype`` (what torch users pass); they become the
    option strings, so the model reports ``"cpu"``/``"float32"`` either way."""
    with anyquant.load(tiny, device=torch.device("cpu"), dtype=torch.bfloat16) as model:
        assert (model.device, model.dtype) == ("cpu", "bfloat16")
        assert next(model.module.parameters()).dtype == torch.bfloat16


def test_concurrent_builds_leave_the_hosts_default_dtype(tiny: Path) -> None:
    """transformers' ``from_config(dtype=...)`` sets torch's process-wide default dtype and restores what it
    found; two builds overlapping used to restore each other's float32, so a host whose default is bfloat16
    was left with float32. anyquant now runs that step one build at a time and puts back what it found."""
    import threading

    from anyquant_runtime.build import skeleton

    cfg = json.loads((tiny / "config.json").read_text())
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def build() -> None:
        start.wait()
        try:
            for _ in range(15):
                skeleton(cfg, runtime="transformers")
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=build) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert torch.get_default_dtype() is torch.bfloat16
    finally:
        torch.set_default_dtype(before)


def test_closing_the_model_releases_it_under_a_paused_stream(tiny: Path) -> None:
    """A stream left paused holds the generator; ``close()`` used to only flag it, so the module (weights,
    open checkpoint files) lived on as long as the stream object did. Now the module is released at
    ``close()`` and the stream's next step is a ModelClosedError."""
    import gc
    import weakref

    model = anyquant.load(tiny)
    stream = model.stream("Hello", max_new_tokens=8)
    next(stream)
    module = weakref.ref(model.module)
    model.close()
    gc.collect()
    assert module() is None
    with pytest.raises(anyquant.ModelClosedError):
        for _ in stream:
            pass


def test_hub_cache_snapshot_loads_like_the_directory(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hugging Face hub cache snapshot (every file a link to ``../../blobs/<hash>``) loads and generates
    exactly like the plain directory: as a directory, through its single weights file, or by model id
    from the cache that ``HF_HUB_CACHE`` names; ``estimate`` reads it too."""
    import hashlib
    import shutil

    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(snap.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(tiny.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    want = anyquant.load(tiny).generate("Hello, my name is", max_new_tokens=12)
    for path in (snap, snap / "model.safetensors", "org/tiny"):
        model = anyquant.load(path)
        assert model.format == "dense" and model.generate("Hello, my name is", max_new_tokens=12) == want
    by_id, by_path = anyquant.estimate("org/tiny", bits=4), anyquant.estimate(tiny, bits=4)
    assert by_id.model == "org/tiny" and by_id == dataclasses.replace(by_path, model="org/tiny")
    assert anyquant.estimate(snap, bits=4).model == "org/tiny"


def test_a_missing_shard_is_named_when_a_tensor_is_missing(tiny: Path, tmp_path: Path) -> None:
    """A sharded checkpoint whose second shard never arrived: the probe records the index's missing shard,
    and the load's MissingTensorError names it (it only said which tensor was missing)."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path / "m"
    shutil.copytree(tiny, root)
    state = load_file(root / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    (root / "model.safetensors").unlink()
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, root / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert anyquant.load(root).generate("a", max_new_tokens=4) == anyquant.load(tiny).generate("a", max_new_tokens=4)
    (root / "model-00002-of-00002.safetensors").unlink()
    probe = anyquant.Probe.open(root)
    assert probe.missing_shards == ("model-00002-of-00002.safetensors",)
    with pytest.raises(
        anyquant.MissingTensorError,
        match=r"is not in the checkpoint.*names 1 file\(s\) that are not in .*model-00002-of-00002\.safetensors.*interrupted",
    ):
        anyquant.load(root)


def test_consolidated_weights_beside_the_indexed_shards_are_ignored(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Mistral-style upload: the transformers shard named by the index, and consolidated.safetensors
    holding the same weights under Mistral's names. load generates as without it, warns of no unused
    tensors, and inspect counts the parameters once."""
    import logging
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path / "m"
    shutil.copytree(tiny, root)
    state = load_file(root / "model.safetensors")
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(state, "model.safetensors")})
    )
    renamed = {k.replace("model.", "").replace("lm_head", "output"): v for k, v in state.items()}
    save_file(renamed, root / "consolidated.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="anyquant"):
        got = anyquant.load(root).generate("Hello", max_new_tokens=8)
    assert got == anyquant.load(tiny).generate("Hello", max_new_tokens=8)
    assert not [r for r in caplog.records if "not used" in r.getMessage()]
    assert anyquant.inspect(root).totals["parameters"] == anyquant.inspect(tiny).totals["parameters"]


def test_rope_theta_per_layer_type_is_accepted() -> None:
    """transformers 5 saves Gemma3's rotary bases as {"global": ..., "local": ...} inside rope_parameters, beside
    one dict per layer type: a valid config, checked value by value."""
    from anyquant_runtime.build import check_config

    check_config(
        {
            "rope_parameters": {
                "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
                "rope_theta": {"global": 1e6, "local": 1e4},
                "rope_type": "default",
            }
        }
    )


def test_experts_one_token_path_equals_the_general_path() -> None:
    """A decode step's shortcut (one token: its top_k experts in ascending order) sums exactly as the general path
    does, and the general path computes transformers' fused-experts loop on the same weights."""
    import torch
    from torch import nn
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from anyquant_runtime.experts import Expert, Experts

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, hidden_act="silu")
    fused = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        fused.gate_up_proj.normal_()
        fused.down_proj.normal_()
    experts = []
    for e in range(6):
        gate, up, down = nn.Linear(32, 16, bias=False), nn.Linear(32, 16, bias=False), nn.Linear(16, 32, bias=False)
        gate.weight.data, up.weight.data = fused.gate_up_proj.data[e].chunk(2)
        down.weight.data = fused.down_proj.data[e]
        experts.append(Expert(gate, up, down, fused.act_fn))
    ours = Experts(experts)
    x = torch.randn(5, 32)
    index = torch.tensor([[4, 1], [0, 5], [2, 2 + 1], [5, 0], [1, 4]])
    weights = torch.rand(5, 2)
    with torch.no_grad():
        want = fused(x, index, weights)
        got = ours(x, index, weights)
        for i in range(5):  # a row alone: the shortcut and the general path add the same terms in the same order
            row = (x[i : i + 1], index[i : i + 1], weights[i : i + 1])
            assert torch.equal(ours(*row), ours._routed(*row))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("failure", "size"),
    [
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 123456789 bytes. Error code 12 (Cannot allocate memory)"
            ),
            "117.74 MiB",
        ),
        (MemoryError(), None),
        (RuntimeError("not enough memory: you tried to allocate 2048 bytes."), "2.00 KiB"),
    ],
)
def test_out_of_memory_during_load_says_memory(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException, size: str | None
) -> None:
    """Issue #27 item 11: an allocation failure was reported as 'tensors do not fit together ... re-download'."""
    import anyquant_runtime.build as build
    from anyquant.errors import InsufficientMemoryError

    def fail(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(build, "_fill", fail)
    with pytest.raises(InsufficientMemoryError, match="ran out of memory") as info:
        anyquant.load(tiny)
    assert "re-download" not in str(info.value) and "do not fit" not in str(info.value)
    assert isinstance(info.value, MemoryError) and "on disk" in str(info.value)
    if size is not None:
        assert f"allocation of {size} failed" in str(info.value)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_are_a_numerical_error(tiny: Path, temperature: float) -> None:
    """Issue #27 item 6: sampling from NaN logits raised torch's RuntimeError (multinomial), and greedy
    decoding picked an arbitrary token (generate returned '')."""
    from anyquant.errors import NumericalError

    model = anyquant.load(tiny)
    with torch.no_grad():
        model.module.model.norm.weight.fill_(float("nan"))  # after the load: its own checks cannot see it
    with pytest.raises(NumericalError, match="non-finite logits"):
        model.generate("hello", max_new_tokens=3, temperature=temperature, seed=0)


def test_check_finite_reads_an_expanded_view_once() -> None:
    """A view with a zero stride (a placeholder ``expand``) is checked on its distinct elements: a NaN among them is
    still found, with the view's element count in the message."""
    from anyquant.errors import NumericalError
    from anyquant_runtime.finite import check_finite

    check_finite("w", torch.zeros(1).expand(4096, 512))
    check_finite("w", torch.arange(6.0).reshape(1, 2, 3).expand(5, 2, 3))
    with pytest.raises(NumericalError, match=r"'w' holds 1 NaN"):
        check_finite("w", torch.tensor([[1.0, float("nan"), 2.0]]).expand(1000, 3))
    with pytest.raises(NumericalError, match="1 inf"):
        check_finite("w", torch.tensor([[1.0], [float("inf")]]).expand(2, 700))


def test_sample_next_refuses_non_finite_rows() -> None:
    from anyquant.errors import NumericalError
    from anyquant.protocols import GenerationParams
    from anyquant_runtime.generate import sample_next

    params = GenerationParams(temperature=1.0)
    history = torch.zeros((1, 0), dtype=torch.long)
    ok = torch.tensor([[0.0, float("-inf"), 1.0]])
    assert int(sample_next(ok, params, history, None)) in (0, 2)  # -inf alone is a masked token, not an error
    for row, what in [([0.0, float("nan"), 1.0], "1 NaN"), ([float("inf"), 0.0, 0.0], r"1 \+inf")]:
        with pytest.raises(NumericalError, match=what):
            sample_next(torch.tensor([row]), params, history, None)
    with pytest.raises(NumericalError, match="only -inf"):
        sample_next(torch.full((1, 3), float("-inf")), params, history, None)


@pytest.mark.parametrize(
    ("tensor", "bad"),
    [
        ("model.norm.weight", float("nan")),
        ("model.layers.0.input_layernorm.weight", float("inf")),
        ("model.embed_tokens.weight", float("nan")),
    ],
)
@pytest.mark.parametrize("runtime", ["native", "transformers"])
def test_non_finite_weights_are_refused_at_load(tmp_path: Path, tensor: str, bad: float, runtime: str) -> None:
    """Issue #27 item 7: a NaN/inf norm or embedding loaded silently and generate returned ''."""
    from safetensors.torch import load_file, save_file

    from anyquant.errors import NumericalError

    root = make_tiny_dense(tmp_path / "m")
    state = load_file(root / "model.safetensors")
    state[tensor].view(-1)[3] = bad
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NumericalError, match=rf"{tensor}.* holds 1 (NaN|inf)"):
        anyquant.load(root, runtime=runtime)


def test_float16_overflow_is_named_as_such(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from anyquant.errors import NumericalError

    root = make_tiny_dense(tmp_path / "m")
    state = {k: v.float() for k, v in load_file(root / "model.safetensors").items()}
    state["model.norm.weight"][0] = 1e6  # finite in float32, inf in float16
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NumericalError, match=r"model\.norm\.weight' overflows float16"):
        anyquant.load(root, dtype="float16")
    assert anyquant.load(root, dtype="float32").generate("hi", max_new_tokens=2) is not None


@pytest.mark.parametrize(("fixture", "suffix"), [("gptq_v1", "scales"), ("awq_gemm", "scales"), ("exl3_mul1", "suh")])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_scales_are_refused_at_load(tmp_path: Path, fixture: str, suffix: str, bad: float) -> None:
    """Issue #27 item 7: NaN/inf scales (EXL3: suh) loaded silently; the error names the layer and tensor."""
    from safetensors.torch import load_file, save_file

    from anyquant.errors import NumericalError
    from anyquant.testing.fixtures import FIXTURES

    root = FIXTURES[fixture].build(tmp_path / "m")
    target = "model.layers.0.self_attn.q_proj"
    for f in root.glob("*.safetensors"):
        state = load_file(f)
        if f"{target}.{suffix}" in state:
            state[f"{target}.{suffix}"].view(-1)[0] = bad
            save_file(state, f, metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"{target}.{suffix} is in no shard")
    with pytest.raises(NumericalError, match=rf"{target}: tensor '{suffix}' holds 1 (NaN|inf)"):
        anyquant.load(root)
