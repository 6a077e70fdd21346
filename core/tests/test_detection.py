"""Detection resolution: exactly one claim, typed errors for every disagreement."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import anyquant
from anyquant import Claim, FormatSpec, Probe, Registry, hookimpl
from anyquant.errors import (
    AmbiguousFormatError,
    AnyquantError,
    FormatConflictError,
    FormatMismatchError,
    PickleRefusedError,
    PluginError,
    UnknownFormatError,
    UnsupportedFormatError,
)
from anyquant.testing.fixtures import FIXTURES


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_fixture_resolves_to_its_format(name: str, tmp_path: Path) -> None:
    fx = FIXTURES[name]
    d = anyquant.detect(fx.build(tmp_path / name))
    assert d.format == fx.format
    assert d.evidence


def test_recognised_formats_are_refused_not_loaded_dense(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedFormatError, match="recognised"):
        anyquant.load(FIXTURES["hqq"].build(tmp_path / "hqq"))


@pytest.mark.parametrize("name", ["compressed_tensors", "bnb_4bit", "fp8"])
def test_formats_of_the_new_plugins_go_to_them_never_dense(name: str, tmp_path: Path) -> None:
    """Header-only fixtures (zero data): their plugin claims them, and either loads them as its format or refuses
    them with a typed error; never a dense load."""
    root = FIXTURES[name].build(tmp_path / name)
    assert anyquant.detect(root).format == FIXTURES[name].format
    try:
        model = anyquant.load(root)
    except AnyquantError:
        return
    assert model.format == FIXTURES[name].format


def _set_qc(root: Path, qc: dict | None) -> None:
    cfg = json.loads((root / "config.json").read_text())
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    (root / "config.json").write_text(json.dumps(cfg))


def test_quant_method_disagreeing_with_tensors_is_a_conflict(tmp_path: Path) -> None:
    root = FIXTURES["exl3_mul1"].build(tmp_path / "m")
    _set_qc(root, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(FormatConflictError, match="exl3"):
        anyquant.detect(root)


def test_awq_label_on_gptq_tensors_is_a_conflict(tmp_path: Path) -> None:
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    _set_qc(root, {"quant_method": "awq", "bits": 4, "group_size": 32})
    with pytest.raises(FormatConflictError, match="gptq"):
        anyquant.detect(root)


def test_quant_label_on_dense_tensors_is_never_loaded_dense(tmp_path: Path) -> None:
    root = FIXTURES["dense"].build(tmp_path / "m")
    _set_qc(root, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(FormatConflictError, match="never"):
        anyquant.load(root)


def test_unknown_quant_method_on_gptq_tensors_conflicts(tmp_path: Path) -> None:
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    _set_qc(root, {"quant_method": "mystery"})
    with pytest.raises(FormatConflictError, match="mystery"):
        anyquant.detect(root)


def test_unknown_quant_method_on_unknown_tensors_is_unknown(tmp_path: Path) -> None:
    root = FIXTURES["hqq"].build(tmp_path / "m")
    _set_qc(root, {"quant_method": "mystery"})
    (root / "model.safetensors").unlink()
    from anyquant.testing.fixtures import write_safetensors

    write_safetensors(root / "model.safetensors", {"a.codes": ("U8", [16]), "a.weight": ("U8", [4])})
    with pytest.raises(UnknownFormatError, match="mystery"):
        anyquant.load(root)


def test_nested_original_quantization_config_is_not_the_format(tmp_path: Path) -> None:
    root = FIXTURES["exl3_mul1"].build(tmp_path / "m")
    _set_qc(root, {"quant_method": "exl3", "bits": 4.0, "original_quantization_config": {"quant_method": "fp8"}})
    d = anyquant.detect(root)
    assert d.format == "exl3"
    assert any("original_quantization_config" in e for e in d.evidence)


def test_format_argument_mismatch(tmp_path: Path) -> None:
    root = FIXTURES["awq_gemm"].build(tmp_path / "m")
    with pytest.raises(FormatMismatchError, match="awq"):
        anyquant.detect(root, format="gptq")
    assert anyquant.detect(root, format="awq").format == "awq"


def test_no_plugin_installed_says_what_to_install(tmp_path: Path) -> None:
    root = FIXTURES["exl3_mul1"].build(tmp_path / "m")
    reg = Registry(
        entry_points=False
    )  # no plugin installed (a disabled one is named as such: see test_messages_say_what_helps)
    with pytest.raises(UnknownFormatError, match="pip install anyquant-exl3"):
        reg.detect(Probe.open(root))


def _claimer(fmt: str) -> types.SimpleNamespace:
    @hookimpl
    def anyquant_detect(probe: Probe) -> Claim:
        return Claim(fmt, evidence=("greedy third-party plugin",))

    return types.SimpleNamespace(anyquant_detect=anyquant_detect)


def test_two_claims_are_ambiguous_and_format_chooses(tmp_path: Path) -> None:
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    reg = Registry()
    reg.register(_claimer("exl3"), name="greedy")
    with pytest.raises(AmbiguousFormatError, match="greedy"):
        reg.detect(Probe.open(root))
    assert reg.detect(Probe.open(root), format="gptq").format == "gptq"


def test_broken_plugin_is_skipped_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    @hookimpl
    def anyquant_detect(probe: Probe) -> Claim:
        raise RuntimeError("boom")

    broken = types.SimpleNamespace(anyquant_detect=anyquant_detect)
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")
    reg = Registry()
    reg.register(broken, name="broken")
    assert reg.detect(Probe.open(root)).format == "gptq"
    assert "boom" in (next(p for p in reg.plugins() if p.name == "broken").error or "")
    alone = Registry(entry_points=False, plugins=[("broken", broken)])
    with pytest.raises(PluginError, match="plugin broken's anyquant_detect failed with RuntimeError: boom"):
        alone.detect(Probe.open(root))  # the likely cause, named
    monkeypatch.setenv("ANYQUANT_STRICT_PLUGINS", "1")
    with pytest.raises(RuntimeError, match="boom"):
        reg.detect(Probe.open(root))


def test_plugin_registering_a_taken_format_is_skipped() -> None:
    @hookimpl
    def anyquant_register_formats(register):  # type: ignore[no-untyped-def]
        register(FormatSpec(name="gptq", loader="x:Y"))

    reg = Registry()
    reg.register(types.SimpleNamespace(anyquant_register_formats=anyquant_register_formats), name="thief")
    info = next(p for p in reg.plugins() if p.name == "thief")
    assert info.error and "already registered" in info.error
    assert reg.format_owner("gptq") == "anyquant-gptq"


def test_disable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANYQUANT_DISABLE_PLUGINS", "anyquant-awq, anyquant-gguf")
    reg = Registry()
    assert "awq" not in reg.formats() and "gguf" not in reg.formats()
    assert {p.name: p.error for p in reg.plugins()}["anyquant-awq"] == "disabled"


def test_pickle_only_is_refused_by_default(tmp_path: Path) -> None:
    import torch

    from anyquant.testing.tiny import make_tiny_dense

    root = make_tiny_dense(tmp_path / "m")
    from safetensors.torch import load_file

    state = load_file(root / "model.safetensors")
    torch.save(state, root / "pytorch_model.bin")
    (root / "model.safetensors").unlink()
    assert anyquant.detect(root).variant == "pickle"
    with pytest.raises(PickleRefusedError, match="allow_pickle"):
        anyquant.load(root)
    model = anyquant.load(root, allow_pickle=True)
    assert model.format == "dense"


def test_isolated_registry_sees_only_given_plugins(tmp_path: Path) -> None:
    reg = Registry(entry_points=False)
    assert set(reg.formats()) == {"dense", "hqq"}
    with pytest.raises(UnknownFormatError, match="anyquant-gptq"):
        reg.detect(Probe.open(FIXTURES["gptq_v2"].build(tmp_path / "m")))
    # the formats whose plugins are not there: named with the plugin to install, never loaded as dense
    for name, dist in (
        ("compressed_tensors", "anyquant-compressed-tensors"),
        ("fp8", "anyquant-fp8"),
        ("bnb_4bit", "anyquant-bnb"),
    ):
        with pytest.raises(UnknownFormatError, match=dist):
            reg.detect(Probe.open(FIXTURES[name].build(tmp_path / name)))


def _toyq_checkpoint(root: Path) -> Path:
    """A made-up format's checkpoint without quant_method: int8 codes + fp16 row scales per linear, float
    norms and embedding (as a third party's format whose plugin may not be installed)."""
    from anyquant.testing.fixtures import write_safetensors

    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("F16", [256, 64])}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"model.layers.0.self_attn.{proj}.toyq_weight"] = ("I8", [64, 64])
        tensors[f"model.layers.0.self_attn.{proj}.toyq_scale"] = ("F16", [64])
    tensors["model.layers.0.input_layernorm.weight"] = ("F16", [64])
    root.mkdir(parents=True)
    write_safetensors(root / "model.safetensors", tensors, {"format": "pt"})
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return root


def test_unknown_integer_codes_are_never_dense(tmp_path: Path) -> None:
    """A format anyquant does not know (no quant_method, no known suffix) is not claimed as dense when it
    holds integer tensors: with its plugin absent that is an UnknownFormatError naming them; with it, the
    plugin's claim alone decides (no ambiguity with dense)."""
    root = _toyq_checkpoint(tmp_path / "toyq")
    reg = Registry(entry_points=False)
    with pytest.raises(UnknownFormatError, match=r"4 integer tensors \(\*\.toyq_weight\).*not loaded as dense"):
        reg.detect(Probe.open(root))

    class Toyq:
        @hookimpl
        def anyquant_detect(self, probe: Probe) -> Claim | None:
            if any(n.endswith(".toyq_weight") for n in probe.tensors):
                return Claim("toyq", evidence=("*.toyq_weight",))
            return None

    assert Registry(entry_points=False, plugins=[("toyq", Toyq())]).detect(Probe.open(root)).format == "toyq"


def test_dense_integer_buffers_stay_dense(tmp_path: Path) -> None:
    from anyquant.testing.fixtures import write_safetensors

    root = tmp_path / "d"
    root.mkdir()
    tensors = {
        "transformer.wte.weight": ("F32", [256, 64]),
        "transformer.wpe.weight": ("F32", [32, 64]),
        "embeddings.position_ids": ("I64", [1, 32]),
        "transformer.h.0.attn.bias": ("BOOL", [1, 1, 32, 32]),
        "bn.num_batches_tracked": ("I64", []),
    }
    write_safetensors(root / "model.safetensors", tensors, {"format": "pt"})
    (root / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert Registry(entry_points=False).detect(Probe.open(root)).format == "dense"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("object", r"pytorch_model\.bin: torch\.load\(weights_only=True\) cannot read it"),
        ("list", r"pytorch_model\.bin: holds a list, not a state dict"),
        ("garbage", r"pytorch_model\.bin: torch\.load\(weights_only=True\) cannot read it"),
    ],
)
def test_unreadable_pickle_is_a_checkpoint_error(tmp_path: Path, content: str, message: str) -> None:
    """Issue #27 item 6: with allow_pickle=True, a pickle of other objects raised _pickle.UnpicklingError
    (whose text advises weights_only=False) and a non-dict one AttributeError."""
    import argparse

    import torch

    from anyquant.errors import CheckpointError
    from anyquant.testing.tiny import make_tiny_dense

    root = make_tiny_dense(tmp_path / "m")
    from safetensors.torch import load_file

    state = load_file(root / "model.safetensors")
    (root / "model.safetensors").unlink()
    if content == "object":
        torch.save({**state, "args": argparse.Namespace(lr=1)}, root / "pytorch_model.bin")
    elif content == "list":
        torch.save(list(state.values()), root / "pytorch_model.bin")
    else:
        (root / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip" * 10)
    with pytest.raises(CheckpointError, match=message) as info:
        anyquant.load(root, allow_pickle=True)
    assert "weights_only=False" not in str(info.value)
