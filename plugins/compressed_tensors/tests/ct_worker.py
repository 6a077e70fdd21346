"""The live judge: compressed-tensors' own decompression of a checkpoint, run in a subprocess of the test venv.

``python ct_worker.py OUTDIR CHECKPOINT...`` reads each CHECKPOINT's tensors and config, finds each quantized
module's scheme with compressed-tensors' own target matching (``match_targets``: exact names, ``re:`` patterns, the
``Linear`` class), and decompresses it with the compressor registered for its format
(``BaseCompressor.get_value_from_registry(format).decompress``), model-free: no transformers, so transformers'
loading quirks (5.24 applies the wrong group of a mixed checkpoint) do not stand between the two decoders. Writes
``<module>.weight`` per module to ``OUTDIR/<checkpoint folder name>.safetensors``. Exits 77 when compressed-tensors cannot be imported. A subprocess: its import
pulls torchao and takes seconds.

Sparse checkpoints (``sparsity_config.format`` ``sparse-24-bitmask`` / ``sparse-bitmask``): every module with a
``bitmask`` is decompressed first (``ModelCompressor.decompress_model``'s order), then a quantized one goes through
its quantization compressor. compressed-tensors <= 0.14 has the sparse compressors (``BaseCompressor.
load_from_registry(format, config=...).decompress_weight``); later releases dropped them, and there the sparse step
is 0.14's two lines around the installed release's own ``unpack_bitmasks`` (``zeros``, then the values at the set
bits), labelled ``sparse_judge`` in the output's metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main() -> int:
    try:
        import compressed_tensors  # noqa: F401
        from safetensors.torch import save_file
    except ImportError as e:
        print(f"compressed-tensors unavailable: {e}", file=sys.stderr)
        return 77
    for src in map(Path, sys.argv[2:]):
        save_file(decompress(src), str(Path(sys.argv[1]) / f"{src.name}.safetensors"))
    return 0


def decompress(src: Path) -> dict[str, Any]:
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_targets
    from safetensors.torch import load_file

    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate({"config_groups": {}, **qc})  # a sparse-only config has no groups
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    sparse = qc.get("sparsity_config") or {}
    weights = {}
    sparse_prefixes = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith(".bitmask")})
    for prefix in sparse_prefixes:
        names = ("shape", "compressed", "bitmask", "row_offsets")
        parts = {p: tensors.pop(f"{prefix}.{p}") for p in names if f"{prefix}.{p}" in tensors}
        tensors[f"{prefix}.weight"] = weights[f"{prefix}.weight"] = sparse_decompress(sparse, parts)
    prefixes = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith((".weight_packed", ".weight_scale"))})
    linear = torch.nn.Linear(1, 1)
    for prefix in prefixes:
        if match_targets(prefix, linear, config.ignore or []):
            continue
        scheme = None
        for group in config.config_groups.values():
            if match_targets(prefix, linear, group.targets):
                scheme = group
                break
        if scheme is None:
            continue
        fmt = scheme.format or config.format
        local = {
            n[len(prefix) + 1 :]: t
            for n, t in tensors.items()
            if n.startswith(prefix + ".") and "." not in n[len(prefix) + 1 :]
        }
        state = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)
        weights[f"{prefix}.weight"] = state["weight"].contiguous()
    return weights


def sparse_decompress(sparsity: dict[str, Any], parts: dict[str, Any]) -> Any:
    """One module's dense weight: compressed-tensors' sparse compressor where the installed release has it."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.utils import unpack_bitmasks

    try:
        from compressed_tensors.config import SparsityCompressionConfig

        config = SparsityCompressionConfig.load_from_registry(sparsity["format"], **sparsity)
        compressor = BaseCompressor.load_from_registry(sparsity["format"], config=config)
    except (KeyError, ValueError, ImportError):
        compressor = None  # compressed-tensors > 0.14: its sparse_24_bitmask / sparse_bitmask decompress, below
    if compressor is not None:
        return compressor.decompress_weight({k: v for k, v in parts.items() if k in compressor.compression_param_names})
    shape = parts["shape"].flatten().tolist()
    mask = unpack_bitmasks(parts["bitmask"], shape)
    dense = torch.zeros(shape, dtype=parts["compressed"].dtype)
    dense[mask] = parts["compressed"].flatten()
    return dense


if __name__ == "__main__":
    sys.exit(main())
