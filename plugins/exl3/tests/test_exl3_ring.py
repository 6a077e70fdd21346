"""Ring-coded token embeddings (exllamav3 1.6 ``--embed_bits``): the codec against exllamav3's own pure-torch
codec (``ngram_codec.py`` from the installed wheel, loaded by file path: ``import exllamav3`` needs a GPU), and
the tables through detect / inspect / load / quantize / export."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import anyquant
from anyquant.errors import CheckpointError, QuantizeError, UnsupportedFormatError
from anyquant.testing.tiny import make_tiny_dense
from anyquant_exl3.codebook import codebook_lut
from anyquant_exl3.hadamard import sylvester
from anyquant_exl3.qlinear import EXL3TableEmbedding
from anyquant_exl3.ring import decode_rows, encode_table, fwht, pack_rings, ring_bits, unpack_rings

IDS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 258, 0, 1]])


def _upstream() -> ModuleType | None:
    spec = importlib.util.find_spec("exllamav3")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "modules" / "quant" / "exl3_lib" / "ngram_codec.py"
    if not path.is_file():
        return None
    loader = importlib.util.spec_from_file_location("exllamav3_ngram_codec", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)  # torch only: no CUDA extension
    return module


UP = _upstream()
needs_upstream = pytest.mark.skipif(UP is None, reason="exllamav3's ngram_codec.py is not installed")


def _ring_states(n: int, k: int, width: int = 256, seed: int = 0) -> torch.Tensor:
    """Valid tail-biting ring states: random symbols, each state stacking its predecessors' symbols."""
    symbols = torch.randint(0, 1 << k, (n, width), generator=torch.Generator().manual_seed(seed))
    states = symbols.clone()
    for back in range(1, -(-16 // k)):
        states |= torch.roll(symbols, back, 1) << (back * k)
    return states & 0xFFFF


@needs_upstream
def test_codebook_is_exllamav3s() -> None:
    assert UP is not None
    assert torch.equal(codebook_lut("mul1"), UP.mul1_codebook("cpu"))


@needs_upstream
@pytest.mark.parametrize("k", range(1, 9))
def test_codec_equals_exllamav3(k: int) -> None:
    assert UP is not None
    rows, groups, hidden = 7, 3, 700
    gen = torch.Generator().manual_seed(k)
    states = _ring_states(rows * groups, k, seed=k)
    scales = (torch.rand(rows * groups, generator=gen) * 0.05 + 1e-3).half()
    ours = pack_rings(states, scales, k)
    assert torch.equal(ours, UP.pack_rows(states, scales, k))
    up_states, up_scales = UP.unpack_rows(ours, k)
    got_states, got_scales = unpack_rings(UP.pack_rows(states, scales, k), k)
    assert torch.equal(up_states, states) and torch.equal(got_states, states)
    assert torch.equal(got_scales, scales) and torch.equal(up_scales, scales)
    signs = (torch.randint(0, 2, (groups, 256), generator=gen) * 2 - 1).half()
    want = UP.dequant_rows(ours, k, UP.mul1_codebook("cpu"), signs=signs.repeat(rows, 1)).half()
    want = want.view(rows, groups * 256)[:, :hidden]
    got = decode_rows(ours.view(rows, -1), signs, k, hidden)
    assert got.dtype == torch.float16 and torch.equal(got, want)


@needs_upstream
def test_encoded_tables_decode_the_same_in_exllamav3() -> None:
    assert UP is not None
    weight = torch.randn(40, 300, generator=torch.Generator().manual_seed(1)) * 0.02
    table, _ = encode_table(weight, 3)
    rings = table["trellis"].view(40 * 2, -1)
    want = UP.dequant_rows(rings, 3, UP.mul1_codebook("cpu"), signs=table["signs"].repeat(40, 1)).half()
    assert torch.equal(decode_rows(table["trellis"], table["signs"], 3, 300), want.view(40, 512)[:, :300])


def test_fwht_is_the_orthonormal_sylvester_transform() -> None:
    x = torch.randn(5, 256, dtype=torch.float64)
    torch.testing.assert_close(fwht(x), x @ sylvester(256).double() / 16, rtol=0, atol=1e-12)
    torch.testing.assert_close(fwht(fwht(x)), x, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.zeros(3, 160))


def test_layout_checks() -> None:
    assert [ring_bits(g * (1 + 16 * k), g) for g, k in ((1, 1), (3, 4), (16, 8))] == [1, 4, 8]
    for words, groups in ((65, 2), (66, 1), (145, 1), (1, 1)):
        with pytest.raises(ValueError):
            ring_bits(words, groups)
    with pytest.raises(ValueError, match="int16"):
        unpack_rings(torch.zeros(2, 65, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="whole K"):
        encode_table(torch.zeros(2, 8), 3.5)  # type: ignore[arg-type]


def test_encoder_error_falls_with_k_and_states_round_trip() -> None:
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)) * 0.03
    errors = {k: encode_table(weight, k)[1] for k in (2, 4, 6)}
    # Gaussian rows: the trellis' levels (format doc: K=2 ~0.07, K=4 ~0.005, K=6 ~3e-4 relative MSE)
    assert errors[2] > errors[4] > errors[6] and errors[4] < 0.08 and errors[6] < 0.025, errors
    table, _ = encode_table(weight, 4)
    states, _ = unpack_rings(table["trellis"].view(32, -1), 4)
    assert torch.equal(pack_rings(states, unpack_rings(table["trellis"].view(32, -1), 4)[1], 4), table["trellis"])


# ---------------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def ringed(dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return anyquant.quantize(
        dense, tmp_path_factory.mktemp("q") / "exl3", method="exl3", bits=4, embed_bits=4, ldlq=False, quality=False
    )


def _decoded_table(path: Path) -> torch.Tensor:
    t = load_file(path / "model.safetensors")
    return decode_rows(t["model.embed_tokens.trellis"], t["model.embed_tokens.signs"], 4, 128)


@pytest.mark.slow
def test_quantize_writes_a_ring_table_that_detect_and_inspect_report(ringed: Path, dense: Path) -> None:
    t = load_file(ringed / "model.safetensors")
    assert "model.embed_tokens.weight" not in t
    assert t["model.embed_tokens.trellis"].shape == (259, 65) and t["model.embed_tokens.signs"].shape == (1, 256)
    assert json.loads((ringed / "config.json").read_text())["quantization_config"]["embed_bits"] == 4
    d = anyquant.detect(ringed)
    assert d.format == "exl3" and d.details["tables"] == {
        "model.embed_tokens": {"k": 4, "rows": 259, "groups": 1, "kind": "embedding"}
    }
    assert any("ring-coded token embedding" in e for e in d.evidence)
    report = anyquant.inspect(ringed)
    row = next(m for m in report.modules if m.name == "model.embed_tokens")
    assert (row.format, row.shape, row.bits) == ("exl3", (259, 128), 4.0)
    source = load_file(dense / "model.safetensors")["model.embed_tokens.weight"]
    err = ((_decoded_table(ringed).float() - source).norm() / source.norm()).item()
    assert err < 0.08, err
    # sizing counts the table's bytes (trellis + signs): half the fp16 table's here (128 columns pad to one
    # 256-wide ring of 1 + 16*4 words)
    table_bytes = t["model.embed_tokens.trellis"].nbytes + t["model.embed_tokens.signs"].nbytes
    assert anyquant.estimate(ringed).embedding_bytes == table_bytes == 259 * 65 * 2 + 256 * 2


@pytest.mark.slow
def test_backends_decode_the_table_as_exllamav3_does(
    ringed: Path, dense: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = _decoded_table(ringed)
    with caplog.at_level("WARNING"):
        ref = anyquant.load(ringed, backend="reference")
    assert "not used" not in caplog.text
    emb = ref.module.get_input_embeddings()
    assert isinstance(emb, EXL3TableEmbedding) and "per lookup" in ref.info["embedding"]
    assert emb.trellis.dtype == torch.int16 and emb.trellis.nbytes == 259 * 65 * 2
    assert torch.equal(emb(IDS), table[IDS].float())
    assert torch.equal(emb.dequantize(), table)
    with pytest.raises(IndexError):
        emb(torch.tensor([[259]]))
    deq = anyquant.load(ringed, backend="dequantized")
    assert torch.equal(deq.module.get_input_embeddings().weight, table.float())
    with torch.no_grad():
        a, b = ref.module(IDS).logits, deq.module(IDS).logits
        c = anyquant.load(dense).module(IDS).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ((a - c).abs().max() / c.abs().max()).item() < 0.15
    from anyquant_cpu.engine import bf16_head_status

    if bf16_head_status()[0]:  # cpu-fast keeps the table packed too
        fast = anyquant.load(ringed, backend="cpu-fast")
        assert isinstance(fast.module.get_input_embeddings(), EXL3TableEmbedding)
        with torch.no_grad():
            f = fast.module(IDS).logits
        assert ((f - a).abs().max() / a.abs().max()).item() < 2e-2
    hf = anyquant.load(ringed, backend="reference", runtime="transformers")  # transformers' class takes it too
    assert isinstance(hf.module.get_input_embeddings(), EXL3TableEmbedding)
    with torch.no_grad():
        torch.testing.assert_close(hf.module(IDS).logits, a, rtol=1e-5, atol=1e-5)
    assert ref.generate("Hello", max_new_tokens=5) == deq.generate("Hello", max_new_tokens=5)


@pytest.mark.slow
def test_row_shards_load_as_one_table(ringed: Path, tmp_path: Path, rewrite_checkpoint: Any) -> None:
    def shard(t: dict[str, torch.Tensor]) -> None:
        trellis = t.pop("model.embed_tokens.trellis")
        t["model.embed_tokens.shard_0.trellis"] = trellis[:200].clone()
        t["model.embed_tokens.shard_1.trellis"] = trellis[200:].clone()

    out = rewrite_checkpoint(ringed, tmp_path / "sharded", shard)
    t = load_file(out / "model.safetensors")
    assert anyquant.detect(out).details["tables"]["model.embed_tokens"]["rows"] == 259
    emb = anyquant.load(out, backend="reference").module.get_input_embeddings()
    assert torch.equal(emb(IDS), _decoded_table(ringed)[IDS].float())
    # shards numbered with a gap, or of unequal leading sizes, are inconsistent tensors
    t["model.embed_tokens.shard_2.trellis"] = t.pop("model.embed_tokens.shard_1.trellis")
    save_file(t, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="numbered"):
        anyquant.load(out, backend="reference")


@pytest.mark.slow
def test_a_head_without_a_tensor_reads_the_decoded_table(ringed: Path, tmp_path: Path, rewrite_checkpoint: Any) -> None:
    out = rewrite_checkpoint(ringed, tmp_path / "tied", lambda t: t.pop("lm_head.weight"))
    m = anyquant.load(out, backend="reference")
    emb, head = m.module.get_input_embeddings(), m.module.get_output_embeddings()
    assert head.weight is emb.weight and torch.equal(emb.weight, _decoded_table(ringed).float())
    assert "tied" in m.info["embedding"]


@pytest.mark.slow
def test_tables_anyquant_cannot_use_are_clear_errors(ringed: Path, tmp_path: Path, rewrite_checkpoint: Any) -> None:
    def ngram(t: dict[str, torch.Tensor]) -> None:
        t["model.ngram_embedding.trellis"] = torch.zeros(10, 41, dtype=torch.int16)

    out = rewrite_checkpoint(ringed, tmp_path / "ngram", ngram)
    d = anyquant.detect(out)
    assert d.format == "exl3" and d.details["tables"]["model.ngram_embedding"]["kind"] == "n-gram"
    with pytest.raises(UnsupportedFormatError, match="n-gram"):
        anyquant.load(out, backend="reference")

    def other(t: dict[str, torch.Tensor]) -> None:
        t["model.other.trellis"] = t["model.embed_tokens.trellis"].clone()
        t["model.other.signs"] = t["model.embed_tokens.signs"].clone()

    with pytest.raises(UnsupportedFormatError, match="not this model's input embedding"):
        anyquant.load(rewrite_checkpoint(ringed, tmp_path / "other", other), backend="reference")

    def bad_signs(t: dict[str, torch.Tensor]) -> None:
        t["model.embed_tokens.signs"] = torch.ones(2, 256, dtype=torch.float16)

    with pytest.raises(CheckpointError, match="rings"):
        anyquant.load(rewrite_checkpoint(ringed, tmp_path / "signs", bad_signs), backend="reference")


@pytest.mark.slow
def test_tied_source_keeps_an_exact_head_and_exports_dense(tmp_path: Path) -> None:
    dense = make_tiny_dense(tmp_path / "tied", num_hidden_layers=1, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(dense / "model.safetensors")
    q = anyquant.quantize(dense, tmp_path / "q", method="exl3", bits=4, embed_bits=6, ldlq=False, quality=False)
    t = load_file(q / "model.safetensors")
    source = load_file(dense / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(t["lm_head.weight"], source) and t["model.embed_tokens.trellis"].shape == (259, 97)
    assert json.loads((q / "config.json").read_text())["tie_word_embeddings"] is False
    m = anyquant.load(q, backend="reference")
    assert torch.equal(m.module.get_output_embeddings().weight, source.float())
    out = anyquant.export_dense(q, tmp_path / "dense-out", dtype="float32")
    exported = load_file(out / "model.safetensors")
    table = decode_rows(t["model.embed_tokens.trellis"], t["model.embed_tokens.signs"], 6, 128).float()
    assert torch.equal(exported["model.embed_tokens.weight"], table)
    assert torch.equal(exported["lm_head.weight"], source.float())


def test_embed_bits_is_checked_before_any_work() -> None:
    from anyquant.protocols import QuantizeSpec
    from anyquant_exl3.quantize import embed_bits

    for bad in (0, 9, 3.5, True, "4"):
        with pytest.raises(QuantizeError, match="embed_bits"):
            embed_bits(QuantizeSpec(method="exl3", bits=4.0, options={"embed_bits": bad}))
    assert embed_bits(QuantizeSpec(method="exl3", bits=4.0, options={})) == 16
