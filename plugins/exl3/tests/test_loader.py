"""EXL3 and EXL2 through anyquant.load: checkpoints written by anyquant's CPU encoder / packer,
decoded by the loader exactly as the standalone decoders do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import anyquant
from anyquant_exl3.dequant import decode_exl3
from anyquant_exl3.quantize import allocate_bits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _exl3_testlib import exl2_from_dense as _exl2_from_dense

pytestmark = pytest.mark.slow

IDS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 109, 121, 32]])


@pytest.fixture(scope="module")
def exl3(dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return anyquant.quantize(
        dense, tmp_path_factory.mktemp("q") / "exl3", method="exl3", bits=4.5, codebook="mul1", quality=False
    )


def test_detects_mixed_k(exl3: Path) -> None:
    d = anyquant.detect(exl3)
    assert (d.format, d.variant) == ("exl3", "mul1")
    # exllamav3's allocation on this layer: q/k/v 5, o 6 (raised in two passes), the MLP 4
    assert "4.0" in d.details["k_histogram"] and set(d.details["k_histogram"]) <= {"4.0", "5.0", "6.0"}
    assert len(d.details["k_histogram"]) > 1
    cfg = json.loads((exl3 / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "exl3" and 4.0 < cfg["bits"] <= 4.5


def test_loaded_weights_equal_the_decoder_and_approximate_the_source(exl3: Path, dense: Path) -> None:
    model = anyquant.load(exl3, backend="reference")
    src = anyquant.load(dense)
    tensors = load_file(exl3 / "model.safetensors")
    checked = 0
    for name, module in model.module.named_modules():
        if not hasattr(module, "trellis"):
            continue
        want = decode_exl3(
            tensors[f"{name}.trellis"],
            tensors[f"{name}.suh"],
            tensors[f"{name}.svh"],
            codebook="mul1",
            in_features=module.in_features,
            out_features=module.out_features,
        )
        assert torch.equal(module.dequantize(), want), name
        w = dict(src.module.named_modules())[name].weight
        rel_mse = ((want.float() - w).pow(2).mean() / w.pow(2).mean()).item()
        assert rel_mse < 0.01, f"{name}: relative MSE {rel_mse:.4f} (the format doc's K=4 level is ~0.005)"
        checked += 1
    assert checked == 7


def test_backends_agree_and_track_the_dense_model(exl3: Path, dense: Path) -> None:
    ref = anyquant.load(exl3, backend="reference")
    fast = anyquant.load(exl3, backend="dequantized")
    src = anyquant.load(dense)
    with torch.no_grad():
        a, b, c = ref.module(IDS).logits, fast.module(IDS).logits, src.module(IDS).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ((a - c).abs().max() / c.abs().max()).item() < 0.15
    assert isinstance(ref.generate("Hello", max_new_tokens=4), str)


def _layout(layers: int) -> tuple[list[str], list[int]]:
    shapes = {
        "q": 64 * 64,
        "k": 32 * 64,
        "v": 32 * 64,
        "o": 64 * 64,
        "gate": 128 * 64,
        "up": 128 * 64,
        "down": 128 * 64,
    }
    names, sizes = [], []
    for i in range(layers):
        for short, n in shapes.items():
            names.append(f"model.layers.{i}.{'self_attn' if short in 'qkvo' else 'mlp'}.{short}_proj")
            sizes.append(n)
    return names, sizes


def _ks(names: list[str], ks: list[float]) -> dict[str, float]:
    return {n.removeprefix("model.layers."): k for n, k in zip(names, ks, strict=True)}


def test_allocate_bits_as_exllamav3() -> None:
    # expected values worked out by hand from exllamav3's create_q_strategy (conversion/allocation.py)
    names, sizes = _layout(4)  # 36,864 weights per layer
    assert allocate_bits(names, sizes, 4.0) == [4.0] * 28
    # 4.25: one layer's worth of bits; attention groups first, the stack's ends (layers 0 and 3) first,
    # whole groups only: q/k/v and o of layers 0, 3, 1 go to 5; layer 2's q/k/v (8,192) no longer fits
    ks = _ks(names, allocate_bits(names, sizes, 4.25))
    assert {n for n, k in ks.items() if k == 5.0} == {
        f"{i}.self_attn.{p}_proj" for i in (0, 3, 1) for p in ("q", "k", "v", "o")
    }
    assert set(ks.values()) == {4.0, 5.0}
    # 2.7 with mul1: half steps from 2.5; every attention group to 3.0, then layer 0's down (gate/up: too big)
    ks = _ks(names, allocate_bits(names, sizes, 2.7, "mul1"))
    assert {n for n, k in ks.items() if k == 3.0} == {
        f"{i}.self_attn.{p}_proj" for i in range(4) for p in ("q", "k", "v", "o")
    } | {"0.mlp.down_proj"}
    assert set(ks.values()) == {2.5, 3.0}
    # 2.7 with mcg: whole bits from 2; attention to 3, the MLPs of layers 0 and 3 to 3, then layer 0's o to 4
    ks = _ks(names, allocate_bits(names, sizes, 2.7, "mcg"))
    assert ks["0.self_attn.o_proj"] == 4.0
    assert {n for n, k in ks.items() if k == 2.0} == {
        f"{i}.mlp.{p}_proj" for i in (1, 2) for p in ("gate", "up", "down")
    }
    for mix in (2.7, 3.3, 4.25, 6.6):
        for cb in ("mul1", "mcg"):
            ks = allocate_bits(names, sizes, mix, cb)
            assert sum(k * n for k, n in zip(ks, sizes, strict=True)) <= int(mix * sum(sizes))
            by_group = {}
            for n, k in zip(names, ks, strict=True):  # q/k/v share K, gate/up share K
                key = n.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
                assert by_group.setdefault(key, k) == k


def test_exl2_loads_with_the_decoder_and_never_as_exl3(dense: Path, tmp_path: Path) -> None:
    expected = _exl2_from_dense(dense, tmp_path / "exl2")
    d = anyquant.detect(tmp_path / "exl2")
    assert d.format == "exl2"
    with pytest.raises(anyquant.FormatMismatchError):
        anyquant.load(tmp_path / "exl2", format="exl3")
    model = anyquant.load(tmp_path / "exl2", backend="reference")
    src = anyquant.load(dense)
    for prefix, want in expected.items():
        module = model.module.get_submodule(prefix)
        assert torch.equal(module.dequantize(), want)
        w = src.module.get_submodule(prefix).weight
        # round-to-nearest 4-bit with a per-group absmax/8 step: ~1.6% relative MSE on Gaussian weights
        assert ((want.float() - w).pow(2).mean() / w.pow(2).mean()).item() < 0.03
    with torch.no_grad():
        a, c = model.module(IDS).logits, src.module(IDS).logits
    assert ((a - c).abs().max() / c.abs().max()).item() < 0.2
    from anyquant_cpu.engine import PrepackedBf16Linear, bf16_head_status

    if bf16_head_status()[0]:  # cpu-fast, the CPU default there; its bfloat16 form: exact dequantize() (the default
        # form where the block kernel runs, Q8_0 blocks: test_exl3_cpu_q8.py)
        fast = anyquant.load(tmp_path / "exl2", cpu_fast_weights="bfloat16")
        assert fast.backend == "cpu-fast"
        for prefix, want in expected.items():
            layer = fast.module.get_submodule(prefix)
            assert isinstance(layer, PrepackedBf16Linear) and torch.equal(layer.dequantize(), want)
        with torch.no_grad():
            f = fast.module(IDS).logits
        assert ((f - a).abs().max() / a.abs().max()).item() < 2e-2


def test_stale_tie_flag_of_exllamav3_1_5_is_not_trusted(exl3: Path, tmp_path: Path) -> None:
    """exllamav3 <= 1.5 leaves ``tie_word_embeddings: true`` in config.json beside an explicit head (its
    ``update_config`` tests a misspelled key): the tensors decide, as exllamav3's own loader does."""
    import shutil

    stale = tmp_path / "stale"
    shutil.copytree(exl3, stale)
    cfg = json.loads((stale / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (stale / "config.json").write_text(json.dumps(cfg))
    head = load_file(exl3 / "model.safetensors")["lm_head.weight"]
    for runtime in ("native", "transformers"):
        m = anyquant.load(stale, backend="reference", runtime=runtime).module
        out, emb = m.get_output_embeddings(), m.get_input_embeddings()
        assert out.weight.data_ptr() != emb.weight.data_ptr()
        assert torch.equal(out.weight, head.float())


needs_bf16 = pytest.mark.skipif(
    not __import__("anyquant_cpu.engine", fromlist=["x"]).bf16_head_status()[0],
    reason="no fast oneDNN bfloat16 linear on this CPU",
)


@needs_bf16
def test_cpu_fast_prepacks_bfloat16_and_is_the_cpu_default(exl3: Path) -> None:
    from anyquant.api import default_registry, get_loader
    from anyquant.errors import UnsupportedBackendError
    from anyquant_cpu.engine import FastHead, PrepackedBf16Linear
    from anyquant_exl3.loader import EXL3Loader

    assert anyquant.load(exl3).backend == "cpu-fast"
    fast = anyquant.load(exl3, cpu_fast_weights="bfloat16")  # the Q8_0 form (default with the kernel): test_exl3_cpu_q8
    assert fast.backend == "cpu-fast" and fast.info["cpu_fast"]["linears"] == "bfloat16 prepacked"
    deq = anyquant.load(exl3, backend="dequantized")
    ref = anyquant.load(exl3, backend="reference")
    layers = [(n, m) for n, m in fast.module.named_modules() if isinstance(m, PrepackedBf16Linear)]
    assert len(layers) == 7
    for name, layer in layers:  # the exact weight still comes from the trellis
        assert torch.equal(layer.dequantize(), ref.module.get_submodule(name).dequantize()), name
    # the 16-bit head is prepacked too (its exact table read from the file for prompts)
    assert isinstance(fast.module.get_output_embeddings(), FastHead)
    with torch.no_grad():
        a, b = fast.module(IDS).logits, deq.module(IDS).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2  # the bfloat16 class, as the int4 path
    # a random tiny model has near-ties: most, not all, positions pick the same token
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.8
    assert isinstance(fast.generate("Hello", max_new_tokens=8), str)
    loader = get_loader(anyquant.detect(exl3), default_registry())
    assert isinstance(loader, EXL3Loader) and vars(loader) == {}  # a load's state lives in its ctx.state
    with pytest.raises(UnsupportedBackendError, match="CPU"):
        EXL3Loader().choose_backend("cpu-fast", torch.device("cuda"))
    assert EXL3Loader().choose_backend("auto", torch.device("meta")) == "dequantized"


@needs_bf16
def test_cpu_fast_export_is_exact(exl3: Path, tmp_path: Path) -> None:
    """The bfloat16 form keeps the trellis for the exact weight (the Q8_0 form exports the weight it runs:
    test_exl3_cpu_q8.py)."""
    a = load_file(
        anyquant.export_dense(exl3, tmp_path / "a", dtype="float32", backend="cpu-fast", cpu_fast_weights="bfloat16")
        / "model.safetensors"
    )
    b = load_file(anyquant.export_dense(exl3, tmp_path / "b", dtype="float32") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_quantize_passes_method_options(dense: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``anyquant quantize -o KEY=VALUE``: the method's own options reach its quantizer (JSON values typed),
    and one it does not read is an error (exit 2) that names those it does, before any work."""
    from anyquant.cli import main

    out = tmp_path / "mcg"
    argv = ["quantize", str(dense), str(out), "--method", "exl3", "--no-quality-check", "--json"]
    assert main([*argv, "-o", "codebook=mcg", "-o", "ldlq=false", "-o", "seed=3"]) == 0
    assert json.loads(capsys.readouterr().out)["dst"] == str(out)
    assert (anyquant.detect(out).format, anyquant.detect(out).variant) == ("exl3", "mcg")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "no Hessian" in json.dumps(cfg)  # ldlq=false arrived as the boolean False
    assert main([*argv[:2], str(tmp_path / "typo"), *argv[3:], "-o", "codebok=mcg"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "QuantizeError" and "codebok" in err["message"] and "codebook" in err["message"]
    assert not (tmp_path / "typo").exists()


def test_inconsistent_tensors_are_a_checkpoint_error(exl3: Path, tmp_path: Path, rewrite_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """From a hostile-input audit: suh shorter than the trellis was a bare ValueError from the decoder; every
    such failure of a plugin's arithmetic at load is now a CheckpointError (the original chained)."""
    name = "model.layers.0.self_attn.q_proj.suh"

    def cut(t: dict) -> None:
        t[name] = t[name][:64].contiguous()

    bad = rewrite_checkpoint(exl3, tmp_path / "bad", cut)
    with pytest.raises(anyquant.CheckpointError, match="loading it as exl3 failed") as info:
        anyquant.load(bad, backend="dequantized")  # decodes at load
    assert isinstance(info.value.__cause__, Exception)


def test_inspect_exl2_reports_logical_shapes_and_bits(tmp_path: Path) -> None:
    """From a hostile-input audit: inspect showed EXL2 linears with the stored q_weight shape (16x128 for a
    128x128 linear) and 34 'bits per weight'; now the logical shape, and 32 x q_weight rows / in_features."""
    from anyquant.testing.fixtures import FIXTURES

    report = anyquant.inspect(FIXTURES["exl2"].build(tmp_path / "m"))
    q = {m.name: m for m in report.modules}["model.layers.0.self_attn.q_proj"]
    assert (q.format, q.shape, q.bits) == ("exl2", (128, 128), 32 * 16 / 128)
    assert q.nbytes == 16 * 128 * 4 + 4 * 16 * 4 + 4 * 2 + 8 * 2 + 128 * 4
    assert report.totals["quantized_modules"] == 2 and 4.0 < report.totals["avg_bits_quantized"] < 4.5


P = "model.layers.0.self_attn.q_proj"


def _edit(path: Path, file: str, edit) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(path / file)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / file)


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        ("negative", lambda t: t[f"{P}.q_invperm"].__setitem__(0, -1), "q_invperm is not a permutation"),
        ("repeated", lambda t: t[f"{P}.q_invperm"].__setitem__(0, int(t[f"{P}.q_invperm"][1])), "not a permutation"),
        ("no invperm", lambda t: t.pop(f"{P}.q_invperm"), "has no q_invperm"),
        (
            "q_groups cut",
            lambda t: t.__setitem__(f"{P}.q_groups", t[f"{P}.q_groups"][:4].clone()),
            "q_groups has 2 groups",
        ),
        (
            "q_scale_max int",
            lambda t: t.__setitem__(f"{P}.q_scale_max", t[f"{P}.q_scale_max"].int()),
            "q_scale_max is I32",
        ),
        ("q_invperm out of range", lambda t: t[f"{P}.q_invperm"].__setitem__(0, 999), "not a permutation"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_exl2_tensors_that_contradict_each_other_fail_at_load(
    dense: Path,
    tmp_path: Path,
    case: str,
    edit,
    message: str,
    backend: str,  # type: ignore[no-untyped-def]
) -> None:
    """Every case loaded before (a wrapped -1 index, a repeated row, an identity order, a cut group table
    read as one long last group, integer maxima read as floats), or failed at the first forward."""
    path = tmp_path / "exl2"
    _exl2_from_dense(dense, path)
    _edit(path, "output.safetensors", edit)
    with pytest.raises(anyquant.CheckpointError, match=message):
        anyquant.load(path, backend=backend)


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        ("short suh", lambda t: t.__setitem__(f"{P}.suh", t[f"{P}.suh"][:64].clone()), "su scale has 64 elements"),
        (
            "float marker",
            lambda t: t.__setitem__(f"{P}.mul1", t[f"{P}.mul1"].float()),
            "mul1 is F32 \\(expected I32\\)",
        ),
    ],
)
def test_exl3_tensors_that_contradict_each_other_fail_at_load(
    exl3: Path,
    tmp_path: Path,
    case: str,
    edit,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    """The reference backend used to load a short suh and fail at the first forward; a float marker's value
    was used as the codebook's multiplier."""
    import shutil

    path = tmp_path / "exl3"
    shutil.copytree(exl3, path)
    (weights,) = path.glob("*.safetensors")
    if f"{P}.mul1" not in load_file(weights) and "mul1" in case:
        pytest.skip("the fixture's codebook has no mul1 marker")
    _edit(path, weights.name, edit)
    with pytest.raises(anyquant.CheckpointError, match=message):
        anyquant.load(path, backend="reference")


def test_inspect_exl3_reports_logical_shapes(exl3: Path, dense: Path) -> None:
    """The trellis holds k_proj (64 x 128 here) padded to 128 x 128; inspect showed the padded shape, so
    compare counted more parameters for EXL3 than for the same model in any other format."""
    report = anyquant.inspect(exl3)
    rows = {m.name: m for m in report.modules}
    k = rows["model.layers.0.self_attn.k_proj"]
    assert k.shape == (64, 128) and k.extra["padded_shape"] == (128, 128)
    assert rows["model.layers.0.mlp.down_proj"].shape == (128, 256)
    ours = {n: m.shape for n, m in rows.items() if n.endswith("_proj")}
    theirs = {m.name: m.shape for m in anyquant.inspect(dense).modules if m.name.endswith("_proj")}
    assert ours == theirs
