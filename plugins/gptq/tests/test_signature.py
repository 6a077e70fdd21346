"""The GPTQ tensor signature read from headers: the column-at-a-time path (every module consistent)
and the module-by-module path (some module is not) give the same modules, and the second names
each problem. Header-only checkpoints; the expected values are written out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from anyquant import Probe, Registry
from anyquant.testing.fixtures import write_safetensors
from anyquant_gptq.signature import GPTQModule, GPTQSignature, _check_module, read_signature

Spec = dict[str, tuple[str, list[int]]]


def _module(spec: Spec, prefix: str, k: int, n: int, bits: int, group: int, *, bias: bool = False) -> None:
    groups = k // group
    spec[f"{prefix}.qweight"] = ("I32", [k * bits // 32, n])
    spec[f"{prefix}.qzeros"] = ("I32", [groups, n * bits // 32])
    spec[f"{prefix}.scales"] = ("F16", [groups, n])
    spec[f"{prefix}.g_idx"] = ("I32", [k])
    if bias:
        spec[f"{prefix}.bias"] = ("F16", [n])


def _layout() -> Spec:
    """Twelve modules: 4- and 8-bit, two group sizes' worth of shapes, biases on some."""
    spec: Spec = {"model.embed_tokens.weight": ("F16", [64, 256])}
    for i in range(4):
        p = f"model.layers.{i}"
        _module(spec, f"{p}.self_attn.q_proj", 256, 256, 4, 128, bias=True)
        _module(spec, f"{p}.mlp.up_proj", 256, 512, 8 if i == 3 else 4, 128)
        _module(spec, f"{p}.mlp.down_proj", 512, 256, 4, 128)
    return spec


EXPECTED = [
    m
    for i in range(4)
    for m in (
        GPTQModule(f"model.layers.{i}.self_attn.q_proj", 256, 256, 4, 2, True),
        GPTQModule(f"model.layers.{i}.mlp.up_proj", 256, 512, 8 if i == 3 else 4, 2, False),
        GPTQModule(f"model.layers.{i}.mlp.down_proj", 512, 256, 4, 4, False),
    )
]


def _write(root: Path, spec: Spec, qc: dict[str, Any] | None = None) -> Probe:
    write_safetensors(root / "model.safetensors", spec, {"format": "pt"})
    cfg = {"model_type": "llama", "quantization_config": qc or {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    (root / "config.json").write_text(json.dumps(cfg))
    return Probe.open(root)


def _one_by_one(probe: Probe) -> GPTQSignature:
    sig = GPTQSignature()
    for prefix in probe.modules_with("qweight"):
        _check_module(prefix, probe.tensors, sig)
    return sig


def test_consistent_modules_read_a_column_at_a_time(tmp_path: Path) -> None:
    probe = _write(tmp_path, _layout())
    sig = read_signature(probe)
    assert sig.modules == EXPECTED
    assert all(type(m) is GPTQModule for m in sig.modules)
    assert sig.problems == [] and sig.marlin == []
    assert sig.bits_histogram() == {4: 11, 8: 1}
    assert sig == _one_by_one(probe)


M = "model.layers.1.mlp.up_proj"  # K=256, N=512, 4-bit, 2 groups
#: case -> (the tensor rewritten, its new dtype and shape, the problem named, whether the module is still listed)
BROKEN: dict[str, tuple[str, tuple[str, list[int]], str, bool]] = {
    "rank": ("g_idx", ("I32", [256, 1]), f"{M}: qweight/qzeros/scales/g_idx have unexpected ranks", False),
    "bits": ("qweight", ("I32", [40, 512]), f"{M}: qweight I32[40, 512] does not pack K=256 at 2/3/4/8 bits", False),
    "qweight dtype": (
        "qweight",
        ("F32", [32, 512]),
        f"{M}: qweight F32[32, 512] does not pack K=256 at 2/3/4/8 bits",
        False,
    ),
    "zero K": ("g_idx", ("I32", [0]), f"{M}: qweight I32[32, 512] does not pack K=0 at 2/3/4/8 bits", False),
    "scales": ("scales", ("F16", [2, 500]), f"{M}: scales [2, 500] do not match N=512", True),
    "qzeros": ("qzeros", ("I32", [2, 32]), f"{M}: qzeros [2, 32] do not match [2, 512*4/32]", True),
    "g_idx dtype": ("g_idx", ("I64", [256]), f"{M}: g_idx is I64, expected I32", True),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_one_inconsistent_module_is_named_and_the_rest_still_read(tmp_path: Path, case: str) -> None:
    spec = _layout()
    tensor, entry, problem, still_listed = BROKEN[case]
    spec[f"{M}.{tensor}"] = entry
    probe = _write(tmp_path, spec)
    sig = read_signature(probe)
    assert sig.problems == [problem]
    assert [m.name for m in sig.modules] == [m.name for m in EXPECTED if still_listed or m.name != M]
    assert [m for m in sig.modules if m.name != M] == [m for m in EXPECTED if m.name != M]
    assert sig == _one_by_one(probe)
    claim = Registry().detect(probe)
    assert claim.format == "gptq" and problem in claim.details["problems"]


def test_a_module_missing_a_tensor_is_not_a_gptq_module(tmp_path: Path) -> None:
    spec = _layout()
    del spec["model.layers.2.self_attn.q_proj.qzeros"]
    sig = read_signature(_write(tmp_path, spec))
    assert sig.problems == []
    assert sig.modules == [m for m in EXPECTED if m.name != "model.layers.2.self_attn.q_proj"]


def test_group_size_disagreement_names_the_first_module(tmp_path: Path) -> None:
    probe = _write(tmp_path, _layout(), {"quant_method": "gptq", "bits": 4, "group_size": 64})
    problems = Registry().detect(probe).details["problems"]
    assert "config says group_size=64, but 12 module(s) have other group counts (model.layers.0.self_attn.q_proj)" in (
        problems
    )
    agree = _write(tmp_path / "agree", _layout(), {"quant_method": "gptq", "bits": 4, "group_size": 128})
    assert not any("group_size" in p for p in Registry().detect(agree).details["problems"])
