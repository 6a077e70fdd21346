"""``anyquant_runtime.tokenizer.token_bytes``: a token's exact bytes, also when it holds part of a UTF-8 character."""

from __future__ import annotations

from pathlib import Path

import pytest

from anyquant_runtime.tokenizer import token_bytes

TEXT = "é🙂 naïve 日本語"
FIXTURES = Path(__file__).resolve().parents[3] / "plugins" / "gguf" / "tests" / "fixtures"


@pytest.mark.model
def test_byte_level_bpe_tokens_concatenate_to_the_text() -> None:
    """SmolLM2's byte-level BPE splits the emoji and the CJK characters across tokens: each such token decodes to
    U+FFFD alone, its bytes are the character's UTF-8 bytes in order."""
    import anyquant

    with anyquant.load(anyquant.default_model()) as model:
        tok = model.tokenizer
        ids = tok(TEXT, add_special_tokens=False)["input_ids"]
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case this is for
        assert b"".join(token_bytes(tok, i) for i in ids) == TEXT.encode()
        assert token_bytes(tok, tok.eos_token_id) == tok.eos_token.encode()


def test_sentencepiece_byte_fallback_tokens() -> None:
    """A SentencePiece vocabulary (Mixtral's, from a GGUF file llama.cpp made) spells unknown characters as
    ``<0xNN>`` byte pieces and word starts with ``▁``: the bytes are those bytes, ``▁`` a space."""
    import anyquant

    path = FIXTURES / "mixtral.Q4_K_M.gguf"
    if not path.exists():
        pytest.skip("GGUF family fixtures absent")
    with anyquant.load(path, backend="dequantized") as model:
        tok = model.tokenizer
        ids = tok(TEXT, add_special_tokens=False)["input_ids"]
        pieces = tok.convert_ids_to_tokens(ids)
        assert "<0xF0>" in pieces and pieces[0] == "▁"
        assert b"".join(token_bytes(tok, i) for i in ids) == b" " + TEXT.encode()  # the dummy prefix's space
