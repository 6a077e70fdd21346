"""``anyquant export PATH --to dense OUT``: any loadable checkpoint -> a normal HF folder.

The result (safetensors + config.json + tokenizer) is what quantizers take as input.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from anyquant.errors import ParameterError, UnsupportedBackendError

from ._staging import check_destination, lock_destination, publish_modes, replace_dir, staging_dir

__all__ = ["export_dense"]

log = logging.getLogger(__name__)


def export_dense(
    path: str | Path, out: str | Path, *, dtype: str = "bfloat16", overwrite: bool = False, **load_kwargs: Any
) -> Path:
    """Dequantize every weight of ``path`` and save a dense transformers folder at ``out``."""
    import torch
    from torch import nn

    from anyquant.api import load
    from anyquant_runtime.build import resolve_dtype

    out = Path(out)
    if isinstance(path, (str, os.PathLike)):
        check_destination(Path(path), out, overwrite, ParameterError, what="export destination")
    load_kwargs.setdefault("runtime", "transformers")  # save_pretrained is transformers' (the native runtime has none)
    backend = load_kwargs.pop("backend", None)
    try:
        # unless asked otherwise, the format's exact dense backend where it has one: a fast backend (auto's
        # choice) would only be dequantized again here
        model = load(path, backend=backend or "dequantized", dtype="float32", **load_kwargs)
    except UnsupportedBackendError:
        if backend is not None:
            raise
        model = load(path, backend="auto", dtype="float32", **load_kwargs)
    target = resolve_dtype(dtype, torch.device("cpu"))
    module = model.module
    retie = False
    replaced: list[str] = []
    for name, child in list(module.named_modules()):
        if any(name.startswith(f"{r}.") for r in replaced):
            continue  # inside a module already made dense (a linear stored as parts)
        dequantize = getattr(child, "dequantize", None)
        if isinstance(child, (nn.Linear, nn.Embedding)) or not callable(dequantize):
            continue  # transformers' PreTrainedModel also has a dequantize(): it has neither attribute below
        dense: nn.Module
        if hasattr(child, "in_features"):  # a quantized linear, or a backend's own LM head
            retie = retie or bool(getattr(child, "tied_to_input_embedding", False))
            weight = dequantize().to(torch.float32)
            bias = getattr(child, "bias", None)
            dense = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="cpu")
            dense.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                dense.bias = nn.Parameter(bias.to(torch.float32), requires_grad=False)
        elif hasattr(child, "num_embeddings"):  # a backend's own input embedding
            dense = nn.Embedding.from_pretrained(  # type: ignore[no-untyped-call]
                dequantize().to(torch.float32), freeze=True
            )
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, dense)
        replaced.append(name)
    from anyquant_runtime.experts import Experts

    for name, child in list(module.named_modules()):
        if isinstance(child, Experts):  # back to transformers' fused form, which save_pretrained knows how to write
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, child.fused())
    if retie:  # a head that read the input embedding's table (GGUF's packed tied head)
        module.config.tie_word_embeddings = True
    if getattr(module.config, "tie_word_embeddings", False):
        module.tie_weights()  # rebuilt modules hold their own copies: one table again, as the config says
    left = [
        f"{name}.{key}" if name else key
        for name, child in module.named_modules()
        if not type(child).__module__.startswith(("torch.", "transformers."))  # a backend's own module
        for key, t in [*child.named_parameters(recurse=False), *child.named_buffers(recurse=False)]
        if t is not None and not t.is_floating_point()
    ]
    if left:
        raise UnsupportedBackendError(
            f"export_dense: {len(left)} tensors of the {model.backend!r} backend have no dense form (e.g. {left[:3]}); "
            "nothing was written. Export with backend='dequantized' or 'reference'."
        )
    module.to(target)
    config = module.config
    for attr in ("quantization_config", "compression_config"):
        if hasattr(config, attr):
            delattr(config, attr)
    lock = lock_destination(out)  # one writer at a time; the commit rechecks overwrite
    try:
        tmp = staging_dir(out)
        try:
            module.save_pretrained(tmp)
            if model.tokenizer is not None:
                model.tokenizer.save_pretrained(tmp)
            publish_modes(tmp)  # mkdtemp made it 0700 and save_pretrained model.safetensors 0600: the usual modes
            replace_dir(tmp, out, overwrite=overwrite, error=ParameterError)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    log.info("exported %s (%s) to %s as dense %s", path, model.format, out, dtype)
    return out
