"""Linears stored as parts (format doc §2.8): fused projections that exllamav3 and exllamav2 write split
(Phi-3's ``qkv_proj`` as ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` as ``gate_proj``/``up_proj``) and
exllamav3's ``.slice.N`` pieces of a very wide MLP."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import anyquant
from anyquant.errors import CheckpointError
from anyquant.probe import Probe
from anyquant.testing.tiny import make_tiny_dense
from anyquant_exl3.dequant import decode_exl3
from anyquant_exl3.encode import encode_exl3
from anyquant_exl3.exl2.dequant import decode_exl2, pack_exl2
from anyquant_exl3.loader import stored_parts
from anyquant_exl3.qlinear import LinearParts

IDS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 109, 121, 32]])
PHI3 = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False, device="meta")


def test_slice_sizes_follow_exllamav3(tmp_path: Path) -> None:
    """``n`` slices of ``I // n // 128 * 128``, the last taking the rest (exllamav3 ``modules/mlp.py``);
    gate/up slices split the outputs, down slices the inputs (their trellis covers a chunk of the input)."""
    probe = Probe.open(make_tiny_dense(tmp_path / "cfg", num_hidden_layers=1))
    up = {f"m.up_proj.slice.{i}": {"in_pad": 8192, "out_pad": 40192} for i in range(3)}
    plan = stored_parts("m.up_proj", _linear(8192, 120000), up, probe)
    assert plan is not None and not plan.split_input
    assert [p[2] for p in plan.parts] == [39936, 39936, 40128] and {p[1] for p in plan.parts} == {8192}
    down = {f"m.down_proj.slice.{i}": {"in_pad": 40192, "out_pad": 8192} for i in range(3)}
    plan = stored_parts("m.down_proj", _linear(120000, 8192), down, probe)
    assert plan is not None and plan.split_input and [p[1] for p in plan.parts] == [39936, 39936, 40128]
    assert stored_parts("m.gate_proj", _linear(8192, 120000), up, probe) is None
    # q/k/v from the head counts (4 heads, 2 KV heads, head_dim 32 for hidden 128); gate/up halves
    qkv = {f"a.{p}": {} for p in ("q_proj", "k_proj", "v_proj")}
    plan = stored_parts("a.qkv_proj", _linear(128, 256), qkv, probe)
    assert plan is not None and [(n, o) for n, _, o in plan.parts] == [
        ("a.q_proj", 128),
        ("a.k_proj", 64),
        ("a.v_proj", 64),
    ]
    with pytest.raises(CheckpointError, match="do not add up"):
        stored_parts("a.qkv_proj", _linear(128, 320), qkv, probe)
    assert stored_parts("a.qkv_proj", _linear(128, 256), {"a.q_proj": {}}, probe) is None


def test_parts_module_joins_and_adds() -> None:
    class Dense(nn.Module):
        def __init__(self, w: torch.Tensor) -> None:
            super().__init__()
            self.w, self.in_features, self.out_features, self.bias = w, w.shape[1], w.shape[0], None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.t()

        def dequantize(self) -> torch.Tensor:
            return self.w

    w = torch.randn(12, 10, dtype=torch.float64)
    x = torch.randn(3, 10, dtype=torch.float64)
    rows = LinearParts([Dense(w[:5]), Dense(w[5:])], 10, 12, split_input=False)  # type: ignore[list-item]
    cols = LinearParts([Dense(w[:, :4]), Dense(w[:, 4:])], 10, 12, split_input=True)  # type: ignore[list-item]
    for m in (rows, cols):
        torch.testing.assert_close(m(x), x @ w.t())
        assert torch.equal(m.dequantize(), w)
    with pytest.raises(ValueError, match="do not make"):
        LinearParts([Dense(w[:5]), Dense(w[5:])], 10, 13, split_input=False)  # type: ignore[list-item]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("phi3") / "dense", num_hidden_layers=1, **PHI3)


@pytest.mark.slow
def test_phi3_exl3_is_written_split_and_loads_fused(phi3: Path, tmp_path: Path) -> None:
    """anyquant's encoder splits Phi-3's fused projections as exllamav3's converter does; the loader joins them
    back into transformers' fused modules; export_dense writes the fused weights again."""
    q = anyquant.quantize(phi3, tmp_path / "q", method="exl3", bits=4, ldlq=False, quality=False)
    stored = load_file(q / "model.safetensors")
    assert {k.rsplit(".", 2)[-2] for k in stored if k.endswith(".trellis")} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in stored)
    ref, deq = anyquant.load(q, backend="reference"), anyquant.load(q, backend="dequantized")
    src = anyquant.load(phi3)
    attn = ref.module.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, LinearParts) and attn.qkv_proj.sizes == [128, 64, 64]
    p = "model.layers.0.self_attn"
    want = torch.cat(
        [
            decode_exl3(
                stored[f"{p}.{m}.trellis"],
                stored[f"{p}.{m}.suh"],
                stored[f"{p}.{m}.svh"],
                codebook="mul1",
                in_features=128,
                out_features=n,
            )
            for m, n in (("q_proj", 128), ("k_proj", 64), ("v_proj", 64))
        ]
    )
    assert torch.equal(attn.qkv_proj.dequantize(), want)
    w = src.module.get_submodule(f"{p}.qkv_proj").weight
    assert ((want.float() - w).pow(2).mean() / w.pow(2).mean()).item() < 0.01
    with torch.no_grad():
        a, b, c = ref.module(IDS).logits, deq.module(IDS).logits, src.module(IDS).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ((a - c).abs().max() / c.abs().max()).item() < 0.15
    from anyquant_cpu.engine import Int8BlockLinear, PrepackedBf16Linear, bf16_head_status, block_kernel_is_fast

    if bf16_head_status()[0]:  # cpu-fast builds each part: bfloat16 prepacked (its exact weight kept) ...
        bf16 = anyquant.load(q, backend="cpu-fast", cpu_fast_weights="bfloat16")
        fast = bf16.module.model.layers[0].self_attn.qkv_proj
        assert isinstance(fast, LinearParts) and all(isinstance(x, PrepackedBf16Linear) for x in fast.parts)
        assert torch.equal(fast.dequantize(), want)
    if bf16_head_status()[0] and block_kernel_is_fast():  # ... or as Q8_0 blocks (the default there)
        fast = anyquant.load(q, backend="cpu-fast").module.model.layers[0].self_attn.qkv_proj
        assert isinstance(fast, LinearParts) and all(isinstance(x, Int8BlockLinear) for x in fast.parts)
        assert float((fast.dequantize() - want.float()).abs().max()) <= float(want.abs().max()) / 127
    out = anyquant.export_dense(q, tmp_path / "exported", dtype="float32")
    exported = load_file(out / "model.safetensors")
    assert torch.equal(exported[f"{p}.qkv_proj.weight"], want.float())
    mlp = deq.module.model.layers[0].mlp.gate_up_proj
    assert torch.equal(exported["model.layers.0.mlp.gate_up_proj.weight"], mlp.dequantize().float())


@pytest.mark.slow
def test_phi3_exl2_split_loads_fused(phi3: Path, tmp_path: Path) -> None:
    """exllamav2 renames fused tensors too: q/k/v and gate/up EXL2 parts load into Phi-3's fused modules."""
    out = tmp_path / "exl2"
    shutil.copytree(phi3, out)
    state = load_file(out / "model.safetensors")
    p, m = "model.layers.0.self_attn", "model.layers.0.mlp"
    qkv, gate_up = state.pop(f"{p}.qkv_proj.weight"), state.pop(f"{m}.gate_up_proj.weight")
    parts = {f"{p}.q_proj": qkv[:128], f"{p}.k_proj": qkv[128:192], f"{p}.v_proj": qkv[192:]}
    parts |= {f"{m}.gate_proj": gate_up[:256], f"{m}.up_proj": gate_up[256:]}
    parts |= {f"{p}.o_proj": state.pop(f"{p}.o_proj.weight"), f"{m}.down_proj": state.pop(f"{m}.down_proj.weight")}
    expected: dict[str, torch.Tensor] = {}
    for prefix, w in parts.items():
        n_out, k = w.shape
        n_pad = -(-n_out // 32) * 32
        wp = torch.zeros(k, n_pad)
        wp[:, :n_out] = w.t()
        groups = k // 32
        q_scale_max = wp.abs().reshape(groups, 32, n_pad).amax(dim=(1, 2)) / 8 + 1e-3
        codes = torch.full((groups, n_pad), 15, dtype=torch.int64)
        scale = q_scale_max.half().float()[:, None].repeat_interleave(32, 0)
        q = torch.clamp(torch.round(wp / scale) + 8, 0, 15).to(torch.int64)
        packed = pack_exl2(q, [4] * groups, [32] * groups, codes, q_scale_max, torch.arange(k))
        state.update({f"{prefix}.{key}": value for key, value in packed.items()})
        expected[prefix] = decode_exl2(
            **{k2: packed[k2] for k2 in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")},
            out_features=n_out,
        )
    (out / "model.safetensors").unlink()
    save_file(state, out / "output.safetensors")
    assert anyquant.detect(out).format == "exl2"
    model = anyquant.load(out, backend="reference")
    fused = model.module.get_submodule(f"{p}.qkv_proj")
    assert isinstance(fused, LinearParts)
    assert torch.equal(fused.dequantize(), torch.cat([expected[f"{p}.{x}"] for x in ("q_proj", "k_proj", "v_proj")]))
    gu = model.module.get_submodule(f"{m}.gate_up_proj")
    assert torch.equal(gu.dequantize(), torch.cat([expected[f"{m}.gate_proj"], expected[f"{m}.up_proj"]]))
    with torch.no_grad():
        a, c = model.module(IDS).logits, anyquant.load(phi3).module(IDS).logits
    assert ((a - c).abs().max() / c.abs().max()).item() < 0.2


@pytest.mark.slow
def test_mlp_slices_load_as_one_linear(dense: Path, tmp_path: Path, rewrite_checkpoint: Any) -> None:
    """A Llama whose MLP is stored as exllamav3 slices (2 x 128 of the intermediate 256)."""
    expected: dict[str, list[torch.Tensor]] = {}

    def slice_mlp(state: dict[str, torch.Tensor]) -> None:
        for seed, name in enumerate([n for n in state if n.endswith("_proj.weight")]):
            prefix, w = name.removesuffix(".weight"), state.pop(name)
            halves = [w[:, :128], w[:, 128:]] if "down" in prefix else [w[:128], w[128:]]
            pieces = [w] if "self_attn" in prefix else halves
            for i, piece in enumerate(pieces):
                key = prefix if len(pieces) == 1 else f"{prefix}.slice.{i}"
                enc = encode_exl3(piece.float(), 4, codebook="mul1", seed=10 * seed + i)
                state.update({f"{key}.{s}": v for s, v in enc.items()})
                o, k = piece.shape
                expected.setdefault(prefix, []).append(
                    decode_exl3(enc["trellis"], enc["suh"], enc["svh"], codebook="mul1", in_features=k, out_features=o)
                )

    out = rewrite_checkpoint(dense, tmp_path / "sliced", slice_mlp)
    assert anyquant.detect(out).format == "exl3"  # the tensors decide (config.json is the dense source's)
    ref, deq = anyquant.load(out, backend="reference"), anyquant.load(out, backend="dequantized")
    mlp = ref.module.model.layers[0].mlp
    assert isinstance(mlp.down_proj, LinearParts) and mlp.down_proj.split_input and mlp.down_proj.sizes == [128, 128]
    assert isinstance(mlp.gate_proj, LinearParts) and not mlp.gate_proj.split_input
    p = "model.layers.0.mlp"
    assert torch.equal(mlp.gate_proj.dequantize(), torch.cat(expected[f"{p}.gate_proj"]))
    assert torch.equal(mlp.down_proj.dequantize(), torch.cat(expected[f"{p}.down_proj"], dim=1))
    src = anyquant.load(dense)
    with torch.no_grad():
        a, b, c = ref.module(IDS).logits, deq.module(IDS).logits, src.module(IDS).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ((a - c).abs().max() / c.abs().max()).item() < 0.15


@pytest.mark.slow
def test_moe_experts_exl3(tmp_path: Path) -> None:
    """A Qwen3-MoE quantized by anyquant's encoder: one EXL3 linear per expert (the router stays 16-bit, as
    exllamav3 keeps it); they load as transformers' MoE block's experts, decode bit-exactly to the stored
    trellis, and the model computes what transformers computes on the decoded weights (export_dense)."""
    import transformers

    from anyquant_runtime.experts import Experts

    src = make_tiny_dense(
        tmp_path / "dense",
        num_hidden_layers=1,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=32,
        norm_topk_prob=True,
    )
    q = anyquant.quantize(src, tmp_path / "q", method="exl3", bits=2, ldlq=False, quality=False)
    stored = load_file(q / "model.safetensors")
    assert "model.layers.0.mlp.gate.weight" in stored and "model.layers.0.mlp.experts.3.down_proj.trellis" in stored
    ref, deq = anyquant.load(q, backend="reference"), anyquant.load(q, backend="dequantized")
    assert ref.info["unused_tensors"] == []
    experts = ref.module.model.layers[0].mlp.experts
    assert isinstance(experts, Experts) and len(experts) == 4
    p = "model.layers.0.mlp.experts.2.down_proj"
    want = decode_exl3(
        stored[f"{p}.trellis"],
        stored[f"{p}.suh"],
        stored[f"{p}.svh"],
        codebook="mul1",
        in_features=128,
        out_features=128,
    )
    assert torch.equal(experts[2].down_proj.dequantize(), want)
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        anyquant.export_dense(q, tmp_path / "exported", dtype="float32"), dtype=torch.float32
    )
    with torch.no_grad():
        a, b, c = ref.module(IDS).logits, deq.module(IDS).logits, dense(IDS).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
