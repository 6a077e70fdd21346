"""Issue #44 item 6: dense NaN/inf weights loaded and failed only at generate ("the model produced non-finite
logits"), without naming the tensor; only norms, biases and the input embedding were checked at load. Every
floating tensor the build fills is now checked: a :class:`~anyquant.errors.NumericalError` at ``anyquant.load``
naming it (SECURITY.md, "Non-finite weights are refused at load"). The GGUF plugin's block scales and F32
linears: ``plugins/gguf/tests/test_gguf_non_finite.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

import anyquant
from anyquant.errors import NumericalError
from anyquant.testing.tiny import make_tiny_dense


@pytest.mark.parametrize(
    ("tensor", "bad", "dtype"),
    [
        ("model.layers.0.self_attn.q_proj.weight", float("nan"), "float32"),
        ("model.layers.1.mlp.down_proj.weight", float("inf"), "float32"),
        ("model.layers.0.mlp.gate_proj.weight", float("-inf"), "bfloat16"),
        ("lm_head.weight", float("nan"), "float16"),
    ],
)
@pytest.mark.parametrize("runtime", ["native", "transformers"])
def test_a_non_finite_dense_weight_is_refused_at_load(
    tmp_path: Path, tensor: str, bad: float, dtype: str, runtime: str
) -> None:
    from safetensors.torch import load_file, save_file

    root = make_tiny_dense(tmp_path / "m", dtype=dtype, tie_word_embeddings=False)
    state = load_file(root / "model.safetensors")
    state[tensor].view(-1)[7] = bad
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NumericalError, match=rf"'{tensor.replace('.', '[.]')}' holds 1 (NaN|inf)"):
        anyquant.load(root, runtime=runtime)
