"""EXL3 for the families beyond Llama: a tiny random model of each family quantized by anyquant's EXL3 encoder
(exllamav3's layout: every linear, each expert's too, one trellis; MoE routers kept 16-bit as exllamav3 keeps
them). Judges: every stored linear decodes bit-exactly to its trellis (``decode_exl3``, itself checked against
GPTQModel's ``ExllamaV3TorchLinear`` and exllamav3's ``reconstruct``), and the loaded model computes what
transformers' own class computes on the decoded weights (``export_dense``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_runtime.parts import LinearParts
from tests.peers.catalog import FAMILIES

pytestmark = pytest.mark.slow

IDS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 109, 121, 32, 119, 111, 114, 108, 100, 33]])
CASES = ["qwen3", "gemma2", "gemma3_text", "qwen2_moe", "mixtral", "deepseek_v3"]


#: Mixtral's checkpoint names (transformers writes them still) for transformers 5's module names
MIXTRAL = {"block_sparse_moe.": "mlp.", ".w1": ".gate_proj", ".w3": ".up_proj", ".w2": ".down_proj"}


def _modules(model: anyquant.LoadedModel) -> dict[str, torch.nn.Module]:
    modules = dict(model.module.named_modules())
    for parts in [m for m in modules.values() if isinstance(m, LinearParts)]:
        modules.update(zip(parts.names, parts.parts, strict=True))
    return modules


def _module_name(stored: str) -> str:
    if ".block_sparse_moe." in stored:
        for old, new in MIXTRAL.items():
            stored = stored.replace(old, new)
    return stored


@pytest.mark.parametrize("family", CASES)
def test_family_exl3_decodes_bit_exactly_and_equals_transformers(family: str, tmp_path: Path) -> None:
    import transformers

    from anyquant_exl3.dequant import decode_exl3

    src = make_tiny_dense(tmp_path / "dense", **FAMILIES[family])
    q = anyquant.quantize(src, tmp_path / "q", method="exl3", bits=3, ldlq=False, quality=False)
    stored = load_file(q / "model.safetensors")
    ref, deq = anyquant.load(q, backend="reference"), anyquant.load(q, backend="dequantized")
    assert ref.format == "exl3" and ref.info["unused_tensors"] == []
    modules = _modules(ref)
    names = sorted(k.removesuffix(".trellis") for k in stored if k.endswith(".trellis"))
    assert names and not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in names)  # routers stay 16-bit
    for name in names:
        got = modules[_module_name(name)].dequantize()
        want = decode_exl3(
            stored[f"{name}.trellis"],
            stored[f"{name}.suh"],
            stored[f"{name}.svh"],
            codebook="mul1",
            in_features=got.shape[1],
            out_features=got.shape[0],
        )
        assert torch.equal(got, want), name
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        anyquant.export_dense(q, tmp_path / "exported", dtype="float32"), dtype=torch.float32
    )
    with torch.no_grad():
        a, b, c = ref.module(IDS).logits, deq.module(IDS).logits, dense(IDS).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    prompt = IDS[0, :8].tolist()
    greedy = deq.generator.generate_ids(prompt, deq.params(max_new_tokens=6))
    want_ids = dense.generate(IDS[:, :8], max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    assert greedy == want_ids
