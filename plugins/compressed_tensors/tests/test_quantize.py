"""``anyquant quantize`` into compressed-tensors with llm-compressor (issue #40 §5), in its own interpreter
(``ANYQUANT_LLMCOMPRESSOR_PYTHON``; ``make install`` makes ``.venv-llmcompressor``): the output detects as
compressed-tensors, decodes bit-exactly to compressed-tensors' own decompressors (live, ``ct_worker.py``), passes
core's quality gate, and the vLLM hand-off serves it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import anyquant as sdk
from anyquant.errors import QuantizeError
from anyquant.testing.tiny import make_tiny_dense

WORKER = Path(__file__).resolve().parent / "ct_worker.py"
PYTHON = os.environ.get("ANYQUANT_LLMCOMPRESSOR_PYTHON")

needs_llmcompressor = pytest.mark.skipif(
    not PYTHON or not Path(PYTHON).exists(), reason="no ANYQUANT_LLMCOMPRESSOR_PYTHON (make install makes one)"
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("ctq") / "src", dtype="bfloat16")


@needs_llmcompressor
@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "options", "variant"),
    [
        ("w4a16", {"group_size": 64}, "pack-quantized"),
        ("awq", {"quantizer_backend": "llmcompressor", "group_size": 64}, "pack-quantized"),
        ("w8a8", {}, "int-quantized"),
        ("fp8", {}, "float-quantized"),
    ],
)
def test_llmcompressor_output_loads_bit_exactly(
    source: Path, tmp_path: Path, method: str, options: dict[str, object], variant: str
) -> None:
    out = sdk.quantize(
        source, tmp_path / method, method=method, calibration_samples=8, calibration_seq_len=64, **options
    )
    det = sdk.detect(out)
    assert det.format == "compressed-tensors" and det.variant == variant
    assert (out / "anyquant_quality.json").is_file()
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from safetensors.torch import load_file

    peer = load_file(tmp_path / f"{out.name}.safetensors")
    model = sdk.load(out, backend="reference")
    assert len(peer) == det.details["modules"]
    for name, theirs in peer.items():
        ours = model.module.get_submodule(name.removesuffix(".weight")).dequantize()
        assert torch.equal(ours, theirs), name
    vllm_command = pytest.importorskip("anyquant_serve.detected", reason="the server is anyquant-serve's").vllm_command

    assert "compressed-tensors" in " ".join(vllm_command(out).argv())


def test_no_llmcompressor_is_a_clear_error_before_any_work(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANYQUANT_LLMCOMPRESSOR_PYTHON", raising=False)
    import importlib.util

    if importlib.util.find_spec("llmcompressor") is not None:
        pytest.skip("llmcompressor imports in this venv")
    with pytest.raises(QuantizeError, match="llmcompressor_python"):
        sdk.quantize(source, tmp_path / "out", method="w4a16", group_size=64)
    assert not (tmp_path / "out").exists()


def test_unknown_scheme_is_refused(source: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="scheme"):
        sdk.quantize(
            source, tmp_path / "out", method="compressed-tensors", scheme="W3A5", llmcompressor_python=sys.executable
        )


def test_group_size_that_does_not_divide_is_refused(source: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="group_size"):
        sdk.quantize(source, tmp_path / "out", method="w4a16", group_size=48, llmcompressor_python=sys.executable)


@pytest.mark.parametrize(
    ("method", "options", "want"),
    [
        ("w4a16", {}, ("compressed-tensors", {"scheme": "W4A16"})),
        ("fp8", {}, ("compressed-tensors", {"scheme": "FP8_DYNAMIC"})),  # the fp8 format has no quantizer
        (
            "awq",
            {"quantizer_backend": "llmcompressor"},
            ("compressed-tensors", {"modifier": "awq", "scheme": "W4A16_ASYM"}),
        ),
        (
            "gptq",
            {"quantizer_backend": "llmcompressor"},
            ("compressed-tensors", {"modifier": "gptq", "scheme": "W4A16"}),
        ),
        ("awq", {}, ("awq", {})),  # a format's own name keeps its own quantizer
        ("awq", {"quantizer_backend": "gptqmodel"}, ("awq", {})),
        ("w4a16", {"scheme": "W4A16_ASYM"}, ("compressed-tensors", {"scheme": "W4A16_ASYM"})),  # given wins
    ],
)
def test_methods_resolve_to_the_quantizer_that_writes_them(
    method: str, options: dict[str, str], want: tuple[str, dict[str, str]]
) -> None:
    from anyquant.api import default_registry
    from anyquant_tools.quantize import resolve_method

    fmt, got = resolve_method(default_registry(), method, options)
    assert fmt == want[0] and got == {**want[1], **options}
