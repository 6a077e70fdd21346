"""anyquant hooks for GGUF: format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable

from anyquant.plugin import Claim, FormatSpec, Probe, display_name, hookimpl

FORMAT = "gguf"

#: llama.cpp's general.file_type values (LLAMA_FTYPE_*).
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
}


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name=FORMAT,
            loader="anyquant_gguf.loader:GGUFLoader",
            requires=("torch>=2.4", "transformers>=4.56", "gguf>=0.10"),
            description="GGUF (llama.cpp): single file with tokenizer and metadata",
            install_hint="pip install anyquant-gguf",
        )
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    if not probe.gguf or probe.safetensors:
        return None
    files = [g.file for g in probe.gguf]
    g = probe.gguf[0]
    types: dict[str, int] = {}
    for t in g.tensors:
        types[t.type_name] = types.get(t.type_name, 0) + 1
    ftype = g.metadata.get("general.file_type")
    ftype_name = FILE_TYPES.get(ftype, str(ftype)) if isinstance(ftype, int) else None
    evidence = [
        f"GGUF v{g.version} magic in {g.file}",
        f"general.architecture={g.architecture!r}, file_type={ftype_name}",
        f"{len(g.tensors)} tensors: {types}",
    ]
    problems = []
    part = split_part(probe)
    if part is not None:
        problems.append(part)
    elif len(files) > 1:
        problems.append(f"{len(files)} .gguf files in one directory: {files}; pass the path of one{which(probe)}")
    details = {
        "files": files,
        "architecture": g.architecture,
        "file_type": ftype_name,
        "tensor_types": types,
        "name": g.metadata.get("general.name"),
        "problems": problems,
    }
    return Claim(FORMAT, evidence=tuple(evidence + problems), variant=ftype_name, details=details)


def split_part(probe: Probe) -> str | None:
    """What to say when a GGUF file is one part of a model split by llama.cpp's ``gguf-split``
    (metadata ``split.count`` > 1): the parts hold different tensors, and anyquant loads one file."""
    for g in probe.gguf:
        count, no = g.metadata.get("split.count"), g.metadata.get("split.no", 0)
        if isinstance(count, int) and not isinstance(count, bool) and count > 1:
            number = no + 1 if isinstance(no, int) else "?"
            return (
                f"{g.file} is part {number} of a GGUF model split into {count} files (llama.cpp's gguf-split); "
                f"anyquant loads a GGUF model that is one file: merge the parts with "
                f"`llama-gguf-split --merge <first part> merged.gguf` and load merged.gguf"
            )
    return None


def which(probe: Probe) -> str:
    """For a Hugging Face cache snapshot holding several GGUF files: how to name one by model id."""
    name = display_name(probe.root)
    return f" (or by model id: {name}/{probe.gguf[0].file})" if "/" in name and probe.gguf else ""
