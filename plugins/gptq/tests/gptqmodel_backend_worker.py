"""Run anyquant's ``gptqmodel`` backend on the CPU (GPTQModel's torch kernels) and compare it with
anyquant's own backends; prints one JSON line per checkpoint.

    python gptqmodel_backend_worker.py ROOT VARIANT [VARIANT ...]

ROOT is a peer fixture (``quantized/<variant>`` checkpoints, ``judges/<variant>`` GPTQModel's own
logits). It runs in a subprocess because importing GPTQModel patches transformers process-wide.
For each variant:

- ``fp16_rel`` (and ``fp16_logits_equal``): max |logit difference| / max |logit| between backends ``gptqmodel``
  and ``dequantized`` in fp16 (bitwise equal where both sides' fp16 GEMMs accumulate alike, as on an AMX
  Xeon; not on an AMD EPYC, where ``torch.matmul(x, W)`` and ``F.linear(x, W.T)`` sum in other orders);
- ``judge_rel`` (and ``judge_logits_equal``): the same logits against GPTQModel's own fp16 forward;
- ``weights_exact``: every layer's kernel weight (the kernel applied to an identity) == anyquant's
  reference dequantization;
- ``greedy_equal``: greedy tokens == GPTQModel's;
- ``fp32_rel``: with the model in fp32 (kernels in fp16), max |logit difference| / max |logit| against
  the reference backend in fp32;
- ``kernels``: which GPTQModel kernel class ran how many layers;
- ``export_equal`` (first variant only): ``export_dense`` through the backend writes the same
  tensors as through ``reference``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def main(root: str, variants: list[str]) -> int:
    import torch
    from safetensors.torch import load_file

    import anyquant

    torch.manual_seed(0)
    for i, variant in enumerate(variants):
        path = f"{root}/quantized/{variant}"
        judge = load_file(f"{root}/judges/{variant}/gptqmodel_logits.safetensors")
        ids = judge["input_ids"]
        ref16 = anyquant.load(path, backend="dequantized", dtype="float16")
        ours16 = anyquant.load(path, backend="gptqmodel", dtype="float16", _gptqmodel_cpu=True)
        with torch.no_grad():
            a, b = ref16.module(ids).logits, ours16.module(ids).logits
        ref_layers = dict(ref16.module.named_modules())
        wrapped = {n: m for n, m in ours16.module.named_modules() if type(m).__name__ == "GPTQModelLinear"}
        weights_exact = bool(wrapped) and all(
            torch.equal(m.dequantize(), ref_layers[n]._weight) for n, m in wrapped.items()
        )
        tokens = judge["greedy_tokens"][0].tolist()
        prompt, want = tokens[:8], tokens[8:]
        got = ours16.generator.generate_ids(prompt, ours16.params(max_new_tokens=len(want)))

        ref32 = anyquant.load(path, backend="reference")
        ours32 = anyquant.load(path, backend="gptqmodel", _gptqmodel_cpu=True)
        with torch.no_grad():
            c, d = ref32.module(ids).logits, ours32.module(ids).logits
        row = {
            "variant": variant,
            "backend": ours16.backend,
            "dtype32": ours32.dtype,
            "fp16_logits_equal": bool(torch.equal(a, b)),
            "fp16_rel": _rel(b, a),
            "judge_logits_equal": bool(torch.equal(b, judge["logits"].to(torch.float16))),
            "judge_rel": _rel(b, judge["logits"].to(torch.float16)),
            "weights_exact": weights_exact,
            "greedy_equal": got == want,
            "fp32_rel": float((c - d).abs().max() / c.abs().max()),
            "kernels": ours16.info["gptqmodel"]["kernels"],
            "info": ours32.info["gptqmodel"],
        }
        if i == 0:
            row["export_equal"] = _export_equal(path)
        print(json.dumps(row), flush=True)
    return 0


def _rel(got: object, want: object) -> float:
    import torch

    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _export_equal(path: str) -> bool:
    import tempfile

    import torch
    from safetensors.torch import load_file

    import anyquant

    with tempfile.TemporaryDirectory() as d:
        a = anyquant.export_dense(path, f"{d}/a", dtype="float16", backend="reference")
        b = anyquant.export_dense(
            path, f"{d}/b", dtype="float16", backend="gptqmodel", device="cpu", _gptqmodel_cpu=True
        )
        ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
