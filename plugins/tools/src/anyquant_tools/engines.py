"""Handing a detected checkpoint to the engine that serves it at scale (standard library only).

- **vLLM** (``anyquant serve --engine vllm``, and ``anyquant advise``): :func:`vllm_plan` (and anyquant-serve's
  ``anyquant_serve.detected.vllm_command``, from a checkpoint on disk) builds the ``vllm serve`` command line that detection
  implies: ``--quantization`` for the format (GPTQ ``gptq_marlin``, AWQ ``awq_marlin``, compressed-tensors),
  GGUF's ``--tokenizer``, ``--dtype``, ``--max-model-len`` from the checkpoint. Flags are those of vLLM
  :data:`VLLM_VERSION`'s ``vllm serve`` (``vllm/engine/arg_utils.py``, ``vllm/entrypoints/openai/cli_args.py``).
  vLLM cannot read EXL3 or EXL2: :func:`vllm_plan` refuses them with the way out.
- **exllamav3** (``--engine exllamav3``, CUDA): EXL3 through exllamav3's own batching generator, behind the
  same OpenAI API as the built-in server (anyquant-serve's ``anyquant_serve.exl3``, which checks it can run there),
  tensor parallel over the visible GPUs.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anyquant.errors import ParameterError

__all__ = [
    "ENGINES",
    "VLLM_FLAGS",
    "VLLM_QUANTIZATION",
    "VLLM_VERSION",
    "EngineError",
    "VllmPlan",
    "vllm_plan",
]

#: the engines ``anyquant serve --engine`` knows
ENGINES = ("anyquant", "vllm", "exllamav3")

#: the vLLM release whose ``vllm serve`` flags :func:`vllm_plan` writes
VLLM_VERSION = "0.11.0"

#: every flag :func:`vllm_plan` may write, as vLLM :data:`VLLM_VERSION` spells it (its documented engine and
#: server arguments); the tests check each command against this list
VLLM_FLAGS = frozenset(
    {
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--revision",
        "--tokenizer",
        "--dtype",
        "--max-model-len",
        "--quantization",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--gpu-memory-utilization",
        "--max-num-seqs",
        "--kv-cache-dtype",
        "--distributed-executor-backend",
        "--chat-template",
    }
)

#: vLLM's ``--quantization`` value per anyquant format (on Ampere or newer: the Marlin kernels)
VLLM_QUANTIZATION = {
    "gptq": "gptq_marlin",
    "awq": "awq_marlin",
    "compressed-tensors": "compressed-tensors",
    "bnb": "bitsandbytes",
    "fp8": "fp8",
    "mxfp4": "mxfp4",  # gpt-oss
    "dense": None,
    "gguf": None,  # vLLM reads GGUF from the file itself; no --quantization
}


class EngineError(ParameterError):
    """This engine cannot serve this checkpoint (the message says which one can)."""


@dataclass(frozen=True)
class VllmPlan:
    """What vLLM is told: the model argument and the flags, in order."""

    model: str
    flags: tuple[tuple[str, str | None], ...]
    notes: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        out = ["vllm", "serve", self.model]
        for flag, value in self.flags:
            out.append(flag)
            if value is not None:
                out.append(value)
        return out

    def command(self) -> str:
        return shlex.join(self.argv())


def _refusal(fmt: str, path: str) -> EngineError:
    if fmt == "exl2":  # exllamav3 reads EXL3 only: no advice that leads to another refusal
        return EngineError(
            f"vLLM cannot read EXL2 ({path}), and exllamav3 does not serve it either. Serve it with the built-in "
            f"server (`anyquant serve {path}`) or with exllamav2's TabbyAPI, or quantize the original model to a "
            "format vLLM reads: `anyquant quantize SRC DST --method awq` (or gptq), then `anyquant serve DST --engine vllm`"
        )
    if fmt == "exl3":
        return EngineError(
            f"vLLM cannot read EXL3 ({path}). Serve it with exllamav3 instead: "
            f"`anyquant serve {path} --engine exllamav3` (a CUDA GPU, Ampere or newer), or quantize the original "
            "model to a format vLLM reads: `anyquant quantize SRC DST --method awq` (or gptq), then "
            "`anyquant serve DST --engine vllm`"
        )
    return EngineError(
        f"vLLM cannot serve a {fmt!r} checkpoint ({path}); known to it: "
        + ", ".join(sorted(VLLM_QUANTIZATION))
        + ". Serve it with the built-in server (`anyquant serve PATH`) or quantize to AWQ/GPTQ"
    )


def vllm_plan(
    path: str | Path,
    fmt: str,
    *,
    config: Mapping[str, Any] | None = None,
    quantization_config: Mapping[str, Any] | None = None,
    gguf_context: int | None = None,
    tokenizer: str | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    host: str | None = None,
    port: int | None = None,
    api_key: str | None = None,
    served_model_name: str | None = None,
    gpu_memory_utilization: float | None = None,
    max_num_seqs: int | None = None,
    kv_cache_dtype: str | None = None,
    ampere_or_newer: bool = True,
    revision: str | None = None,
    chat_template: str | None = None,
) -> VllmPlan:
    """The ``vllm serve`` invocation for a checkpoint of format ``fmt`` (``config``: its ``config.json``;
    ``revision``: a Hub model id's branch, tag or commit, passed as ``--revision``; ``chat_template``: a Jinja
    template file vLLM renders chats with instead of the checkpoint's). A tensor-parallel size the model's
    heads, KV heads or MLP widths do not divide over is a :class:`ParameterError` (vLLM would refuse it)."""
    path = str(path)
    if fmt not in VLLM_QUANTIZATION:
        raise _refusal(fmt, path)
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParameterError(f"{name}={value!r}: expected an integer >= 1")
    cfg = dict(config or {})
    qc = dict(quantization_config or cfg.get("quantization_config") or {})
    if tensor_parallel_size > 1:
        check_tensor_parallel(cfg, qc, fmt, tensor_parallel_size)
    flags: list[tuple[str, str | None]] = []
    notes: list[str] = []
    quant = VLLM_QUANTIZATION[fmt]
    if fmt in ("gptq", "awq") and not ampere_or_newer:
        quant = fmt  # the Marlin kernels need compute capability 8.0
    if fmt == "gptq" and quant == "gptq_marlin" and (qc.get("bits", 4) not in (4, 8) or qc.get("sym") is False):
        quant = "gptq"  # Marlin takes symmetric 4/8-bit GPTQ only
        notes.append("GPTQ that is not symmetric 4/8-bit: vLLM's plain gptq kernels, not Marlin")
    if fmt == "gguf":
        model_file = Path(path)
        folder = model_file.parent if model_file.suffix == ".gguf" else model_file
        if tokenizer is None and (folder / "tokenizer.json").is_file():
            tokenizer = str(folder)
        if tokenizer is None:
            notes.append(
                "no --tokenizer: vLLM converts the GGUF's own tokenizer (slow, and vLLM advises the base model's); "
                "pass --tokenizer BASE_MODEL_DIR_OR_ID"
            )
    if revision is not None:
        flags.append(("--revision", revision))
    if tokenizer is not None:
        flags.append(("--tokenizer", tokenizer))
    if quant is not None:
        flags.append(("--quantization", quant))
    if dtype is None:
        dtype = "float16" if fmt == "awq" or not ampere_or_newer else "auto"
    flags.append(("--dtype", dtype))
    length = max_model_len
    if length is None:
        found = gguf_context if fmt == "gguf" else cfg.get("max_position_embeddings")
        length = found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None
    if length is not None:
        flags.append(("--max-model-len", str(length)))
    if tensor_parallel_size > 1:
        flags.append(("--tensor-parallel-size", str(tensor_parallel_size)))
    if pipeline_parallel_size > 1:
        flags.append(("--pipeline-parallel-size", str(pipeline_parallel_size)))
    if gpu_memory_utilization is not None:
        flags.append(("--gpu-memory-utilization", f"{gpu_memory_utilization:.2f}"))
    if max_num_seqs is not None:
        flags.append(("--max-num-seqs", str(max_num_seqs)))
    if kv_cache_dtype is not None:
        flags.append(("--kv-cache-dtype", kv_cache_dtype))
    if chat_template is not None:
        flags.append(("--chat-template", chat_template))
    if served_model_name is not None:
        flags.append(("--served-model-name", served_model_name))
    if host is not None:
        flags.append(("--host", host))
    if port is not None:
        flags.append(("--port", str(port)))
    if api_key is not None:
        flags.append(("--api-key", api_key))
    return VllmPlan(path, tuple(flags), tuple(notes))


def _size(cfg: Mapping[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_tensor_parallel(cfg: Mapping[str, Any], qc: Mapping[str, Any], fmt: str, tp: int) -> None:
    """What vLLM checks before it shards a model over ``tp`` GPUs: the attention heads divide over them, the KV heads
    divide over them or are replicated (``tp`` a multiple of them), each MLP's (or expert's) intermediate width
    divides, and for group-quantized GPTQ/AWQ/compressed-tensors each shard of a row-parallel weight holds whole
    groups. A model that fails one: a :class:`ParameterError` naming the sizes that would work."""
    text = cfg.get("text_config")
    cfg = text if isinstance(text, Mapping) else cfg
    heads = _size(cfg, "num_attention_heads")
    kv = _size(cfg, "num_key_value_heads") or heads
    problems = []
    if heads is not None and heads % tp:
        problems.append(f"its {heads} attention heads do not divide over {tp} GPUs")
    if kv is not None and (kv % tp if kv >= tp else tp % kv):
        problems.append(f"its {kv} KV heads neither divide over {tp} GPUs nor are replicated evenly on them")
    group = qc.get("group_size")
    group = group if isinstance(group, int) and not isinstance(group, bool) and group > 0 else None
    for key in ("intermediate_size", "moe_intermediate_size"):
        width = _size(cfg, key)
        if width is None:
            continue
        if width % tp:
            problems.append(f"its {key} {width} does not divide over {tp} GPUs")
        elif group is not None and fmt in ("gptq", "awq") and (width // tp) % group:
            problems.append(f"a shard of its {key} {width} ({width // tp}) is not whole groups of {group}")
    if problems:
        sizes = [n for n in range(1, 9) if n != tp and _fits(cfg, n)]
        raise ParameterError(
            f"--tensor-parallel-size {tp}: "
            + "; ".join(problems)
            + f" (vLLM refuses it). Sizes up to 8 that fit the heads and widths: {sizes or 'none'}"
        )


def _fits(cfg: Mapping[str, Any], tp: int) -> bool:
    heads = _size(cfg, "num_attention_heads")
    kv = _size(cfg, "num_key_value_heads") or heads
    ok = heads is None or heads % tp == 0
    ok = ok and (kv is None or (kv % tp == 0 if kv >= tp else tp % kv == 0))
    return ok and all((_size(cfg, k) or tp) % tp == 0 for k in ("intermediate_size", "moe_intermediate_size"))
