"""The cpu-fast backend on GPTQModel's tiny-Llama checkpoints: exact weights, logits within the stated
tolerance of the reference backend, greedy tokens equal to GPTQModel's; non-4-bit layers fall back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from anyquant.errors import UnsupportedBackendError
from anyquant_cpu import kernels
from anyquant_cpu import step as step_module
from anyquant_cpu.engine import FastInt4Linear, bf16_gemm_is_fast, block_kernel_is_fast, fast_cpu_capable
from anyquant_cpu.kernels.linear import GroupInt4BlockLinear
from anyquant_gptq.loader import GPTQLoader
from anyquant_gptq.qlinear import GPTQLinear
from tests.decoding import rel_error, stepwise_logits
from tests.peers.catalog import GPTQ_QUANT_VARIANTS, gptqmodel_gptq_quantized_dir

pytestmark = [pytest.mark.peer, pytest.mark.skipif(not fast_cpu_capable()[0], reason=fast_cpu_capable()[1])]

VARIANTS = [v["name"] for v in GPTQ_QUANT_VARIANTS]
FOUR_BIT = [v["name"] for v in GPTQ_QUANT_VARIANTS if v["bits"] == 4]
OTHER_BITS = [v["name"] for v in GPTQ_QUANT_VARIANTS if v["bits"] != 4]
#: relative to max |logit|: the int4 kernel (bfloat16) decodes, prompts above small_rows go through
#: an exact-weight float32 GEMM.
DECODE_TOL = 2e-2
PREFILL_TOL = 1e-5


@pytest.fixture(scope="module")
def root() -> Path:
    return gptqmodel_gptq_quantized_dir()


@pytest.mark.parametrize("variant", FOUR_BIT)
def test_four_bit_layers_run_fast_with_exact_weights_and_logits_in_tolerance(root: Path, variant: str) -> None:
    path = root / "quantized" / variant
    # small_rows=16: the 32-token prompt takes the many-rows path (exact weights, float32 GEMM: the option that
    # keeps prompts exact; the default, "auto", runs them in bfloat16 where the CPU has AMX or AVX512-BF16)
    fast = anyquant.load(path, backend="cpu-fast", cpu_fast_small_rows=16, cpu_fast_prefill="float32")
    assert fast.backend == "cpu-fast"
    assert fast.info["cpu_fast"]["fast_layers"] == 14 and not fast.info["cpu_fast"]["dequantized_layers"]
    modules = dict(fast.module.named_modules())
    theirs = load_file(root / "judges" / variant / "gptqmodel_dequant.safetensors")
    for key, weight_in_out in theirs.items():
        layer = modules[key.removesuffix(".weight")]
        assert isinstance(layer, (FastInt4Linear, GroupInt4BlockLinear)), key
        assert torch.equal(layer.dequantize(), weight_in_out.t().contiguous()), key
    ref_model = anyquant.load(path, backend="reference")
    ids = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")["input_ids"]
    with torch.no_grad():
        want = ref_model.module(ids).logits
        assert ids.shape[1] > fast.info["cpu_fast"]["small_rows"]
        assert rel_error(fast.module(ids).logits, want) < PREFILL_TOL
        assert rel_error(stepwise_logits(fast.module, ids), want) < DECODE_TOL
        default = anyquant.load(path, backend="cpu-fast")  # 32 rows <= 64: the int4 kernel
        assert default.info["cpu_fast"]["small_rows"] == 64
        assert rel_error(default.module(ids).logits, want) < DECODE_TOL
        auto = anyquant.load(path, backend="cpu-fast", cpu_fast_small_rows=16)  # the default prompt path
        assert auto.info["cpu_fast"]["prefill_dtype"] == ("bfloat16" if bf16_gemm_is_fast() else "compute dtype")
        assert rel_error(auto.module(ids).logits, want) < DECODE_TOL


@pytest.mark.parametrize("variant", FOUR_BIT)
def test_greedy_tokens_match_gptqmodel_and_reference(root: Path, variant: str) -> None:
    path = root / "quantized" / variant
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    tokens = ref["greedy_tokens"][0].tolist()
    prompt, want = tokens[:8], tokens[8:]
    fast = anyquant.load(path, backend="cpu-fast")
    got = fast.generator.generate_ids(prompt, fast.params(max_new_tokens=len(want)))
    reference = anyquant.load(path, backend="reference")
    assert got == reference.generator.generate_ids(prompt, reference.params(max_new_tokens=len(want)))
    assert got == want


@pytest.mark.skipif(not kernels.available(), reason="anyquant kernels not built")
@pytest.mark.parametrize("variant", FOUR_BIT)
def test_block_kernel_decodes_as_the_int4_kernel(root: Path, variant: str) -> None:
    """With the compiled kernel built and cpu_fast_kernel="gq4" (the default where the kernel is vectorized), 4-bit layers with a trivial g_idx become GQ4
    block linears (a whole decoder layer at a time, planned by the decode step as "ggml"); act-order layers stay
    on torch's int4 kernel. Greedy tokens equal torch's int4 path's (`cpu_fast_kernel="torch"`) and GPTQModel's; decode logits
    within cpu-fast's tolerance."""
    path = root / "quantized" / variant
    desc = next(v["desc_act"] for v in GPTQ_QUANT_VARIANTS if v["name"] == variant)
    ref = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")
    tokens, ids = ref["greedy_tokens"][0].tolist(), ref["input_ids"]
    gq4 = anyquant.load(path, backend="cpu-fast", cpu_fast_kernel="gq4")
    before = anyquant.load(path, backend="cpu-fast", cpu_fast_kernel="torch")
    record = gq4.info["cpu_fast"]["block_kernel"]
    blocks = [m for m in gq4.module.modules() if isinstance(m, GroupInt4BlockLinear)]
    assert "block_kernel" not in before.info["cpu_fast"]
    if block_kernel_is_fast():  # the default where the kernel has a vector path (AVX2, AVX512-VNNI)
        assert anyquant.load(path, backend="cpu-fast").info["cpu_fast"]["block_kernel"] == record
    assert not any(isinstance(m, GroupInt4BlockLinear) for m in before.module.modules())
    if desc:
        assert record["gq4_layers"] == 0 and not blocks
        assert set(record["int4_kernel"].values()) == {"a g_idx that reorders columns (act-order)"}
    else:
        assert record == {"gq4_layers": 14, "int4_kernel": {}} and len(blocks) == 14
    prompt, want = tokens[:8], tokens[8:]
    got = gq4.generator.generate_ids(prompt, gq4.params(max_new_tokens=len(want)))
    assert got == before.generator.generate_ids(prompt, before.params(max_new_tokens=len(want))) == want
    if not desc:
        step = gq4.module.__dict__["_step"]
        assert all(function is step_module.compiled_layer("ggml") for function, _ in step.layers)
    reference = anyquant.load(path, backend="reference")
    with torch.no_grad():
        logits = stepwise_logits(gq4.module, ids)
        assert rel_error(logits, reference.module(ids).logits) < DECODE_TOL
        assert rel_error(logits, stepwise_logits(before.module, ids)) < DECODE_TOL
    with pytest.raises(anyquant.ParameterError, match="cpu_fast_kernel"):
        anyquant.load(path, backend="cpu-fast", cpu_fast_kernel="int8")


@pytest.mark.parametrize("variant", OTHER_BITS)
def test_other_bit_widths_fall_back_to_dequantized_and_say_so(root: Path, variant: str) -> None:
    path = root / "quantized" / variant
    fast = anyquant.load(path, backend="cpu-fast")
    report = fast.info["cpu_fast"]
    assert report["fast_layers"] == 0 and len(report["dequantized_layers"]) == 14
    assert all("4-bit" in reason for reason in report["dequantized_layers"].values())
    layers = [m for m in fast.module.modules() if isinstance(m, GPTQLinear)]
    assert len(layers) == 14 and {m.mode for m in layers} == {"dequantized"}
    ids = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")["input_ids"]
    dequantized = anyquant.load(path, backend="dequantized")
    with torch.no_grad():
        assert torch.equal(fast.module(ids).logits, dequantized.module(ids).logits)


@pytest.mark.parametrize("variant", VARIANTS)
def test_auto_picks_cpu_fast_for_4_bit_on_cpu(root: Path, variant: str) -> None:
    model = anyquant.load(root / "quantized" / variant)
    assert model.backend == ("cpu-fast" if variant in FOUR_BIT else "dequantized")


def test_backend_listed_and_cpu_only(root: Path) -> None:
    loader = GPTQLoader()
    info = {b.name: b for b in loader.backends()}
    assert info["cpu-fast"].available
    assert loader.preference().index("cpu-fast") < loader.preference().index("dequantized")
    with pytest.raises(UnsupportedBackendError, match="CPU"):
        loader.choose_backend("cpu-fast", torch.device("cuda"))


def test_options_bf16_prefill_and_small_rows(root: Path) -> None:
    variant = "b4_g32_asym_desc_gptq"
    path = root / "quantized" / variant
    ids = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")["input_ids"]
    fast = anyquant.load(path, backend="cpu-fast", cpu_fast_prefill="bfloat16", cpu_fast_small_rows=40)
    assert fast.info["cpu_fast"]["prefill_dtype"] == "bfloat16" and fast.info["cpu_fast"]["small_rows"] == 40
    reference = anyquant.load(path, backend="reference")
    with torch.no_grad():
        want = reference.module(ids).logits
        assert rel_error(fast.module(ids).logits, want) < DECODE_TOL  # 32 rows <= 40: the int4 kernel
        for layer in fast.module.modules():
            if isinstance(layer, FastInt4Linear):
                layer.small_rows = 0
        assert rel_error(fast.module(ids).logits, want) < DECODE_TOL  # bfloat16 GEMM


def test_bfloat16_compute_dtype(root: Path) -> None:
    """dtype=bfloat16: the int4 kernel runs without casts, prompts use a bfloat16 GEMM; both within
    bfloat16 tolerance of the reference backend in bfloat16."""
    variant = "b4_g128_sym_nodesc_gptq"
    path = root / "quantized" / variant
    ids = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")["input_ids"]
    reference = anyquant.load(path, backend="reference", dtype="bfloat16")
    with torch.no_grad():
        want = reference.module(ids).logits.float()
        for rows in (64, 16):  # 32-token prompt: int4 kernel, then the dequantize + GEMM path
            fast = anyquant.load(path, backend="cpu-fast", dtype="bfloat16", cpu_fast_small_rows=rows)
            logits = fast.module(ids).logits
            assert logits.dtype == torch.bfloat16
            assert rel_error(logits.float(), want) < DECODE_TOL


def test_tables_left_in_the_file_give_the_same_logits(root: Path) -> None:
    """By default the fast head's exact table and the input embedding stay in the safetensors file
    (``cpu_fast_tables="file"``); the logits are bitwise those of the tables read into memory."""
    from anyquant_cpu.engine import bf16_head_status

    if not bf16_head_status()[0]:
        pytest.skip(bf16_head_status()[1])
    variant = "b4_g32_sym_nodesc_gptq" if "b4_g32_sym_nodesc_gptq" in FOUR_BIT else FOUR_BIT[0]
    path = root / "quantized" / variant
    ids = load_file(root / "judges" / variant / "gptqmodel_logits.safetensors")["input_ids"]
    filed = anyquant.load(path, backend="cpu-fast", cpu_fast_small_rows=16)
    held = anyquant.load(path, backend="cpu-fast", cpu_fast_small_rows=16, cpu_fast_tables="memory")
    head = filed.info["cpu_fast"]["lm_head"]
    assert (head["exact_in"], head["embedding_in"]) == ("file", "file")
    assert held.info["cpu_fast"]["lm_head"]["exact_in"] == "memory"
    with torch.no_grad():
        assert torch.equal(filed.module(ids).logits, held.module(ids).logits)  # 32 rows: exact paths
        assert torch.equal(filed.module(ids[:, :8]).logits, held.module(ids[:, :8]).logits)  # prepacked head
    with pytest.raises(anyquant.ParameterError, match="cpu_fast_tables"):
        anyquant.load(path, backend="cpu-fast", cpu_fast_tables="disk")
    with pytest.raises(anyquant.ParameterError, match="unknown load option"):  # a typo is not a no-op
        anyquant.load(path, backend="cpu-fast", cpu_fast_table="memory")


def test_close_releases_the_files_and_the_model(root: Path) -> None:
    """cpu-fast keeps the checkpoint open for the embedding and head tables; close() (or a with block) closes
    those handles and drops the module, and a closed model says so instead of generating."""
    import gc
    import weakref

    from anyquant_cpu.engine import bf16_head_status
    from anyquant_runtime.tensors import FileRows

    path = root / "quantized" / FOUR_BIT[0]
    gc.collect()
    gc.disable()  # freed by reference counting at close(), not left to the cycle collector
    try:
        with anyquant.load(path, backend="cpu-fast") as model:
            tables = [v for m in model.module.modules() for v in vars(m).values() if isinstance(v, FileRows)]
            # the tables stay in the file only beside a bfloat16 head (AVX512-BF16 or AMX); else they are in memory
            assert bool(tables) is bf16_head_status()[0] and not any(t._fh.closed for t in tables)
            assert model.generate("Hello", max_new_tokens=3, chat=False) is not None  # builds the decode step
            assert model.module.__dict__.get("_step") is not None
            module = weakref.ref(model.module)
        assert model.closed and all(t._fh.closed for t in tables)
        assert module() is None  # the native module and its decode step no longer keep each other alive
    finally:
        gc.enable()
    with pytest.raises(anyquant.ModelClosedError, match="was closed"):
        model.generate("Hello", max_new_tokens=2)
    model.close()  # idempotent
    assert repr(model).endswith(", closed)")


def test_closing_while_a_stream_is_read(root: Path) -> None:
    """A stream still being read when its model is closed stops with a ModelClosedError (it used to read
    the closed checkpoint file: a bare ValueError 'I/O operation on closed file', or run on regardless)."""
    model = anyquant.load(root / "quantized" / FOUR_BIT[0], backend="cpu-fast")
    stream = model.stream("Hello there, how", max_new_tokens=8, chat=False)
    next(stream)
    model.close()
    with pytest.raises(anyquant.ModelClosedError, match="closed while generating"):
        list(stream)


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        (
            "head_rows",
            anyquant.CheckpointError,
            r"'lm_head.weight' has shape \(\d+, \d+\) in the checkpoint, the model",
        ),
        ("embedding_width", anyquant.CheckpointError, r"'model.embed_tokens.weight' has shape"),
        ("embedding_rows", anyquant.CheckpointError, r"'model.embed_tokens.weight' has shape"),
        ("embedding_int16", anyquant.CheckpointError, r"'model.embed_tokens.weight' is int16 in the checkpoint"),
        ("norm_int32", anyquant.CheckpointError, r"'model.layers.0.input_layernorm.weight' is int32"),
        ("head_missing", anyquant.MissingTensorError, r"tie_word_embeddings: false, but the checkpoint has no"),
        ("embedding_nan", anyquant.NumericalError, r"'model.embed_tokens.weight' holds 1 NaN"),
        ("head_inf", anyquant.NumericalError, r"'lm_head.weight' holds 2 NaN/inf|'lm_head.weight' holds 2 inf"),
    ],
)
def test_tables_left_in_the_file_are_checked_at_load(
    root: Path, tmp_path: Path, case: str, error: type, message: str
) -> None:
    """cpu-fast leaves the embedding and head in the file; their shapes and dtypes are checked at load
    as every other tensor's. Before: a head twice the vocabulary loaded and gave logits twice as wide, a
    short embedding failed at the first lookup past it, an integer table loaded as numbers, and a missing
    head with ``tie_word_embeddings: false`` was tied to the embedding in silence."""
    import json
    import shutil

    from safetensors.torch import save_file

    variant = FOUR_BIT[0]
    path = tmp_path / case
    shutil.copytree(root / "quantized" / variant, path)
    assert json.loads((path / "config.json").read_text()).get("tie_word_embeddings") is False
    (weights,) = path.glob("*.safetensors")
    t = load_file(weights)
    emb = t["model.embed_tokens.weight"]
    if case == "head_rows":
        t["lm_head.weight"] = torch.cat([t["lm_head.weight"]] * 2)
    elif case == "embedding_width":
        t["model.embed_tokens.weight"] = torch.cat([emb, emb], 1)
    elif case == "embedding_rows":
        t["model.embed_tokens.weight"] = emb[:100].clone()
    elif case == "embedding_int16":
        t["model.embed_tokens.weight"] = (emb * 100).to(torch.int16)
    elif case == "embedding_nan":
        t["model.embed_tokens.weight"][7, 3] = float("nan")
    elif case == "head_inf":
        t["lm_head.weight"][5, 1] = float("inf")
        t["lm_head.weight"][-1, -1] = -float("inf")
    elif case == "norm_int32":
        norm = t["model.layers.0.input_layernorm.weight"]
        t["model.layers.0.input_layernorm.weight"] = (norm * 10).to(torch.int32)
    else:
        del t["lm_head.weight"]
    save_file(t, weights, metadata={"format": "pt"})
    with pytest.raises(error, match=message):
        anyquant.load(path)
