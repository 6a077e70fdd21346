"""Worker process: quantize a dense checkpoint with GPTQModel (GPTQ or AWQ) and save it.

Run by :func:`anyquant_tools.quantize.run_worker` as ``python -m anyquant_tools.gptqmodel_worker job.json``
for :class:`anyquant_tools.gptqmodel_quantizer.GPTQModelQuantizer` (the GPTQ and AWQ plugins' quantizers).
It lives in its own process because importing gptqmodel patches transformers globally.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .quantize import emit_progress, emit_result, watch_parent


def _config(job: dict[str, Any]) -> Any:
    from gptqmodel import QuantizeConfig
    from gptqmodel.quantization.config import AWQConfig

    common = {
        "bits": int(job["bits"]),
        "group_size": int(job["group_size"]),
        "sym": bool(job["sym"]),
        "format": job["format"],
        "offload_to_disk": False,
    }
    if job["method"] == "awq":
        return AWQConfig(**common)
    gar = common["group_size"] > 0 and not job["desc_act"]  # GPTQModel's GAR excludes desc_act
    return QuantizeConfig(desc_act=bool(job["desc_act"]), act_group_aware=gar, dynamic=job.get("dynamic"), **common)


def main(job_file: str) -> int:
    watch_parent()  # an orphan (the parent SIGKILLed) exits instead of quantizing for nothing
    job = json.loads(Path(job_file).read_text())
    emit_progress("importing gptqmodel", 0.02)
    try:
        import torch
        from gptqmodel import BACKEND, GPTQModel
    except ImportError as exc:
        print(f"gptqmodel is not importable: {exc}", file=sys.stderr)
        return 3
    torch.manual_seed(int(job.get("seed", 0)))
    texts = json.loads(Path(job["calibration_file"]).read_text())
    emit_progress("loading the source model", 0.05)
    dtype = getattr(torch, job.get("dtype", "float16"))
    model = GPTQModel.load(job["src"], _config(job), dtype=dtype)
    emit_progress(f"quantizing with {len(texts)} calibration samples", 0.1)
    backend = BACKEND.AWQ_TORCH if job["method"] == "awq" else BACKEND.AUTO
    model.quantize(texts, batch_size=int(job.get("batch_size", 4)), backend=backend)
    emit_progress("saving", 0.85)
    model.save(job["dst"])
    emit_result({"dst": job["dst"]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
