"""Header-only fixtures of every format anyquant knows, written with the standard library.

Each writes a directory (or a ``.gguf`` file) whose headers have the exact tensor names, dtypes
and shapes of its format, with zero-filled (sparse) data. Detection reads only headers, so these
are enough to test that a plugin claims its own format and rejects every other one. Real weights
come from peer-made fixtures in each plugin's tests.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..headers import SAFETENSORS_DTYPE_BITS

__all__ = ["FIXTURES", "Fixture", "write_gguf", "write_safetensors"]

Spec = Mapping[str, tuple[str, Sequence[int]]]

HIDDEN = 128
LAYER = "model.layers.0"
LINEARS = ("self_attn.q_proj", "mlp.down_proj")


def write_safetensors(path: Path, tensors: Spec, metadata: Mapping[str, str] | None = None) -> Path:
    """Write a safetensors file with the given ``{name: (dtype, shape)}`` and zero data (sparse)."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = (SAFETENSORS_DTYPE_BITS[dtype] * math.prod(shape) + 7) // 8
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        fh.truncate(8 + len(blob) + offset)
    return path


def _config(quantization_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
    }
    if quantization_config is not None:
        cfg["quantization_config"] = dict(quantization_config)
    return cfg


def _dense_rest() -> dict[str, tuple[str, list[int]]]:
    return {
        "model.embed_tokens.weight": ("F16", [256, HIDDEN]),
        f"{LAYER}.input_layernorm.weight": ("F16", [HIDDEN]),
        "model.norm.weight": ("F16", [HIDDEN]),
        "lm_head.weight": ("F16", [256, HIDDEN]),
    }


def _write_dir(root: Path, tensors: Spec, config: Mapping[str, Any] | None, name: str = "model.safetensors") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / name, tensors, {"format": "pt"})
    if config is not None:
        (root / "config.json").write_text(json.dumps(config, indent=1))
    return root


def dense(root: Path) -> Path:
    t = _dense_rest()
    for lin in LINEARS:
        t[f"{LAYER}.{lin}.weight"] = ("F16", [HIDDEN, HIDDEN])
    return _write_dir(root, t, _config())


def _gptq_tensors(bits: int = 4, group: int = 32) -> dict[str, tuple[str, list[int]]]:
    t = _dense_rest()
    g = HIDDEN // group
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.qweight"] = ("I32", [HIDDEN * bits // 32, HIDDEN])
        t[f"{p}.qzeros"] = ("I32", [g, HIDDEN * bits // 32])
        t[f"{p}.scales"] = ("F16", [g, HIDDEN])
        t[f"{p}.g_idx"] = ("I32", [HIDDEN])
    return t


def gptq_v1(root: Path) -> Path:
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
    }
    return _write_dir(root, _gptq_tensors(), _config(qc))


def gptq_v2(root: Path) -> Path:
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq_v2",
    }
    return _write_dir(root, _gptq_tensors(), _config(qc))


def gptq_autogptq(root: Path) -> Path:
    """Old AutoGPTQ: only quantize_config.json, no quant_method in config.json."""
    _write_dir(root, _gptq_tensors(), _config())
    (root / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "desc_act": False}))
    return root


def awq_gemm(root: Path) -> Path:
    t = _dense_rest()
    g = HIDDEN // 32
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.qweight"] = ("I32", [HIDDEN, HIDDEN // 8])
        t[f"{p}.qzeros"] = ("I32", [g, HIDDEN // 8])
        t[f"{p}.scales"] = ("F16", [g, HIDDEN])
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    return _write_dir(root, t, _config(qc))


def awq_gemv(root: Path) -> Path:
    t = _dense_rest()
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.qweight"] = ("I32", [HIDDEN, HIDDEN // 8])
        t[f"{p}.qzeros"] = ("I32", [HIDDEN, 1])
        t[f"{p}.scales"] = ("F16", [HIDDEN, 8])
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemv"}
    return _write_dir(root, t, _config(qc))


def _exl3_tensors(k: int, marker: str | None) -> dict[str, tuple[str, list[int]]]:
    t = _dense_rest()
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.trellis"] = ("I16", [HIDDEN // 16, HIDDEN // 16, 16 * k])
        t[f"{p}.suh"] = ("F16", [HIDDEN])
        t[f"{p}.svh"] = ("F16", [HIDDEN])
        if marker:
            t[f"{p}.{marker}"] = ("I32", [])
    return t


def exl3_mul1(root: Path) -> Path:
    qc = {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 16, "codebook": "mul1"}
    return _write_dir(root, _exl3_tensors(4, "mul1"), _config(qc))


def exl3_ring_embedding(root: Path) -> Path:
    """exllamav3 1.6 with ``--embed_bits 4``: the token embedding as a ring-coded table in two row shards."""
    t = _exl3_tensors(4, "mul1")
    del t["model.embed_tokens.weight"]
    words = -(-HIDDEN // 256) * (1 + 16 * 4)
    t["model.embed_tokens.shard_0.trellis"] = ("I16", [128, words])
    t["model.embed_tokens.shard_1.trellis"] = ("I16", [128, words])
    t["model.embed_tokens.signs"] = ("F16", [-(-HIDDEN // 256), 256])
    qc = {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 16, "codebook": "mul1"}
    return _write_dir(root, t, _config(qc))


def exl3_3inst(root: Path) -> Path:
    qc = {"quant_method": "exl3", "version": "0.0.3", "bits": 3.0, "head_bits": 16}
    return _write_dir(root, _exl3_tensors(3, None), _config(qc))


def exl2(root: Path) -> Path:
    t: dict[str, tuple[str, list[int]]] = {k: ("F16", v[1]) for k, v in _dense_rest().items()}
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.q_weight"] = ("I32", [HIDDEN * 4 // 32, HIDDEN])
        t[f"{p}.q_scale"] = ("I32", [4, HIDDEN // 8])
        t[f"{p}.q_scale_max"] = ("F16", [4])
        t[f"{p}.q_groups"] = ("I16", [8])
        t[f"{p}.q_invperm"] = ("I32", [HIDDEN])
    return _write_dir(root, t, _config(), name="output.safetensors")


def compressed_tensors(root: Path) -> Path:
    t = _dense_rest()
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.weight_packed"] = ("I32", [HIDDEN, HIDDEN * 4 // 32])
        t[f"{p}.weight_scale"] = ("F16", [HIDDEN, HIDDEN // 32])
        t[f"{p}.weight_shape"] = ("I64", [2])
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    return _write_dir(root, t, _config(qc))


def bnb_4bit(root: Path) -> Path:
    t = _dense_rest()
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.weight"] = ("U8", [HIDDEN * HIDDEN // 2, 1])
        t[f"{p}.weight.absmax"] = ("F32", [HIDDEN * HIDDEN // 64])
        t[f"{p}.weight.quant_map"] = ("F32", [16])
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    return _write_dir(root, t, _config(qc))


def fp8(root: Path) -> Path:
    t = _dense_rest()
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.weight"] = ("F8_E4M3", [HIDDEN, HIDDEN])
        t[f"{p}.weight_scale_inv"] = ("F32", [1, 1])
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    return _write_dir(root, t, _config(qc))


def mlx(root: Path) -> Path:
    """mlx-lm's 4-bit affine layout: uint32-packed weights, bfloat16 scales and biases per group of 64."""
    t = _dense_rest()
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.weight"] = ("U32", [HIDDEN, HIDDEN * 4 // 32])
        t[f"{p}.scales"] = ("BF16", [HIDDEN, HIDDEN // 64])
        t[f"{p}.biases"] = ("BF16", [HIDDEN, HIDDEN // 64])
    cfg = _config()
    cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    return _write_dir(root, t, cfg)


def hqq(root: Path) -> Path:
    t = _dense_rest()
    for lin in LINEARS:
        p = f"{LAYER}.{lin}"
        t[f"{p}.W_q"] = ("U8", [HIDDEN * HIDDEN // 2])
        t[f"{p}.scale"] = ("F16", [HIDDEN * HIDDEN // 64, 1])
        t[f"{p}.zero"] = ("F16", [HIDDEN * HIDDEN // 64, 1])
    return _write_dir(root, t, _config({"quant_method": "hqq"}))


def _gguf_str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(
    path: Path,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, tuple[int, list[int]]],
    *,
    alignment: int = 32,
) -> Path:
    """A GGUF v3 file: string/int/float metadata, and ``{name: (ggml type id, ne dims)}`` tensors
    (F32 type 0 and F16 type 1 sized exactly; data zero-filled)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _gguf_str(key)
        if isinstance(value, str):
            out += struct.pack("<I", 8) + _gguf_str(value)
        elif isinstance(value, bool):
            out += struct.pack("<I?", 7, value)
        elif isinstance(value, int):
            out += struct.pack("<Iq", 11, value)
        elif isinstance(value, float):
            out += struct.pack("<If", 6, value)
        else:
            raise TypeError(f"unsupported GGUF metadata value {value!r}")
    offset = 0
    sizes = {0: 4, 1: 2}
    for name, (type_id, dims) in tensors.items():
        out += _gguf_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", type_id, offset)
        offset += -(-sizes[type_id] * math.prod(dims) // alignment) * alignment
    out += b"\0" * (-len(out) % alignment)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.write(out)
        fh.truncate(len(out) + offset)
    return path


def gguf(root: Path) -> Path:
    return write_gguf(
        root / "model.gguf",
        {"general.architecture": "llama", "general.name": "tiny", "general.file_type": 1, "llama.block_count": 1},
        {"token_embd.weight": (1, [HIDDEN, 256]), "output_norm.weight": (0, [HIDDEN])},
    )


class Fixture:
    def __init__(self, name: str, format: str, build: Callable[[Path], Path]) -> None:
        self.name, self.format, self.build = name, format, build

    def __repr__(self) -> str:
        return f"Fixture({self.name!r} -> {self.format!r})"


#: every header-only fixture, with the format id detection must give it.
FIXTURES: dict[str, Fixture] = {
    f.name: f
    for f in [
        Fixture("dense", "dense", dense),
        Fixture("gptq_v1", "gptq", gptq_v1),
        Fixture("gptq_v2", "gptq", gptq_v2),
        Fixture("gptq_autogptq", "gptq", gptq_autogptq),
        Fixture("awq_gemm", "awq", awq_gemm),
        Fixture("awq_gemv", "awq", awq_gemv),
        Fixture("exl3_mul1", "exl3", exl3_mul1),
        Fixture("exl3_3inst", "exl3", exl3_3inst),
        Fixture("exl3_ring_embedding", "exl3", exl3_ring_embedding),
        Fixture("exl2", "exl2", exl2),
        Fixture("compressed_tensors", "compressed-tensors", compressed_tensors),
        Fixture("bnb_4bit", "bnb", bnb_4bit),
        Fixture("fp8", "fp8", fp8),
        Fixture("mlx", "mlx", mlx),
        Fixture("hqq", "hqq", hqq),
        Fixture("gguf", "gguf", gguf),
    ]
}
