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


# ----------------------------------------------------------------------------------------- sparse layouts

S24, S24_FP8, SBM = "llama_sparse24", "llama_sparse24_fp8", "llama_sparse_bitmask"


@pytest.mark.parametrize(
    ("name", "part", "value", "match"),
    [
        (S24, "bitmask", lambda t: t[:, :-1].clone(), r"bitmask \[128, 15\]"),  # one byte short per row
        (S24, "bitmask", lambda t: t.view(torch.int8), "bitmask is I8"),
        (S24, "compressed", lambda t: t[:, :-1].clone(), r"compressed is \[128, 63\]"),  # too few values for 2:4
        (S24_FP8, "shape", lambda t: t.reshape(1, 2), r"shape is I64\[1, 2\]"),
        (SBM, "row_offsets", lambda t: t[:-1].clone(), r"row_offsets is I64\[63\]"),
        (SBM, "compressed", lambda t: t.reshape(1, -1), "compressed is"),
    ],
)
def test_sparse_tensors_whose_headers_disagree(
    tmp_path: Path, name: str, part: str, value: Callable[[torch.Tensor], torch.Tensor], match: str
) -> None:
    """Caught from the headers, before any value is read: the load names the module and the tensor."""

    def t(d: dict[str, torch.Tensor]) -> None:
        d[f"{Q}.{part}"] = value(d[f"{Q}.{part}"])

    with pytest.raises(FormatConflictError, match=match):
        sdk.load(variant(tmp_path, name, tensors=t), backend="reference")


def test_a_24_bitmask_keeping_three_of_four_is_refused(tmp_path: Path) -> None:
    """A 2:4 mask keeps exactly 2 of each 4; a third bit set (the values unchanged) would place them wrongly."""

    def t(d: dict[str, torch.Tensor]) -> None:
        mask = d[f"{Q}.bitmask"].clone()
        low = int(mask[5, 0]) & 0x0F  # the first group of four of row 5: two bits set, set a third
        free = next(b for b in range(4) if not low >> b & 1)
        mask[5, 0] = int(mask[5, 0]) | (1 << free)
        d[f"{Q}.bitmask"] = mask

    with pytest.raises(CheckpointError, match=r"keeps 3 of the 4 values at row 5, columns 0\.\.3"):
        sdk.load(variant(tmp_path, S24, tensors=t), backend="reference")


def test_a_bitmask_counting_other_values_is_refused(tmp_path: Path) -> None:
    """The general bitmask: one value fewer than its set bits (row_offsets and headers still consistent in shape)."""

    def t(d: dict[str, torch.Tensor]) -> None:
        d[f"{Q}.compressed"] = d[f"{Q}.compressed"][:-1].clone()

    with pytest.raises(CheckpointError, match="set bits for 2046 values"):
        sdk.load(variant(tmp_path, SBM, tensors=t), backend="reference")


def test_row_offsets_that_disagree_with_the_mask(tmp_path: Path) -> None:
    def t(d: dict[str, torch.Tensor]) -> None:
        d[f"{Q}.row_offsets"] = d[f"{Q}.row_offsets"] + 1

    with pytest.raises(CheckpointError, match="row_offsets"):
        sdk.load(variant(tmp_path, SBM, tensors=t), backend="reference")


def test_a_huge_sparse_shape_is_refused_before_any_allocation(tmp_path: Path) -> None:
    """``shape`` is data: a value past the headers' [out, in] is a CheckpointError, never a 10^18-element zeros."""

    def t(d: dict[str, torch.Tensor]) -> None:
        d[f"{Q}.shape"] = torch.tensor([[10**9], [10**9]])

    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"shape says \[1000000000, 1000000000\]"):
        sdk.load(variant(tmp_path, S24, tensors=t), backend="reference")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize(
    ("fmt", "error", "match"),
    [
        ("marlin-24", UnsupportedFormatError, "GPU-only 2:4"),
        ("sparse-8-16", UnsupportedFormatError, "sparse-8-16"),
        (["sparse-24-bitmask"], ConfigError, "sparsity_config.format"),
    ],
)
def test_sparsity_formats_anyquant_does_not_read(tmp_path: Path, fmt: Any, error: type[Exception], match: str) -> None:
    def cfg(qc: dict[str, Any]) -> None:
        qc["sparsity_config"]["format"] = fmt

    with pytest.raises(error, match=match):
        sdk.load(variant(tmp_path, S24_FP8, config=cfg))


def test_sparse_tensors_under_a_dense_sparsity_config(tmp_path: Path) -> None:
    def cfg(qc: dict[str, Any]) -> None:
        qc["sparsity_config"]["format"] = "dense"

    with pytest.raises(FormatConflictError, match="sparse tensors"):
        sdk.load(variant(tmp_path, S24, config=cfg))


def test_sparse_tensors_of_a_module_the_config_ignores(tmp_path: Path) -> None:
    """compressed-tensors decompresses the sparsity_config's targets only: an ignored module's tensors contradict it."""

    def cfg(qc: dict[str, Any]) -> None:
        qc["sparsity_config"]["ignore"] = [Q]

    with pytest.raises(FormatConflictError, match="does not target it"):
        sdk.load(variant(tmp_path, S24, config=cfg))


def test_inspect_names_the_sparse_layout() -> None:
    rows = {r.name: r for r in sdk.inspect(FIXTURES / S24_FP8).modules}
    assert rows[Q].format == "ct-fp8+sparse-24-bitmask" and rows[Q].shape == (128, 128)
    assert rows["lm_head"].format == "ct-sparse-24-bitmask" and rows["lm_head"].shape == (259, 128)
