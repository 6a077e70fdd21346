"""llm-compressor's ``oneshot`` in its own interpreter: ``PYTHON llmcompressor_worker.py job.json``.

A standalone script (standard library, torch, transformers, datasets and llmcompressor; no anyquant: llm-compressor
pins an older transformers than anyquant's, so it usually lives in a venv of its own, ``llmcompressor_python``).
Run by ``anyquant.plugin.run_worker``: progress lines ``ANYQUANT-PROGRESS {json}`` on stdout, the rest to the log.

The job: ``src`` (a dense checkpoint), ``dst``, ``scheme`` (llm-compressor's preset name), ``group_size`` (a
``config_groups`` scheme of that group size instead of the preset's 128, for W4A16/W4A16_ASYM/W8A16), ``modifier``
(``quantization``: data-free round-to-nearest; ``gptq``; ``awq``), ``ignore``, ``texts`` (calibration),
``seq_len``, ``seed``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

PROGRESS = "ANYQUANT-PROGRESS "
#: presets whose weights are integer groups: a group size other than their 128 is written out as a scheme
GROUPED = {"W4A16": (4, True), "W4A16_ASYM": (4, False), "W8A16": (8, True)}


def emit(msg: dict[str, Any]) -> None:
    print(PROGRESS + json.dumps(msg), flush=True)


def recipe_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    scheme, gs = job["scheme"], job.get("group_size", 128)
    kw: dict[str, Any] = {"targets": ["Linear"], "ignore": job.get("ignore") or ["lm_head"]}
    if scheme in GROUPED and gs != 128:
        bits, sym = GROUPED[scheme]
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": gs}
        kw["config_groups"] = {"group_0": {"targets": ["Linear"], "weights": weights}}
    else:
        kw["scheme"] = scheme
    return kw


def modifier(job: dict[str, Any]) -> Any:
    kind = job.get("modifier", "quantization")
    kw = recipe_kwargs(job)
    if kind == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        return GPTQModifier(**kw)
    if kind == "awq":
        import torch
        from llmcompressor.modifiers.awq import AWQModifier

        if not torch.cuda.is_available():
            # llm-compressor 0.14.0.1's AWQ pins cached activations unconditionally, which raises "Cannot access
            # accelerator device" on a CPU-only torch; pinning only speeds transfers up, it changes no number
            from llmcompressor.pipelines.cache import IntermediatesCache

            IntermediatesCache.pin_memory = lambda self, *a, **k: None
        return AWQModifier(**kw)
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(**kw)


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    try:
        import torch
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        print(f"llm-compressor cannot be imported by {sys.executable}: {e}", file=sys.stderr)
        return 3
    torch.manual_seed(int(job.get("seed", 0)))
    emit({"stage": "loading the source", "fraction": 0.05})
    tok = AutoTokenizer.from_pretrained(job["src"])
    model = AutoModelForCausalLM.from_pretrained(job["src"], dtype="auto")
    kw: dict[str, Any] = {}
    texts = job.get("texts") or []
    if job.get("modifier", "quantization") != "quantization" or job.get("calibrate"):
        from datasets import Dataset

        ids = [tok(t, add_special_tokens=False)["input_ids"][: job.get("seq_len", 512)] for t in texts]
        ids = [x for x in ids if x]
        kw.update(
            dataset=Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}),
            num_calibration_samples=len(ids),
            max_seq_length=job.get("seq_len", 512),
            shuffle_calibration_samples=False,
        )
    emit({"stage": f"llm-compressor oneshot ({job.get('modifier', 'quantization')}, {job['scheme']})", "fraction": 0.2})
    started = time.perf_counter()
    model = oneshot(model=model, recipe=modifier(job), tokenizer=tok, **kw)
    emit({"stage": "saving compressed", "fraction": 0.85})
    model.save_pretrained(job["dst"], save_compressed=True)
    tok.save_pretrained(job["dst"])
    import compressed_tensors
    import llmcompressor

    emit(
        {
            "result": {
                "seconds": round(time.perf_counter() - started, 2),
                "llmcompressor": llmcompressor.__version__,
                "compressed_tensors": compressed_tensors.__version__,
                "calibration_samples": len(kw.get("dataset", [])),
            }
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
