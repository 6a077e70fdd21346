"""Bad compressed-tensors checkpoints: each a typed error naming what is wrong, before or while the weights are read,
never a dense load. Made from llm-compressor's fixtures with one thing changed."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import anyquant as sdk
from anyquant.errors import (
    AnyquantError,
    CheckpointError,
    ConfigError,
    FormatConflictError,
    NumericalError,
    UnsupportedFormatError,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
Q = "model.layers.0.self_attn.q_proj"


def variant(
    tmp_path: Path,
    name: str = "llama_w4a16",
    config: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    path = tmp_path / name
    shutil.copytree(FIXTURES / name, path)
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg["quantization_config"])
        (path / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(path / "model.safetensors")
        tensors(t)
        save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_unknown_format_is_named(tmp_path: Path) -> None:
    def cfg(qc: dict[str, Any]) -> None:
        qc["format"] = "int3-zigzag"
        qc["config_groups"]["group_0"]["format"] = "int3-zigzag"

    with pytest.raises(UnsupportedFormatError, match="int3-zigzag"):
        sdk.load(variant(tmp_path, config=cfg))


def test_unknown_quantization_type_is_named(tmp_path: Path) -> None:
    def cfg(qc: dict[str, Any]) -> None:
        qc["config_groups"]["group_0"]["weights"]["type"] = "posit"

    with pytest.raises(UnsupportedFormatError, match="posit"):
        sdk.load(variant(tmp_path, config=cfg))


def test_config_format_that_the_tensors_contradict(tmp_path: Path) -> None:
    """The config says float-quantized (FP8); the tensors are packed int4: a conflict, not a guess."""

    def cfg(qc: dict[str, Any]) -> None:
        qc["format"] = "float-quantized"
        qc["config_groups"]["group_0"]["format"] = "float-quantized"

    with pytest.raises(FormatConflictError, match="float-quantized"):
        sdk.load(variant(tmp_path, config=cfg))


def test_bits_that_the_packed_width_contradicts(tmp_path: Path) -> None:
    def cfg(qc: dict[str, Any]) -> None:
        qc["config_groups"]["group_0"]["weights"]["num_bits"] = 8

    with pytest.raises(FormatConflictError, match="int32 columns"):
        sdk.load(variant(tmp_path, config=cfg))


def test_scale_of_the_wrong_shape(tmp_path: Path) -> None:
    def t(d: dict[str, torch.Tensor]) -> None:
        down = "model.layers.0.mlp.down_proj.weight_scale"  # [128, 2]: two groups of 128
        d[down] = d[down][:, :1].contiguous()

    with pytest.raises(FormatConflictError, match="weight_scale"):
        sdk.load(variant(tmp_path, tensors=t))


def test_integer_scale_is_refused(tmp_path: Path) -> None:
    def t(d: dict[str, torch.Tensor]) -> None:
        d[f"{Q}.weight_scale"] = d[f"{Q}.weight_scale"].to(torch.int32)

    with pytest.raises(FormatConflictError, match="weight_scale is I32"):
        sdk.load(variant(tmp_path, tensors=t))


@pytest.mark.parametrize("name", ["llama_w4a16", "llama_fp8_dynamic", "llama_nvfp4a16"])
def test_nan_scale_is_refused_naming_the_tensor(tmp_path: Path, name: str) -> None:
    def t(d: dict[str, torch.Tensor]) -> None:
        s = d[f"{Q}.weight_scale"]
        if s.dtype == torch.float8_e4m3fn:
            s.view(torch.uint8)[0, 0] = 0x7F
        else:
            s[0, 0] = float("nan")

    for backend in ("reference", "auto"):
        with pytest.raises(NumericalError, match="weight_scale"):
            sdk.load(variant(tmp_path / backend, name, tensors=t), backend=backend)


def test_weight_shape_that_disagrees(tmp_path: Path) -> None:
    def t(d: dict[str, torch.Tensor]) -> None:
        d[f"{Q}.weight_shape"] = torch.tensor([128, 120])

    with pytest.raises(CheckpointError, match="weight_shape"):
        sdk.load(variant(tmp_path, tensors=t), backend="reference")


def test_config_without_quantized_tensors_is_never_dense(tmp_path: Path) -> None:
    """The config says compressed-tensors; the tensors are a dense model's: refused, not loaded as dense."""
    path = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_w4a16", path)
    dense = sdk.load(FIXTURES / "llama_w4a16", backend="dequantized")
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in dense.module.state_dict().items()}
    weights = {k: v for k, v in weights.items() if not k.endswith(("_weight", "bias")) or k.endswith(".weight")}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AnyquantError, match=r"no tensor is quantized|dense"):
        sdk.load(path)


def test_transforms_are_refused(tmp_path: Path) -> None:
    def cfg(qc: dict[str, Any]) -> None:
        qc["transform_config"] = {"config_groups": {"u": {"type": "hadamard"}}}

    with pytest.raises(UnsupportedFormatError, match="transform_config"):
        sdk.load(variant(tmp_path, config=cfg))


def test_malformed_group_is_the_config_error_not_unknown(tmp_path: Path) -> None:
    def cfg(qc: dict[str, Any]) -> None:
        qc["config_groups"]["group_0"]["weights"]["num_bits"] = "four"

    with pytest.raises(ConfigError, match="num_bits"):
        sdk.load(variant(tmp_path, config=cfg))


def test_a_catastrophic_target_pattern_is_bounded(tmp_path: Path) -> None:
    """A regex target that backtracks exponentially: a ConfigError within the time limit, not a hung load."""

    def cfg(qc: dict[str, Any]) -> None:
        qc["ignore"] = ["re:" + "(.*)" * 8 + r"\8\7\6\5\4\3\2\1\1\1$", "lm_head"]  # polynomial of degree 8

    start = time.monotonic()
    with pytest.raises(ConfigError, match="too long"):
        sdk.load(variant(tmp_path, config=cfg))
    assert time.monotonic() - start < 30
