"""Peer worker: load a quantized checkpoint with transformers (+ gptqmodel/optimum on CPU) and
print its greedy tokens and the logits' dtype as JSON. Run in a subprocess: importing gptqmodel
patches transformers globally.

    python tests/peers/hf_generate_worker.py CHECKPOINT '[1, 2, 3]' NEW_TOKENS DTYPE
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    path, prompt, new, dtype = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover
        print(json.dumps({"unavailable": str(exc)}))
        return 77
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=getattr(torch, dtype))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, min_new_tokens=new
        )
        logits = model(ids).logits
    kinds = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})
    print(
        json.dumps(
            {"tokens": out[0, len(prompt) :].tolist(), "modules": kinds, "logits": logits[0, -1].float().tolist()}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
