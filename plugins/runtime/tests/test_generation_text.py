"""Text from tokens: streaming, stop strings and end-of-sequence ids, judged by transformers' own ``generate``.

The checkpoints are real tiny Llamas whose greedy continuation is a fixed chain (``o_proj`` and
``down_proj`` are zero, so the last hidden state is the last token's embedding and the head maps each
token to the next one the test chose), with real tokenizers: the byte-level BPE of
``anyquant.testing.tiny`` and a SentencePiece-style one with byte fallback (Llama-2, Mistral, Gemma),
whose decoder renders an incomplete character as one U+FFFD per byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import anyquant
from anyquant.testing.tiny import CHAT_TEMPLATE, make_tokenizer, tiny_llama_config


def make_chain_model(path: Path, tokenizer: Any, chain: dict[int, int], **overrides: Any) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab, hidden = len(tokenizer), 128
    cfg = tiny_llama_config(
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    model_type = cfg.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb = torch.randn(vocab, hidden)
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(vocab, hidden)
        for t, u in chain.items():
            head[u] += emb[t] / emb[t].norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chain(start: int, tokens: list[int], end: int) -> dict[int, int]:
    out, prev = {}, start
    for t in [*tokens, end]:
        assert prev not in out
        out[prev], prev = t, t
    return out


def make_byte_fallback_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in [*"abcdefghijklmnopqrstuvwxyz", "▁", "▁hello", "▁world"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def transformers_text(path: Path, prompt: str, **kwargs: Any) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, tokenizer=tok, **kwargs)[0, ids.shape[1] :]
    return str(tok.decode(out, skip_special_tokens=True))


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = make_byte_fallback_tokenizer()
    t = tok.convert_tokens_to_ids

    def raw(*bs: int) -> list[int]:
        return [t(f"<0x{b:02X}>") for b in bs]

    links = chain(t("a"), [t("x"), *raw(0xF0, 0x9F, 0x98, 0x80), t("y")], tok.eos_token_id)  # x😀y
    links |= chain(t("c"), [t("z"), *raw(0xE6, 0x97, 0xA5), t("w")], tok.eos_token_id)  # z日w
    return make_chain_model(tmp_path_factory.mktemp("bf") / "m", tok, links)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = make_tokenizer()
    t = tok.convert_tokens_to_ids
    ids = tok("xa日y", add_special_tokens=False)["input_ids"]  # 日 is three byte tokens
    assert len(ids) == 6
    links = chain(t("q"), ids, tok.eos_token_id)
    links |= chain(t("b"), [t("c"), t("<|im_start|>"), t("d")], tok.eos_token_id)
    return make_chain_model(tmp_path_factory.mktemp("bl") / "m", tok, links)


@pytest.mark.parametrize(("prompt", "text"), [("a", "x😀y"), ("c", "z日w")])
def test_characters_split_into_byte_tokens_stream_whole(byte_fallback: Path, prompt: str, text: str) -> None:
    """Byte fallback decodes half a character as one U+FFFD per byte: generate gave 'x\\ufffd\\ufffd' (the
    rest never came) and stream yielded the U+FFFDs."""
    assert transformers_text(byte_fallback, prompt) == text
    model = anyquant.load(byte_fallback)
    pieces = list(model.stream(prompt, max_new_tokens=12))
    assert "".join(pieces) == model.generate(prompt, max_new_tokens=12) == text
    assert not any("\ufffd" in p for p in pieces)
    assert model.generate_batch([prompt, "a"], max_new_tokens=12) == [text, "x😀y"]
    assert model.generate(prompt, max_new_tokens=12, stop=["\ufffd"]) == text  # no U+FFFD in the text: no stop


@pytest.mark.parametrize(("stop", "text"), [("a日", "x"), ("日y", "xa"), ("日", "xa"), ("y", "xa日")])
def test_stop_strings_with_split_characters(byte_level: Path, stop: str, text: str) -> None:
    """While 日 was half decoded ('xa\\ufffd') the held-back 'a' of the stop 'a日' was streamed."""
    model = anyquant.load(byte_level)
    assert model.generate("q", max_new_tokens=12) == "xa日y"
    assert model.generate("q", max_new_tokens=12, stop=[stop]) == text
    assert "".join(model.stream("q", max_new_tokens=12, stop=[stop])) == text
    assert model.generate_batch(["q", "b"], max_new_tokens=12, stop=[stop])[0] == text


def test_a_special_token_as_stop_string(byte_level: Path) -> None:
    """The text is decoded without special tokens, so stop=['<|im_start|>'] never matched; transformers'
    stop_strings stop there."""
    assert transformers_text(byte_level, "b", stop_strings=["<|im_start|>"]) == "c"
    model = anyquant.load(byte_level)
    assert model.generate("b", max_new_tokens=12) == "cd"
    assert model.generate("b", max_new_tokens=12, stop=["<|im_start|>"]) == "c"
    assert list(model.stream("b", max_new_tokens=12, stop=["<|im_start|>"])) == ["c"]
    assert model.generate_batch(["b", "q"], max_new_tokens=12, stop=["<|im_start|>"]) == ["c", "xa日y"]


@pytest.mark.parametrize("runtime", ["native", "transformers"])
@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_end_of_sequence_ids_of_the_checkpoint(tmp_path: Path, runtime: str, where: str) -> None:
    """A second end-of-sequence id listed in config.json (native runtime) or generation_config.json (both)
    was ignored: generation ran past it."""
    tok = make_tokenizer()
    t = tok.convert_tokens_to_ids
    end = t("<|im_start|>")  # a second end-of-turn id; the tokenizer's eos is <|im_end|>
    assert end != tok.eos_token_id
    path = make_chain_model(tmp_path / "m", tok, chain(t("a"), [t("b"), t("c"), end, t("d")], tok.eos_token_id))
    if where == "config.json":  # transformers prefers generation_config.json when there is one
        (path / "generation_config.json").unlink()
    file = path / where
    cfg = json.loads(file.read_text())
    file.write_text(json.dumps({**cfg, "eos_token_id": [tok.eos_token_id, end]}))
    expected = transformers_text(path, "a")
    assert expected == "bc"
    model = anyquant.load(path, runtime=runtime)
    assert model.generate("a", max_new_tokens=12) == expected
    assert model.generate_batch(["a"], max_new_tokens=12) == [expected]


def test_batch_rows_use_their_own_context_and_penalty(tmp_path: Path) -> None:
    """A short prompt batched with one that nearly fills the context got only the long one's remaining
    positions; with a repetition penalty, the left padding (end-of-sequence ids) penalised a padded row's
    own end-of-sequence token."""
    tok = make_tokenizer()
    t = tok.convert_tokens_to_ids
    letters = [t(c) for c in "bcdefghijklmnop"]
    path = make_chain_model(tmp_path / "m", tok, chain(t("a"), letters, tok.eos_token_id), max_position_embeddings=32)
    model = anyquant.load(path)
    single = model.generate("a", max_new_tokens=20)
    assert single == "bcdefghijklmnop"
    long = "z" * 30
    assert model.generate_batch(["a", long], max_new_tokens=20)[0] == single
    for penalty in (1.1, 1.3):
        batch = model.generate_batch(["a", "zzzzz"], max_new_tokens=20, repetition_penalty=penalty)
        assert batch[0] == model.generate("a", max_new_tokens=20, repetition_penalty=penalty)


def test_generation_parameters(tmp_path: Path) -> None:
    """A tiny temperature divided the logits into inf (torch.multinomial: "probability tensor contains inf");
    numpy numbers were refused as not numbers; a prompt longer than the context failed at the first next()."""
    import numpy as np

    from anyquant.testing.tiny import make_tiny_dense

    model = anyquant.load(make_tiny_dense(tmp_path / "m", max_position_embeddings=16))
    greedy = model.generate("Hi", max_new_tokens=4)
    assert model.generate("Hi", max_new_tokens=4, temperature=1e-45, seed=1) == greedy
    p = model.params(max_new_tokens=np.int64(4), top_p=np.float32(0.5), temperature=np.float64(0.7), seed=np.int32(3))
    assert (type(p.max_new_tokens), type(p.top_p), type(p.seed)) == (int, float, int)
    with pytest.raises(anyquant.ParameterError, match="context is 16"):
        model.stream("Hi " * 40, max_new_tokens=2)  # at the call, before any next()
