"""Tiny real checkpoints for tests: a byte-level tokenizer and a small random Llama, built offline.

Imports torch and transformers (only when called).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "make_tokenizer", "make_tiny_dense", "tiny_llama_config"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer() -> Any:
    """A byte-level BPE tokenizer (256 byte tokens + 3 specials, no merges) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    byte_vocab = {ch: i for i, ch in enumerate(sorted(byte_vocab))}
    for s in SPECIALS:
        byte_vocab[s] = len(byte_vocab)
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:2],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 259,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 258,
        "pad_token_id": 256,
    }
    cfg.update(overrides)
    return cfg


def make_tiny_dense(path: str | Path, *, seed: int = 0, dtype: str = "float32", **overrides: Any) -> Path:
    """Save a small random Llama (safetensors + config + tokenizer) at ``path``: every parameter and saved float
    buffer drawn from N(0, 0.08)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    cfg = tiny_llama_config(**overrides)
    model_type = cfg.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        AutoConfig.for_model(model_type, **cfg)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
        for owner in model.modules():  # saved float state too (DeepSeek-V3's router bias, e_score_correction_bias)
            for name, b in owner.named_buffers(recurse=False):
                if name not in owner._non_persistent_buffers_set and b is not None and b.is_floating_point():
                    b.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path
