"""Write the GGUF family fixtures of ``test_gguf_families.py`` with llama.cpp's own tools.

Not run by the tests (they only read what this wrote into ``fixtures/``). For each family
(``qwen3``, ``gemma2``, ``gemma3``, ``phi3``, ``qwen3moe``, ``mixtral``, ``qwen2moe``) it

1. trains a tiny tokenizer: byte-level BPE with Qwen2's split regex for qwen3/qwen3moe/qwen2moe (``tokenizers``),
   SentencePiece BPE with byte fallback for the others (``sentencepiece``: Gemma's id layout and
   no dummy prefix; Llama's layout with a dummy prefix for Mixtral, and Phi-3's added chat tokens);
2. builds a small random transformers model of the family (hidden 256, FFN multiple of 256 so
   that K-quants apply; norms not all ones; Gemma with a sliding window of 8 and, for Gemma 2,
   small soft-caps so that they act; Phi-3 with LongRoPE factors; the MoE ones with 4 experts, 2 per
   token, and a decisive router) and saves it with the tokenizer (see :data:`RANDOM_INIT`);
3. converts it with llama.cpp's ``convert_hf_to_gguf.py`` (F32; the BPE pre-tokenizer check is
   told ``qwen2``, since the tiny vocabulary's hash is unknown to it);
4. in a second interpreter with ``llama-cpp-python``: quantizes to Q4_K_M
   (``llama_model_quantize``), then records llama.cpp's logits for every prompt position
   (``logits_all``), its greedy continuation (with the top-2 margin of each step), and its
   tokenization of a few strings, into ``fixtures/<family>.json`` beside
   ``fixtures/<family>.Q4_K_M.gguf``.

The output is deterministic: a rerun with the same llama.cpp writes the same bytes.

Run (from the repository root; sentencepiece must be installed in the project venv)::

    .venv/bin/python plugins/gguf/tests/make_gguf_fixtures.py \\
        --llama-cpp /path/to/llama.cpp \\
        --llama-python /path/to/venv-with-llama-cpp-python/bin/python

``--llama-cpp`` is a llama.cpp source tree (``convert_hf_to_gguf.py``, ``conversion/``,
``gguf-py/``), e.g. the ``vendor/llama.cpp`` of the llama-cpp-python sdist whose build runs the
recording; ``--families`` picks some. llama.cpp's AMX buffer type crashes on some hosts
(ggml-org/llama.cpp#20824): the recording turns the extra buffer types off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "mixtral", "qwen2moe")
NEW_TOKENS = 8
N_CTX = 64
PROMPT = "The quick brown fox jumps over the lazy dog while the model reads"
TOKENIZE_TEXTS = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, digits 12345 678, ünïcödé ✓ and a llama 🦙\nnew line\ttab",
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model reads the text and writes the next word.
Quantized weights keep four or five bits for every value, and a scale for every block of values.
The llama walks up the hill in the morning; the fox sleeps under the tree until the evening comes.
Numbers like 12, 345, 6789 and 2024 appear in the text too, with commas, dots and question marks?
What is the capital of France? The capital of France is Paris, a city on the river Seine.
Tokens are pieces of words: the model sees them one after the other and predicts what follows.
She said: "we will test the loader with tiny models, then compare the logits with llama.cpp."
Every layer has attention and a feed-forward block; the norms keep the activations in range.
"""


#: family -> (torch seed, initializer_range of the linears, std of the token embedding). Picked among a few
#: seeds so that llama.cpp's greedy tokens are not one token repeated and its top-2 margins stay clear of the
#: difference its 8-bit activations make (the environment variables FIXTURE_SEED, FIXTURE_INIT and
#: FIXTURE_EMBED_STD override them, for such a search).
RANDOM_INIT: dict[str, tuple[int, float, float]] = {
    "qwen3": (1, 0.03, 0.6),
    "gemma2": (2, 0.04, 0.15),
    "gemma3": (1, 0.04, 0.15),
    "phi3": (2, 0.04, 0.5),
    "qwen3moe": (1, 0.03, 0.6),
    "mixtral": (3, 0.03, 0.5),
    "qwen2moe": (3, 0.03, 0.6),
}


def _knob(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


# --------------------------------------------------------------------------- tokenizers


def _lines() -> list[str]:
    lines = [line for line in CORPUS.splitlines() if line]
    return lines * 20


def train_bpe(out: Path, chat_template: str) -> Any:
    """A byte-level BPE tokenizer with Qwen2's split regex and Qwen's chat tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=509, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_lines(), trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )
    fast.save_pretrained(out)
    return fast


def train_spm(out: Path, *, gemma: bool, extra: list[str]) -> int:
    """A SentencePiece BPE model with byte fallback (``tokenizer.model``); returns its size."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    layout = (
        {
            "pad_id": 0,
            "eos_id": 1,
            "bos_id": 2,
            "unk_id": 3,
            "pad_piece": "<pad>",
            "eos_piece": "<eos>",
            "bos_piece": "<bos>",
            "unk_piece": "<unk>",
        }
        if gemma
        else {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}
    )
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines()),
        model_writer=buf,
        vocab_size=480 if gemma else 476,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=not gemma,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=extra,
        minloglevel=2,
        **layout,
    )
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    return int(sp.vocab_size())


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }} "
    "[/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)


def write_tokenizer(family: str, out: Path) -> dict[str, Any]:
    """The tokenizer files of ``family`` in ``out``; returns config keys (vocab size, token ids)."""
    if family == "mixtral":
        size = train_spm(out, gemma=False, extra=[])
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": MISTRAL_TEMPLATE,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return {"vocab_size": size, "bos_token_id": 1, "eos_token_id": 2}
    if family in ("qwen3", "qwen3moe", "qwen2moe"):
        fast = train_bpe(out, QWEN_TEMPLATE)
        vocab = len(fast)
        eos = fast.convert_tokens_to_ids("<|im_end|>")
        pad = fast.convert_tokens_to_ids("<|endoftext|>")
        return {"vocab_size": vocab, "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}
    if family in ("gemma2", "gemma3"):
        turns = ["<start_of_turn>", "<end_of_turn>"]
        size = train_spm(out, gemma=True, extra=turns)
        config = {
            "tokenizer_class": "GemmaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "chat_template": GEMMA_TEMPLATE,
            "added_tokens_decoder": {
                str(4 + i): {
                    "content": t,
                    "special": True,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                }
                for i, t in enumerate(turns)
            },
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return {"vocab_size": size, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    if family == "phi3":
        size = train_spm(out, gemma=False, extra=[])
        added = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "pad_token": "<|endoftext|>",
            "chat_template": PHI3_TEMPLATE,
            "added_tokens_decoder": {
                str(size + i): {
                    "content": t,
                    "special": True,
                    "lstrip": False,
                    "rstrip": t != "<|endoftext|>",
                    "normalized": False,
                    "single_word": False,
                }
                for i, t in enumerate(added)
            },
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return {"vocab_size": size + len(added), "bos_token_id": 1, "eos_token_id": size, "pad_token_id": size}
    raise ValueError(family)


# --------------------------------------------------------------------------- models


def model_config(family: str, tok: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    common = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "initializer_range": _knob("FIXTURE_INIT", RANDOM_INIT[family][1]),
        **tok,
    }
    if family == "qwen3":
        return AutoConfig.for_model(
            "qwen3",
            intermediate_size=512,
            num_hidden_layers=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            **common,
        )
    if family == "gemma2":
        return AutoConfig.for_model(
            "gemma2",
            intermediate_size=512,
            num_hidden_layers=3,  # layers 0 and 2 slide, layer 1 is global
            max_position_embeddings=512,
            sliding_window=8,
            query_pre_attn_scalar=64,  # what llama.cpp uses (1/sqrt(head_dim))
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    if family == "gemma3":
        return AutoConfig.for_model(
            "gemma3_text",
            intermediate_size=256,
            num_hidden_layers=6,  # layers 0-4 slide, layer 5 is global (llama.cpp's period of 6)
            max_position_embeddings=512,
            sliding_window=8,
            query_pre_attn_scalar=64,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **common,
        )
    if family == "qwen3moe":
        return AutoConfig.for_model(
            "qwen3_moe",
            intermediate_size=512,
            moe_intermediate_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,  # llama.cpp renormalizes the top-k weights
            num_hidden_layers=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            **common,
        )
    if family == "qwen2moe":  # a shared expert beside the routed ones, q/k/v biases, top-k weights not renormalized
        return AutoConfig.for_model(
            "qwen2_moe",
            intermediate_size=512,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=512,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,  # what llama.cpp's qwen2moe graph computes
            num_hidden_layers=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,  # llama.cpp's qwen2moe needs output.weight
            **common,
        )
    if family == "mixtral":
        return AutoConfig.for_model(
            "mixtral",
            intermediate_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            **common,
        )
    if family == "phi3":
        import numpy as np

        rng = np.random.default_rng(3)
        common = {k: v for k, v in common.items() if k != "head_dim"}
        return AutoConfig.for_model(
            "phi3",
            intermediate_size=512,
            num_hidden_layers=2,
            # llama.cpp pads n_ctx to a multiple of 256 and takes the long factors when that exceeds the
            # original context, HF when the sequence does: with 256 both use the short ones here
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [float(x) for x in np.round(rng.uniform(1.0, 3.0, 32), 4)],
                "long_factor": [float(x) for x in np.round(rng.uniform(2.0, 8.0, 32), 4)],
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=False,
            **common,
        )
    raise ValueError(family)


def build_model(family: str, config: Any, seed: int) -> Any:
    """Random weights, shaped so that llama.cpp's 8-bit activations (Q8_K, about 0.7% noise on every
    quantized matmul's input) move the logits by about 1% of their maximum, not several: the token
    embedding (and Phi-3's untied head, a noisy copy of it) larger than the rest, so that it leads the
    residual stream and the blocks add to it (a random model's blocks otherwise make all of it, and
    their noise adds up); norms not all ones, the final one with mixed signs (see below)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    gemma = family.startswith("gemma")
    embed_std = _knob("FIXTURE_EMBED_STD", RANDOM_INIT[family][2])
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.normal_(0.0, embed_std)
        head = model.get_output_embeddings().weight
        if head is not embed:
            head.copy_(embed + torch.randn_like(embed) * embed_std * 0.5)
        for name, param in model.named_parameters():
            if name == "model.norm.weight":
                # signs mixed: with a tied head the logits are then no longer led by the current token's own
                # embedding (e . e), and greedy text is not one token repeated; magnitudes near 1, so that the
                # head's input stays as easy to quantize to 8 bits (llama.cpp) as a normalized vector
                scale = torch.where(torch.rand_like(param) < 0.5, -1.0, 1.0) * (0.8 + 0.4 * torch.rand_like(param))
                param.copy_(scale - (1.0 if gemma else 0.0))
            elif gemma and (".post_attention_layernorm." in name or ".post_feedforward_layernorm." in name):
                # Gemma normalizes each block's output: scaled down (1 + w ~ 0.3), the embedding leads the residual
                param.copy_(torch.randn_like(param) * 0.1 - 0.7)
            elif name.endswith("norm.weight"):
                # Gemma's norms compute x * (1 + w), the others x * w: both away from all-ones
                param.copy_(torch.randn_like(param) * 0.3 + (0.0 if gemma else 1.0))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith(".mlp.gate.weight"):
                param.normal_(0.0, 1.0)  # MoE router: clear choices, not near-ties llama.cpp's rounding could flip
    return model


def convert(hf_dir: Path, out: Path, llama_cpp: Path) -> None:
    """llama.cpp's converter, F32, with the BPE pre-tokenizer check answered ``qwen2``."""
    code = f"""
import runpy, sys
sys.path.insert(0, {str(llama_cpp)!r})
sys.path.insert(1, {str(llama_cpp / "gguf-py")!r})
sys.argv = ["convert_hf_to_gguf.py", {str(hf_dir)!r}, "--outfile", {str(out)!r}, "--outtype", "f32"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # tiny vocabulary: unknown hash, Qwen2's split
runpy.run_path({str(llama_cpp / "convert_hf_to_gguf.py")!r}, run_name="__main__")
"""
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --------------------------------------------------------------------------- llama.cpp side


def record(f32: str, out_gguf: str, out_json: str, chat: str, meta: str) -> None:
    """Quantize and record (runs in the llama-cpp-python interpreter; imports no torch)."""
    import ctypes

    import llama_cpp
    import numpy as np

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(f32.encode(), out_gguf.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")

    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def no_extra_bufts() -> Any:  # the AMX buffer type crashes (ggml-org/llama.cpp#20824)
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = no_extra_bufts
    llm = llama_cpp.Llama(
        out_gguf,
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=2,
        n_threads_batch=2,
        logits_all=True,
        seed=0,
        verbose=False,
    )
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    greedy, margins = [], []
    for _ in range(NEW_TOKENS):
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top = np.sort(last)[-2:]
        nxt = int(np.argmax(last))
        greedy.append(nxt)
        margins.append(float(top[1] - top[0]))
        llm.eval([nxt])
    cases = [
        {"text": text, "special": False, "ids": llm.tokenize(text.encode(), add_bos=True, special=False)}
        for text in TOKENIZE_TEXTS
    ]
    cases.append({"text": chat, "special": True, "ids": llm.tokenize(chat.encode(), add_bos=False, special=True)})
    try:
        import subprocess as sp

        commit = sp.run(
            ["git", "-C", meta, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    data = {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_commit": commit or None,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "ftype": "Q4_K_M",
        "n_ctx": N_CTX,
        "prompt": PROMPT,
        "prompt_ids": prompt,
        "logits": [[round(float(v), 5) for v in row] for row in logits],
        "greedy": greedy,
        "greedy_margins": [round(m, 5) for m in margins],
        "tokenize": cases,
    }
    Path(out_json).write_text(json.dumps(data, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- driver


def make(family: str, llama_cpp: Path, llama_python: str, work: Path) -> None:
    hf_dir = work / family
    hf_dir.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(family, hf_dir)
    config = model_config(family, tok)
    model = build_model(family, config, int(_knob("FIXTURE_SEED", RANDOM_INIT[family][0])))
    model.save_pretrained(hf_dir)
    f32 = work / f"{family}.f32.gguf"
    convert(hf_dir, f32, llama_cpp)

    from transformers import AutoTokenizer

    template = {
        "qwen3": QWEN_TEMPLATE,
        "qwen3moe": QWEN_TEMPLATE,
        "qwen2moe": QWEN_TEMPLATE,
        "phi3": PHI3_TEMPLATE,
        "mixtral": MISTRAL_TEMPLATE,
    }.get(family, GEMMA_TEMPLATE)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
    FIXTURES.mkdir(exist_ok=True)
    out_gguf = FIXTURES / f"{family}.Q4_K_M.gguf"
    out_json = FIXTURES / f"{family}.json"
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
        f"import make_gguf_fixtures as m; m.record(*sys.argv[1:])"
    )
    args = [str(f32), str(out_gguf), str(out_json), str(chat), str(llama_cpp)]
    subprocess.run([llama_python, "-c", code, *args], check=True)
    data = json.loads(out_json.read_text())
    data = {"family": family, "chat_template": template, "chat_messages": messages, **data}
    out_json.write_text(json.dumps(data, ensure_ascii=False) + "\n")
    print(
        f"{family}: {out_gguf.stat().st_size / 1e6:.2f} MB, greedy {data['greedy']}, margins {data['greedy_margins']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (the converter)")
    parser.add_argument("--llama-python", required=True, help="a python with llama-cpp-python installed")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--work", type=Path, default=None, help="keep the HF models and F32 files here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for family in args.families:
            make(family, args.llama_cpp.resolve(), args.llama_python, work)


if __name__ == "__main__":
    main()
