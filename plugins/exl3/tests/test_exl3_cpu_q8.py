"""EXL3 / EXL2 ``cpu-fast``: each decoded linear as Q8_0 blocks on the compiled block kernel (the default where the
kernel is built and vectorized, load option ``cpu_fast_weights``) or as bfloat16 prepacked for oneDNN.

The tolerance both forms are held to against the exact ``dequantized`` backend is cpu-fast's (the bfloat16 class of
the int4 path, ``test_loader.py``): logits within 2e-2 of the largest logit, the argmax at nearly every position and
the same greedy tokens. Measured on these fixtures (docs/benchmarks.md, "EXL3 on a CPU: bfloat16 vs Q8_0 blocks"):
EXL3 1.09e-2 Q8_0 against 1.17e-2 bfloat16 (the Q8_0 head's share of either, 4.6e-3 against 2.8e-3 with a dense
head), EXL2 1.07e-2 against 1.12e-2; 40 greedy tokens equal on four prompts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from anyquant_cpu.engine import (
    Int8BlockLinear,
    PrepackedBf16Linear,
    bf16_head_status,
    block_kernel_is_fast,
    fast_cpu_module,
)
from anyquant_cpu.kernels.linear import q8_0_blocks
from anyquant_exl3.qlinear import EXL3Linear, decoded_layouts
from anyquant_runtime.layouts import Decoded, Int8Blocks, tensor
from anyquant_runtime.native import NativeCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _exl3_testlib import exl2_from_dense

pytestmark = pytest.mark.slow

#: cpu-fast's tolerance against the exact backend (max |logit error| / max |logit|), as the bfloat16 path's
TOL = 2e-2
PROMPTS = ("Hello, my name is", "The capital of France", "Once upon a time", "def main():")

needs_bf16 = pytest.mark.skipif(not bf16_head_status()[0], reason="no fast oneDNN bfloat16 linear on this CPU")
needs_kernel = pytest.mark.skipif(
    not (bf16_head_status()[0] and block_kernel_is_fast()),
    reason="cpu-fast with the compiled block kernel built and vectorized",
)


@pytest.fixture(scope="module")
def exl3(dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return anyquant.quantize(
        dense, tmp_path_factory.mktemp("q") / "exl3", method="exl3", bits=4.5, codebook="mul1", quality=False
    )


@pytest.fixture(scope="module")
def exl2(dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("q") / "exl2"
    exl2_from_dense(dense, out)
    return out


def _greedy(model: anyquant.LoadedModel, ids: torch.Tensor, steps: int) -> list[int]:
    module = model.module
    cache = NativeCache(module.config.num_hidden_layers)
    nxt = module(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    tokens = [int(nxt)]
    for _ in range(steps - 1):
        nxt = module(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(int(nxt))
    return tokens


def _against_exact(
    fast: anyquant.LoadedModel, exact: anyquant.LoadedModel, steps: int = 32
) -> tuple[float, float, int]:
    """On each prompt, the exact model's greedy path teacher-forced: the worst logits error over the largest logit,
    the share of positions with the same argmax; and how many prompts give the same ``steps`` greedy tokens."""
    worst, agree, positions, same = 0.0, 0, 0, 0
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([exact.tokenizer.encode(prompt)])
            ref = _greedy(exact, ids, steps)
            seq = torch.cat([ids, torch.tensor([ref[:-1]])], dim=1)
            a, b = fast.module(seq).logits.double(), exact.module(seq).logits.double()
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            positions += seq.shape[1]
            same += _greedy(fast, ids, steps) == ref
    return worst, agree / positions, same


def _check_q8_0_layers(fast: anyquant.LoadedModel, exact: anyquant.LoadedModel, count: int) -> None:
    """Every quantized linear holds llama.cpp's Q8_0 rounding of the exact decoded weight, bit for bit."""
    layers = [(n, m) for n, m in fast.module.named_modules() if isinstance(m, Int8BlockLinear)]
    assert len(layers) == count
    for name, layer in layers:
        w = exact.module.get_submodule(name).dequantize().float()
        assert torch.equal(layer.raw_blocks(), q8_0_blocks(w).reshape(-1)), name
        held = layer.dequantize()  # the weight the backend runs (its prompts too): the Q8_0 one
        step = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127  # per block of 32
        err = (held - w).reshape(step.shape[0], -1, 32).abs()
        assert bool((err <= 0.57 * step).all()), name  # half a step, and float16's rounding of d over 127 codes
        assert 0 < float(err.max()) and layer.interleaved and layer.passes == 2


@needs_kernel
def test_q8_0_blocks_are_the_default_and_hold_cpu_fast_tolerance(exl3: Path) -> None:
    exact = anyquant.load(exl3, backend="dequantized")
    fast = anyquant.load(exl3)
    assert fast.backend == "cpu-fast"
    assert fast.info["cpu_fast"]["linears"] == "Q8_0 blocks" and fast.info["cpu_fast"]["weights"] == "auto"
    _check_q8_0_layers(fast, exact, 7)
    assert not any(isinstance(m, (EXL3Linear, PrepackedBf16Linear)) for m in fast.module.modules())  # no trellis kept
    worst, agree, same = _against_exact(fast, exact)
    assert worst < TOL, worst  # measured 1.09e-2 (bfloat16: 1.17e-2)
    assert agree >= 0.95 and same >= 3, (agree, same)  # measured: every position but a near-tie, 4 of 4 prompts
    # the compiled decode step plans the layer on the block kernel
    from anyquant_cpu.step import DecodeStep

    step = DecodeStep.build(fast.module)
    assert step is not None and [getattr(p[0], "name", getattr(p[0], "__name__", "")) for p in step.layers] == [
        "ggml_layer"
    ]


@needs_kernel
def test_q8_0_error_against_bfloat16_with_an_exact_head(exl3: Path) -> None:
    """The linears' own share: with the head dense, Q8_0's error stays in the bfloat16 form's class (measured 4.6e-3
    against 2.8e-3; a re-quantization to 8 bits, not a second 4-bit quantization)."""
    exact = anyquant.load(exl3, backend="dequantized")
    errors = {
        w: _against_exact(anyquant.load(exl3, cpu_fast_weights=w, cpu_fast_head="dense"), exact, steps=8)[0]
        for w in ("q8_0", "bfloat16")
    }
    assert errors["q8_0"] < TOL / 2 and errors["bfloat16"] < TOL / 2, errors
    assert errors["q8_0"] < 4 * errors["bfloat16"], errors


@needs_bf16
def test_the_bfloat16_form_on_request(exl3: Path, tmp_path: Path) -> None:
    exact = anyquant.load(exl3, backend="dequantized")
    fast = anyquant.load(exl3, cpu_fast_weights="bfloat16")
    assert fast.info["cpu_fast"]["linears"] == "bfloat16 prepacked" and fast.info["cpu_fast"]["weights"] == "bfloat16"
    layers = [(n, m) for n, m in fast.module.named_modules() if isinstance(m, PrepackedBf16Linear)]
    assert len(layers) == 7
    for name, layer in layers:  # the exact weight still comes from the trellis
        assert torch.equal(layer.dequantize(), exact.module.get_submodule(name).dequantize()), name
    worst, agree, same = _against_exact(fast, exact)
    assert worst < TOL and agree >= 0.95 and same >= 3, (worst, agree, same)
    # its export is exact; the Q8_0 form's is the weight it runs
    a = load_file(
        anyquant.export_dense(exl3, tmp_path / "bf16", dtype="float32", backend="cpu-fast", cpu_fast_weights="bfloat16")
        / "model.safetensors"
    )
    b = load_file(anyquant.export_dense(exl3, tmp_path / "exact", dtype="float32") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if block_kernel_is_fast():
        q = load_file(
            anyquant.export_dense(exl3, tmp_path / "q8", dtype="float32", backend="cpu-fast") / "model.safetensors"
        )
        name = "model.layers.0.mlp.down_proj.weight"
        assert not torch.equal(q[name], b[name])
        assert torch.equal(q8_0_blocks(q[name]), q8_0_blocks(b[name]))  # Q8_0 of its Q8_0 rounding: the same blocks


@needs_kernel
def test_exl2_takes_the_same_forms(exl2: Path) -> None:
    exact = anyquant.load(exl2, backend="dequantized")
    fast = anyquant.load(exl2)
    assert fast.backend == "cpu-fast" and fast.info["cpu_fast"]["linears"] == "Q8_0 blocks"
    _check_q8_0_layers(fast, exact, 7)
    worst, agree, same = _against_exact(fast, exact)
    assert worst < TOL and agree >= 0.95 and same >= 3, (worst, agree, same)  # measured 1.07e-2, 4 of 4
    bf16 = anyquant.load(exl2, cpu_fast_weights="bfloat16")
    assert bf16.info["cpu_fast"]["linears"] == "bfloat16 prepacked"
    assert sum(isinstance(m, PrepackedBf16Linear) for m in bf16.module.modules()) == 7
    assert _against_exact(bf16, exact, steps=8)[0] < TOL


@needs_bf16
def test_auto_is_bfloat16_where_the_block_kernel_does_not_run(exl3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant_cpu import backend, engine

    for where in (engine, backend):  # the engine's own choice, and what the loader asks through core's seam
        monkeypatch.setattr(where, "block_kernel_is_fast", lambda: False)
    fast = anyquant.load(exl3)
    assert fast.backend == "cpu-fast" and fast.info["cpu_fast"]["linears"] == "bfloat16 prepacked"
    assert sum(isinstance(m, PrepackedBf16Linear) for m in fast.module.modules()) == 7
    with pytest.raises(anyquant.ParameterError, match=r"cpu_fast_weights='q8_0'.*not built"):
        anyquant.load(exl3, cpu_fast_weights="q8_0")


def test_the_option_is_checked_before_the_weights_are_read(exl3: Path) -> None:
    with pytest.raises(anyquant.ParameterError, match=r"cpu_fast_weights='int8' is not one of 'auto', 'q8_0'"):
        anyquant.load(exl3, backend="cpu-fast", cpu_fast_weights="int8")
    with pytest.raises(anyquant.ParameterError, match="unknown load option"):
        anyquant.load(exl3, cpu_fast_weight="q8_0")
    anyquant.load(exl3, backend="dequantized", cpu_fast_weights="q8_0")  # declared: the other backends ignore it


def _layer(in_features: int, out_features: int, *, seed: int = 0, **kwargs: Any) -> EXL3Linear:
    gen = torch.Generator().manual_seed(seed)
    kin, kout = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    trellis = torch.randint(-(2**15), 2**15, (kin // 16, kout // 16, 64), generator=gen).to(torch.int16)
    return EXL3Linear(
        trellis,
        ((torch.randint(0, 2, (kin,), generator=gen) * 2 - 1) * 0.05).half(),
        (torch.randint(0, 2, (kout,), generator=gen) * 2 - 1).half(),
        None,
        codebook="mul1",
        in_features=in_features,
        out_features=out_features,
        **kwargs,
    )


def test_the_layouts_offered() -> None:
    layer = _layer(256, 128)
    q8, exact = decoded_layouts(layer)
    assert isinstance(q8, Int8Blocks) and isinstance(exact, Decoded) and exact.source is layer
    assert q8.rounded and (q8.group, q8.in_features, q8.out_features, q8.round_to) == (32, 256, 128, torch.float32)
    blocks = q8_0_blocks(layer.dequantize()).view(128, 8, 34)
    assert torch.equal(tensor(q8.codes).view(torch.uint8), blocks[..., 2:].reshape(128, 256))  # llama.cpp's codes
    assert torch.equal(tensor(q8.scales).reshape(128, 8, 1).view(torch.uint8), blocks[..., :2])  # and float16 d
    assert [type(x) for x in layer.packed_layouts()] == [Int8Blocks, Decoded]
    assert [type(x) for x in decoded_layouts(_layer(48, 128))] == [Decoded]  # rows not of 32s: bfloat16
    assert "dequantized" in str(decoded_layouts(_layer(256, 128, mode="dequantized")))
    if bf16_head_status()[0]:  # cpu_fast_weights="bfloat16": the engine passes the rounded layout by
        assert isinstance(fast_cpu_module(layer, rounded=False), PrepackedBf16Linear)
    if block_kernel_is_fast():  # core's engine builds it: Q8_0 blocks of the rounding
        fast = layer.to_fast_cpu()
        assert isinstance(fast, Int8BlockLinear)
        assert torch.equal(fast.raw_blocks(), q8_0_blocks(layer.dequantize()).reshape(-1))
