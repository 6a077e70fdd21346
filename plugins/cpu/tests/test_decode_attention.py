"""``anyquant::decode_attention``: a decode step's attention, every row over its own cache in one call, judged against
a float64 attention over the same keys and values (the history as the cache holds it, rounded to its dtype; the new
position exact, as :meth:`~anyquant_runtime.native.NativeCache.update` gives it); its writes are the buffer dtype's
rounding of the new keys and values and touch nothing else; a row's numbers do not depend on the other rows; bad input
is refused before anything is written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anyquant_cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.attention_available(), reason="anyquant kernels not built")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (heads, kv_heads, head_dim, v_head_dim, window): SmolLM2's grouped heads, Phi-3's 96, a window, DeepSeek's wider
#: keys than values, a head size the vector path does not take (scalar), one key head for all
SHAPES = [
    (9, 3, 64, 64, 0),
    (4, 4, 96, 96, 0),
    (8, 2, 128, 128, 33),
    (4, 4, 40, 32, 0),
    (4, 2, 12, 12, 0),
    (6, 1, 64, 64, 5),
]


def _reference(q, k, v, keys, values, start, window, scaling):  # type: ignore[no-untyped-def]
    """float64 attention of one row (q [heads, d]) over the buffer's positions before ``start`` and the new one."""
    first = max(0, start - window + 1) if window else 0
    kk = torch.cat([keys[:, first:start].double(), k.double()[:, None]], 1)  # [kv_heads, n, d]
    vv = torch.cat([values[:, first:start].double(), v.double()[:, None]], 1)
    out = F.scaled_dot_product_attention(q.double()[None, :, None], kk[None], vv[None], scale=scaling, enable_gqa=True)
    return out[0, :, 0]


def _case(dtype: torch.dtype, shape: tuple[int, int, int, int, int], seed: int = 0):  # type: ignore[no-untyped-def]
    heads, kv_heads, d, dv, window = shape
    gen = torch.Generator().manual_seed(seed)
    # three caches: two rows at start 10 (one batch's buffer), one long (several vector blocks and a tail), one empty
    rows, rooms, starts = [2, 1, 1], [50, 300, 7], [10, 299, 0]
    keys = [(torch.randn(r, kv_heads, n, d, generator=gen) * 2).to(dtype) for r, n in zip(rows, rooms, strict=True)]
    values = [torch.randn(r, kv_heads, n, dv, generator=gen).to(dtype) for r, n in zip(rows, rooms, strict=True)]
    q = torch.randn(sum(rows), heads, d, generator=gen) * 2
    k = torch.randn(sum(rows), kv_heads, d, generator=gen) * 2
    v = torch.randn(sum(rows), kv_heads, dv, generator=gen)
    return q, k, v, keys, values, starts, window


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_and_writes_against_float64(dtype: torch.dtype, shape: tuple[int, int, int, int, int]) -> None:
    q, k, v, keys, values, starts, window = _case(dtype, shape)
    scaling = shape[2] ** -0.5
    kb, vb = [t.clone() for t in keys], [t.clone() for t in values]
    out = torch.ops.anyquant.decode_attention(q, k, v, kb, vb, starts, window, scaling)
    assert out.shape == (q.shape[0], shape[0], shape[3]) and out.dtype == torch.float32
    row = 0
    for i, start in enumerate(starts):
        for r in range(keys[i].shape[0]):
            want = _reference(q[row], k[row], v[row], keys[i][r], values[i][r], start, window, scaling)
            err = float((out[row].double() - want).abs().max())
            assert err < 2e-6 * max(1.0, float(want.abs().max())), (i, r, err)
            # the new position written, rounded as torch rounds it; every other position as it was
            assert torch.equal(kb[i][r, :, start], k[row].to(dtype)) and torch.equal(
                vb[i][r, :, start], v[row].to(dtype)
            )
            row += 1
        rest = torch.ones(keys[i].shape[2], dtype=torch.bool)
        rest[start] = False
        assert torch.equal(kb[i][:, :, rest], keys[i][:, :, rest]) and torch.equal(
            vb[i][:, :, rest], values[i][:, :, rest]
        )


@pytest.mark.parametrize("isa", [-1, 0])
def test_each_row_as_alone(isa: int) -> None:
    """Every row computed in one call is bitwise the row computed by itself (what keeps a server's greedy answers
    those of each request alone), on the vector path and the scalar one; and the two paths agree to float rounding."""
    q, k, v, keys, values, starts, _ = _case(torch.float32, SHAPES[0], seed=3)
    together = torch.ops.anyquant.decode_attention(
        q, k, v, [t.clone() for t in keys], [t.clone() for t in values], starts, 0, 0.125, isa
    )
    row = 0
    for i, start in enumerate(starts):
        for r in range(keys[i].shape[0]):
            kb, vb = [keys[i][r : r + 1].clone()], [values[i][r : r + 1].clone()]
            alone = torch.ops.anyquant.decode_attention(
                q[row : row + 1], k[row : row + 1], v[row : row + 1], kb, vb, [start], 0, 0.125, isa
            )
            assert torch.equal(alone[0], together[row]), (i, r)
            row += 1
    scalar = torch.ops.anyquant.decode_attention(
        q, k, v, [t.clone() for t in keys], [t.clone() for t in values], starts, 0, 0.125, 0
    )
    torch.testing.assert_close(together, scalar, rtol=1e-5, atol=1e-5)


def test_long_histories_and_extreme_scores() -> None:
    """4,000 positions (the exponential's polynomial over a wide range of scores, most of them far below the
    maximum), and one score far above the rest (the weights of the others underflow to zero)."""
    gen = torch.Generator().manual_seed(9)
    keys, values = torch.randn(1, 2, 4001, 64, generator=gen), torch.randn(1, 2, 4001, 64, generator=gen)
    q, k, v = (
        torch.randn(1, 4, 64, generator=gen) * 3,
        torch.randn(1, 2, 64, generator=gen),
        torch.randn(1, 2, 64, generator=gen),
    )
    keys[0, :, 123] = q[0, ::2] * 10  # head 0 and 2's queries: one position dominates
    out = torch.ops.anyquant.decode_attention(q, k, v, [keys.clone()], [values.clone()], [4000], 0, 0.125)
    for h in range(4):
        want = _reference(q[0], k[0], v[0], keys[0], values[0], 4000, 0, 0.125)[h]
        assert float((out[0, h].double() - want).abs().max()) < 1e-5
    assert torch.allclose(out[0, 0], values[0, 0, 123], atol=1e-6)


def _refused(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match=match):
        call()


def test_bad_input_is_refused_before_any_write() -> None:
    op = torch.ops.anyquant.decode_attention
    keys, values = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    q, k, v = torch.ones(1, 4, 16), torch.ones(1, 2, 16), torch.ones(1, 2, 16)
    _refused(lambda: op(q.double(), k, v, [keys], [values], [3], 0, 1.0), "float32 q, k and v")
    _refused(lambda: op(q, k, v, [keys], [values], [8], 0, 1.0), "start 8 outside buffer 0")
    _refused(lambda: op(q, k, v, [keys], [values], [-1], 0, 1.0), "outside buffer")
    _refused(lambda: op(q, k, v, [keys, keys], [values, values], [3, 3], 0, 1.0), "hold 2 rows, q has 1")
    _refused(lambda: op(q, k, v, [keys], [values], [3, 4], 0, 1.0), "one start per cache buffer")
    _refused(lambda: op(torch.ones(1, 3, 16), k, v, [keys], [values], [3], 0, 1.0), "not a multiple of kv_heads")
    _refused(lambda: op(q, k, v, [keys.half()], [values], [3], 0, 1.0), "keys and values alike")
    _refused(lambda: op(q, k, v, [keys.double()], [values.double()], [3], 0, 1.0), "float32, float16 or bfloat16")
    _refused(lambda: op(q, k, v, [torch.zeros(1, 2, 8, 8)], [values], [3], 0, 1.0), "buffer 0 is not")
    _refused(lambda: op(q, k, v, [keys.transpose(2, 3)], [values.transpose(2, 3)], [3], 0, 1.0), "buffer 0 is not")
    strided = torch.zeros(1, 2, 8, 32)[..., ::2]
    _refused(lambda: op(q, k, v, [strided], [strided], [3], 0, 1.0), "last dimension contiguous")
    _refused(lambda: op(q, k, v, [keys], [values], [3], -1, 1.0), "window >= 0")
    _refused(lambda: op(q, k, v, [keys], [values], [3], 0, float("nan")), "finite scaling")
    _refused(lambda: op(q, k, v, [keys], [values], [3], 0, 1.0, 2), "isa -1")
    _refused(
        lambda: op(q[..., :12], k[..., :12], v[..., :12], [keys[..., :12]], [values[..., :12]], [3], 0, 1.0, 1),
        "AVX2 path",
    )
    assert not keys.any() and not values.any()  # nothing written by any refused call
