"""An EXL3 checkpoint under the quantization_config GPTQModel 7.6 writes for EXL3 (its ``EXL3Config.to_dict()``
plus the per-module ``tensor_storage`` its writer adds, both produced by GPTQModel itself in a subprocess) is
detected and loaded as the same checkpoint under anyquant's own config. GPTQModel writes EXL3 only on CUDA, so
its real output is checked by bench/gpu_exl3.sh; this holds the config side of it on CPU."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import anyquant

pytestmark = [
    pytest.mark.peer,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="gptqmodel is not installed"),
]

PEER = r"""
import json, sys
from safetensors.torch import load_file
from gptqmodel.nn_modules.exllamav3_torch import ExllamaV3TorchLinear
from gptqmodel.quantization.config import EXL3Config

tensors = load_file(sys.argv[1])
storage = {}
for key in sorted(k for k in tensors if k.endswith(".trellis")):
    prefix = key.removesuffix(".trellis")
    parts = {s: tensors[f"{prefix}.{s}"] for s in ("trellis", "suh", "svh", "mcg", "mul1") if f"{prefix}.{s}" in tensors}
    k, n = parts["trellis"].shape[0] * 16, parts["trellis"].shape[1] * 16
    module = ExllamaV3TorchLinear.from_tensors(in_features=k, out_features=n, name=prefix, tensors=parts)
    storage[prefix] = module.tensor_storage_entry()
qc = EXL3Config(bits=4.0, head_bits=6.0, codebook="mcg").to_dict()
qc["tensor_storage"] = storage
print("CONFIG " + json.dumps(qc, default=str))
"""

IDS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 109, 121, 32]])


def test_gptqmodel_exl3_config_reads_as_the_same_checkpoint(dense: Path, tmp_path: Path) -> None:
    ours = anyquant.quantize(dense, tmp_path / "ours", method="exl3", bits=4.0, codebook="mcg", quality=False)
    proc = subprocess.run(
        [sys.executable, "-c", PEER, str(ours / "model.safetensors")], capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CONFIG ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    qc = json.loads(lines[0].removeprefix("CONFIG "))
    assert qc["quant_method"] == "exl3" and qc["tensor_storage"], qc  # GPTQModel's own spelling, not ours
    assert {e["mcg_multiplier"] for e in qc["tensor_storage"].values()}, qc["tensor_storage"]

    theirs = tmp_path / "gptqmodel-config"
    shutil.copytree(ours, theirs)
    cfg = json.loads((theirs / "config.json").read_text())
    cfg["quantization_config"] = qc
    (theirs / "config.json").write_text(json.dumps(cfg))

    a, b = anyquant.detect(ours), anyquant.detect(theirs)
    assert (b.format, b.variant) == (a.format, a.variant) == ("exl3", "mcg")
    assert b.details["k_histogram"] == a.details["k_histogram"]
    with torch.inference_mode():
        want = anyquant.load(ours, backend="reference").module(IDS).logits
        got = anyquant.load(theirs, backend="reference").module(IDS).logits
    assert torch.equal(got, want)
