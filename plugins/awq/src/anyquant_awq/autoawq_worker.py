"""Worker process: quantize a dense checkpoint with AutoAWQ 0.2.9's own quantizer and save AWQ GEMM.

Run by :func:`anyquant_tools.quantize.run_worker` as ``python -m anyquant_awq.autoawq_worker job.json``
(``quantizer_backend="autoawq"``). It lives in its own process because ``import awq`` calls
``warnings.simplefilter`` globally, prints a deprecation notice and pulls in transformers model code.

The job (written by :class:`anyquant_awq.quantize.AWQQuantizer`, which has already checked the model's
shapes and the calibration texts against AutoAWQ's limits): ``src``, ``dst``, ``calibration_file`` (a
JSON list of texts), ``bits``, ``group_size``, ``zero_point``, ``max_calib_samples``,
``max_calib_seq_len``, ``n_parallel_calib_samples``, ``duo_scaling``, ``apply_clip``, ``seed``.

AutoAWQ runs as released, in float16 (its default; it works on CPU, only slowly), with
``device_map=None`` (the model stays on the CPU; AutoAWQ moves one layer at a time to a GPU when one
is visible) and ``trust_remote_code=False``. With transformers 5.24 its Llama path needs no patch:
the layer kwargs it captures are ``position_ids``, ``position_embeddings`` and ``attention_mask=None``
(SDPA then applies the causal mask itself). What the worker changes, through AutoAWQ's own
``quantizer_cls`` extension point and on the saved files:

- ``zero_point=False``: AutoAWQ computes symmetric codes in ``[-8, 7]`` but its GEMM packer
  (``WQLinear_GEMM.from_linear``) asserts ``zeros is not None``, so 0.2.9 cannot write such a file.
  The quantizer subclass hands the packer zeros filled with ``2**(bits-1)`` (8): the stored codes are
  ``round(w / s) + 8``, what GPTQModel writes for ``sym=True`` AWQ, and dequantize to AutoAWQ's weights.
- the scale search on a CPU: ``_search_best_scale`` keeps the weights to restore after each of its 20
  grid points as ``{k: v.cpu() for k, v in module2inspect.state_dict().items()}``, a copy only when
  the module is on a GPU. On a CPU ``.cpu()`` returns the parameter itself, the first grid point's
  in-place ``weight.mul_(scales)`` lands in that "copy", and every later point, and the weights it
  finally keeps, start from ``W * s0`` instead of ``W``: the chosen scales are then applied on top, so
  the scaled linears end up as ``W * s0 * s`` (measured on SmolLM2-135M: layer 0's q/k/v 0.65
  relative error against ``W * s`` where round-to-nearest gives 0.09; perplexity 22.3 -> 3.6e5).
  The subclass hands the search a module whose ``state_dict()`` returns clones, which is what
  AutoAWQ gets on a GPU.
- progress: one report per quantized layer (the subclass's ``_apply_quant`` runs once per layer).
- ``save_quantized`` writes neither tokenizer nor chat template, and saves the ``use_cache=False``
  and ``do_sample=True`` it set for quantizing: the tokenizer files and ``generation_config.json`` are
  copied from the source and ``use_cache`` restored from the source config.

The result is written to ``dst + ".partial"`` and renamed to ``dst`` when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from anyquant.plugin import TOKENIZER_FILES
from anyquant_tools import emit_progress, emit_result, watch_parent

#: the AutoAWQ this worker was written against (its last release).
AUTOAWQ_VERSION = "0.2.9"


def _quantizer_cls(base: type, n_layers: int) -> type:
    """``AwqQuantizer`` plus the symmetric-zeros fix and per-layer progress (see the module docstring)."""
    import torch

    class AnyquantAwqQuantizer(base):  # type: ignore[misc]
        done = 0

        def _search_best_scale(
            self, module: Any, prev_op: Any, layers: Any, inp: Any, module2inspect: Any = None, kwargs: Any = None
        ) -> Any:
            inspected = module2inspect if module2inspect is not None else layers[0]
            own = inspected.state_dict
            # the weights it restores after each grid point must be a copy, on a CPU too
            inspected.state_dict = lambda *a, **k: {n: t.clone() for n, t in own(*a, **k).items()}
            try:
                return super()._search_best_scale(
                    module, prev_op, layers, inp, module2inspect, kwargs if kwargs is not None else {}
                )
            finally:
                del inspected.state_dict

        def pseudo_quantize_tensor(self, w: torch.Tensor) -> Any:
            w_q, scales, zeros = super().pseudo_quantize_tensor(w)
            if zeros is None:  # zero_point=False: the implicit zero 2**(b-1), explicit for the GEMM packer
                zeros = torch.full_like(scales, 2 ** (self.w_bit - 1))
            return w_q, scales, zeros

        def _apply_quant(self, module: Any, named_linears: Any) -> None:
            super()._apply_quant(module, named_linears)
            self.done += 1
            emit_progress(f"quantized layer {self.done}/{n_layers}", 0.1 + 0.75 * self.done / max(n_layers, 1))

    return AnyquantAwqQuantizer


def _finish(src: Path, out: Path) -> None:
    """Tokenizer, chat template and generation config from the source; ``use_cache`` restored."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    src_cfg = json.loads((src / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    cfg["use_cache"] = src_cfg.get("use_cache", True)
    cfg["quantization_config"]["quantizer"] = f"autoawq-{AUTOAWQ_VERSION}"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main(job_file: str) -> int:
    watch_parent()  # an orphan (the parent SIGKILLed) exits instead of quantizing for nothing
    job = json.loads(Path(job_file).read_text())
    emit_progress("importing autoawq", 0.02)
    try:
        import torch

        with warnings.catch_warnings():  # its import prints a deprecation notice and resets the filters
            warnings.simplefilter("ignore")
            from awq import AutoAWQForCausalLM
            from awq.quantize.quantizer import AwqQuantizer
        from transformers import AutoTokenizer
    except Exception as exc:  # ImportError, or anything its import chain raises
        print(f"autoawq is not importable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    torch.manual_seed(int(job.get("seed", 0)))
    src, dst = Path(job["src"]), Path(job["dst"])
    texts = json.loads(Path(job["calibration_file"]).read_text())
    emit_progress("loading the source model", 0.05)
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoAWQForCausalLM.from_pretrained(
        str(src), torch_dtype=torch.float16, device_map=None, trust_remote_code=False, safetensors=True
    )
    n_layers = len(model.get_model_layers(model.model))
    quant_config = {
        "zero_point": bool(job["zero_point"]),
        "q_group_size": int(job["group_size"]),
        "w_bit": int(job["bits"]),
        "version": "GEMM",
    }
    emit_progress(f"quantizing {n_layers} layers with {len(texts)} calibration samples", 0.1)
    model.quantize(
        tokenizer,
        quant_config=quant_config,
        calib_data=texts,
        max_calib_samples=int(job["max_calib_samples"]),
        max_calib_seq_len=int(job["max_calib_seq_len"]),
        n_parallel_calib_samples=job.get("n_parallel_calib_samples"),
        duo_scaling=bool(job.get("duo_scaling", True)),
        apply_clip=bool(job.get("apply_clip", True)),
        quantizer_cls=_quantizer_cls(AwqQuantizer, n_layers),
    )
    emit_progress("saving", 0.88)
    partial = dst.with_name(dst.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    model.save_quantized(str(partial))
    _finish(src, partial)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(partial, dst)
    emit_result({"dst": str(dst), "quantizer": f"autoawq-{AUTOAWQ_VERSION}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
