"""anyquant hooks for GGUF: format registration and header-only detection."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from anyquant.plugin import (
    AnyquantError,
    CheckpointError,
    Claim,
    FormatSpec,
    GGUFHeader,
    Probe,
    display_name,
    hookimpl,
)

from .split import SplitModel, model_entries, resolve_split

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
    problems: list[str] = []
    model: SplitModel | None = None
    try:
        model = gguf_model(probe)
    except AnyquantError as exc:
        problems.append(str(exc))
    headers = model.headers if model is not None else probe.gguf[:1]
    g = headers[0]
    types: dict[str, int] = {}
    for h in headers:
        for t in h.tensors:
            types[t.type_name] = types.get(t.type_name, 0) + 1
    ftype = g.metadata.get("general.file_type")
    ftype_name = FILE_TYPES.get(ftype, str(ftype)) if isinstance(ftype, int) else None
    evidence = [
        f"GGUF v{g.version} magic in {g.file}",
        f"general.architecture={g.architecture!r}, file_type={ftype_name}",
        f"{sum(len(h.tensors) for h in headers)} tensors: {types}",
    ]
    details: dict[str, Any] = {
        "files": files,
        "architecture": g.architecture,
        "file_type": ftype_name,
        "tensor_types": types,
        "name": g.metadata.get("general.name"),
        "problems": problems,
    }
    if model is not None and model.is_split:
        evidence.append(model.describe())
        if model.asked != model.paths[0]:
            evidence.append(f"{model.asked.name} is a later part: the model loads from its first part, {g.file}")
        details["parts"] = model.names
    return Claim(FORMAT, evidence=tuple(evidence + problems), variant=ftype_name, details=details)


#: the last probe's model (detect, then the loader's validate, plan and reader, read the same probe): one
#: reading of the other parts' headers per load
_LAST: tuple[Probe, SplitModel] | None = None


def gguf_model(probe: Probe) -> SplitModel:
    """The GGUF model a probe holds: its one file, or every part of a model split by llama.cpp's gguf-split
    (:func:`~anyquant_gguf.split.resolve_split`: the probe's own file or directory gives the first part, the other
    parts are found by name beside it, each header read as the probe reads one and checked). A directory holding
    more than one model (several files, or parts of several split models) is a :class:`CheckpointError` naming
    them; so are parts that do not fit together (:class:`~anyquant_gguf.split.GGUFSplitError`)."""
    global _LAST
    last = _LAST
    if last is not None and last[0] is probe:
        return last[1]
    entries = model_entries(probe.gguf)
    if len(entries) != 1:
        names = [h.file for h in entries]
        raise CheckpointError(
            f"{probe.root} holds {len(entries)} GGUF models {names}: pass the path of the one to load"
            f"{which(probe, names[0])}"
        )
    entry = entries[0]

    def read_part(path: Path) -> GGUFHeader:
        return Probe.open(path, allow_symlinks=probe.allow_symlinks).gguf[0]

    model = resolve_split(probe.root / entry.file, entry, read_part, probe.gguf)
    _LAST = (probe, model)
    return model


def which(probe: Probe, file: str | None = None) -> str:
    """For a Hugging Face cache snapshot holding several GGUF files: how to name one by model id."""
    name = display_name(probe.root)
    file = file if file is not None else (probe.gguf[0].file if probe.gguf else None)
    return f" (or by model id: {name}/{file})" if "/" in name and file else ""
