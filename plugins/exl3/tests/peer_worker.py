"""Subprocess worker: decode EXL3 test cases with GPTQModel's ``ExllamaV3TorchLinear`` (an independent CPU
implementation), so the comparison never imports gptqmodel into the test process (it patches transformers).

Usage: ``python peer_worker.py INPUT.safetensors OUTPUT.safetensors``

Input: tensors ``<case>.trellis``, ``<case>.suh``, ``<case>.svh`` and optional ``<case>.mcg`` / ``<case>.mul1``
markers; ``__metadata__["cases"]`` is a JSON list of case names. Dims are the padded ones.

Output per case (all taken from the peer):
  ``<case>.states``    int32 [k/16, n/16, 256]   ``_unpack_indices()`` (stream order)
  ``<case>.inner``     fp32  [k, n]              ``get_inner_weight_tensor(dtype=float32)`` (fp32 codebook)
  ``<case>.weight``    fp32  [k, n]              ``get_weight_tensor(dtype=float32)``
  ``<case>.weight16``  fp32  [k, n]              the peer's own Hadamard/scale path applied to ``inner`` rounded
                                                 to fp16 (the CUDA kernels' codebook rounding)
"""

from __future__ import annotations

import json
import os
import sys


def _decode_case(linear_cls, tensors: dict, name: str) -> dict:
    import torch

    trellis = tensors["trellis"]
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    module = linear_cls.from_tensors(in_features=k, out_features=n, name=name, tensors=tensors)
    states = module._unpack_indices().to(torch.int32)
    inner = module.get_inner_weight_tensor(dtype=torch.float32).clone()
    weight = module.get_weight_tensor(dtype=torch.float32).clone()
    # Re-run the peer's transform path on fp16-rounded codebook values (its cache is keyed on the buffers,
    # which did not change, so the substituted inner tensor is used as is).
    module._inner_weight_fp32 = inner.half().float()
    module._weight_fp32 = None
    weight16 = module.get_weight_tensor(dtype=torch.float32).clone()
    return {"states": states, "inner": inner, "weight": weight, "weight16": weight16}


def main(argv: list[str]) -> int:
    in_path, out_path = argv[1], argv[2]
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "1")
    from gptqmodel.nn_modules.exllamav3_torch import ExllamaV3TorchLinear
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(in_path, framework="pt") as f:
        cases = json.loads(f.metadata()["cases"])
        keys = set(f.keys())
        out = {}
        for case in cases:
            tensors = {
                part: f.get_tensor(f"{case}.{part}")
                for part in ("trellis", "suh", "svh", "mcg", "mul1")
                if f"{case}.{part}" in keys
            }
            for part, value in _decode_case(ExllamaV3TorchLinear, tensors, case).items():
                out[f"{case}.{part}"] = value.contiguous()
    tmp = out_path + ".tmp"
    save_file(out, tmp)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
