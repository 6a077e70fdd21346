"""Decoder vs GPTQModel's independent pure-torch EXL3 module (``ExllamaV3TorchLinear``), run in a subprocess.

For every codebook and K = 1..8, random trellis bitstreams and fp16 scales on padded and unpadded shapes:

* states: identical;
* Ŵ: our exact-fp32 codebook mode equals the peer's fp32 inner weight bit for bit, and our default (kernel)
  fp16 mode equals the peer's inner weight rounded to fp16 bit for bit;
* W: our fp32 mode equals the peer's ``get_weight_tensor`` within BLAS summation-order tolerance (bitwise equal on
  this machine); our default mode equals the peer's transform path applied to fp16-rounded codebook values.

Peer outputs are cached under ``<repo>/.cache/test-fixtures/exl3/`` keyed by inputs + worker + peer sources.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _exl3_testlib import max_rel_err, peer_available, random_layer, run_peer

from anyquant_exl3.dequant import decode_exl3, decode_states, decode_what

pytestmark = [
    pytest.mark.peer,
    pytest.mark.skipif(not peer_available(), reason="gptqmodel is not installed"),
]

CODEBOOKS = ("3inst", "mcg", "mul1")
BITS = tuple(range(1, 9))
# (k_pad, n_pad, in_features, out_features)
SHAPES = ((256, 256, 200, 130), (128, 384, 128, 384), (384, 128, 300, 100))
# fp32 results may differ only by the summation order of two 128-long dot products
FP32_TOL = 1e-6

CASES = {
    f"{cb}-k{k}": (cb, k, SHAPES[(i * 8 + k) % len(SHAPES)], 1000 + 17 * i + k)
    for i, cb in enumerate(CODEBOOKS)
    for k in BITS
}


@pytest.fixture(scope="module")
def layers() -> dict[str, dict[str, torch.Tensor]]:
    return {name: random_layer(seed, shape[0], shape[1], k, cb) for name, (cb, k, shape, seed) in CASES.items()}


@pytest.fixture(scope="module")
def peer(layers: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return run_peer(layers)


def _case(name: str, layers: dict, peer: dict) -> tuple[str, dict, dict, tuple[int, int]]:
    cb, _, shape, _ = CASES[name]
    out = {part: peer[f"{name}.{part}"] for part in ("states", "inner", "weight", "weight16")}
    return cb, layers[name], out, (shape[2], shape[3])


@pytest.mark.parametrize("name", sorted(CASES))
def test_states_match_peer(name: str, layers: dict, peer: dict) -> None:
    _, layer, ref, _ = _case(name, layers, peer)
    assert torch.equal(decode_states(layer["trellis"]), ref["states"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_matches_peer(name: str, layers: dict, peer: dict) -> None:
    cb, layer, ref, _ = _case(name, layers, peer)
    exact = decode_what(layer["trellis"], codebook=cb, codebook_fp16=False, chunk_rows=128)
    assert exact.dtype == torch.float32
    assert torch.equal(exact, ref["inner"])
    kernel = decode_what(layer["trellis"], codebook=cb)
    assert kernel.dtype == torch.float16
    assert torch.equal(kernel, ref["inner"].half())


@pytest.mark.parametrize("name", sorted(CASES))
def test_weight_fp32_codebook_matches_peer(name: str, layers: dict, peer: dict) -> None:
    cb, layer, ref, (n_in, n_out) = _case(name, layers, peer)
    ours = decode_exl3(
        layer["trellis"],
        layer["suh"],
        layer["svh"],
        codebook=cb,
        in_features=n_in,
        out_features=n_out,
        codebook_fp16=False,
        dtype=torch.float32,
        chunk_rows=128,
    )
    expected = ref["weight"][:n_in, :n_out].t()
    assert ours.shape == (n_out, n_in)
    assert max_rel_err(ours, expected) <= FP32_TOL


@pytest.mark.parametrize("name", sorted(CASES))
def test_weight_kernel_mode_matches_peer_on_rounded_codebook(name: str, layers: dict, peer: dict) -> None:
    cb, layer, ref, (n_in, n_out) = _case(name, layers, peer)
    expected = ref["weight16"][:n_in, :n_out].t()
    args = dict(codebook=cb, in_features=n_in, out_features=n_out)
    ours32 = decode_exl3(layer["trellis"], layer["suh"], layer["svh"], dtype=torch.float32, **args)
    assert max_rel_err(ours32, expected) <= FP32_TOL
    ours16 = decode_exl3(layer["trellis"], layer["suh"], layer["svh"], **args)
    assert ours16.dtype == torch.float16
    torch.testing.assert_close(ours16.float(), expected.half().float(), rtol=2.0**-10, atol=1e-7)
    # the default really differs from the fp32-codebook peer result (the rounding is not a no-op)
    assert not torch.equal(ours32, ref["weight"][:n_in, :n_out].t())
