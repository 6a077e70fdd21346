"""Detection when a plugin meets malformed input, crashes, hangs or claims everything (issue #27): the
error names the field and file, or the plugin and how to disable it, never only "no plugin recognises"."""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

import pytest

import anyquant
from anyquant import Claim, Probe, Registry, hookimpl, registry
from anyquant.errors import AmbiguousFormatError, CheckpointError, ConfigError, PluginError, UnknownFormatError
from anyquant.testing import fixtures
from anyquant.testing.fixtures import FIXTURES
from core.tests.test_third_party_plugins import _install  # the same fake distribution the third-party tests install


def _set_qc(root: Path, **changes: object) -> Path:
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_awq_non_list_modules_to_not_convert_names_the_field(tmp_path: Path) -> None:
    """``list(7)`` raised TypeError inside the AWQ plugin; then its typed error hid under "no installed plugin
    recognises": the plugin that owns the declared format found the field malformed, and that is the error."""
    root = _set_qc(FIXTURES["awq_gemm"].build(tmp_path / "m"), modules_to_not_convert=7)
    with pytest.raises(
        ConfigError,
        match=r"^config.json: quantization_config.modules_to_not_convert is 7.*found by anyquant-awq",
    ):
        Registry().detect(Probe.open(root))  # its own registry: the process's keeps no plugin error from it


def test_awq_one_dimensional_qzeros_names_the_tensor_and_file(tmp_path: Path) -> None:
    """``qz.shape[1]`` raised IndexError on a 1-D qzeros."""
    t = fixtures._dense_rest()
    for lin in fixtures.LINEARS:
        p = f"{fixtures.LAYER}.{lin}"
        t[f"{p}.qweight"] = ("I32", [fixtures.HIDDEN, fixtures.HIDDEN // 8])
        t[f"{p}.qzeros"] = ("I32", [fixtures.HIDDEN])
        t[f"{p}.scales"] = ("F16", [fixtures.HIDDEN // 32, fixtures.HIDDEN])
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    root = fixtures._write_dir(tmp_path / "m", t, fixtures._config(qc))
    with pytest.raises(CheckpointError, match=r"^model.safetensors: model.layers.0.\S+.qzeros has shape \[128\]"):
        Registry().detect(Probe.open(root))  # its own registry: the process's keeps no plugin error from it


def test_gptq_object_valued_bits_names_the_field(tmp_path: Path) -> None:
    """``{cfg["bits"]}`` raised "unhashable type: 'dict'" inside the GPTQ plugin."""
    root = _set_qc(FIXTURES["gptq_v2"].build(tmp_path / "m"), bits={"x": 4})
    with pytest.raises(ConfigError, match=r"^config.json quantization_config: bits is \{'x': 4\}"):
        Registry().detect(Probe.open(root))  # its own registry: the process's keeps no plugin error from it


def _plugin(detect):  # type: ignore[no-untyped-def]
    return types.SimpleNamespace(anyquant_detect=hookimpl(detect))


def test_a_plugin_crashing_in_detect_is_named_as_the_cause(tmp_path: Path) -> None:
    """A bare exception from a plugin's detect was counted as "no claim": now it is a PluginError that names
    the plugin, the exception and how to disable the plugin. A typed error is the plugin's verdict on the
    checkpoint: raised as it is, naming the plugin (#44 item 8)."""
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")  # asked of the plugin alone: nothing else claims it

    def crash(probe: Probe) -> Claim:
        return {}["x"]  # type: ignore[no-any-return]

    reg = Registry(entry_points=False, builtin=False, plugins=[("toyq", _plugin(crash))])
    with pytest.raises(
        PluginError, match=r"plugin toyq's anyquant_detect failed with KeyError: 'x'.*ANYQUANT_DISABLE_PLUGINS=toyq"
    ):
        reg.detect(Probe.open(root))

    def refuse(probe: Probe) -> Claim:
        raise anyquant.errors.ConfigError("config.json: toyq_levels is not a list")

    typed = Registry(entry_points=False, builtin=False, plugins=[("toyq", _plugin(refuse))])
    with pytest.raises(anyquant.errors.ConfigError, match=r"^config.json: toyq_levels is not a list \(found by toyq"):
        typed.detect(Probe.open(root))

    def refuse_too(probe: Probe) -> Claim:
        raise anyquant.errors.CheckpointError("model.safetensors: toyr_codes is missing")

    both = Registry(
        entry_points=False, builtin=False, plugins=[("toyq", _plugin(refuse)), ("toyr", _plugin(refuse_too))]
    )
    with pytest.raises(UnknownFormatError, match=r"toyq's anyquant_detect raised ConfigError"):
        both.detect(Probe.open(root))  # two verdicts, neither the declared format's plugin: nobody's in particular


def test_a_hanging_detect_is_abandoned_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "DETECT_SECONDS", 0.05)
    root = FIXTURES["gptq_v2"].build(tmp_path / "m")

    def hang(probe: Probe) -> None:
        time.sleep(5)

    reg = Registry()
    reg.register(_plugin(hang), name="sleepy")
    start = time.monotonic()
    assert reg.detect(Probe.open(root)).format == "gptq"  # the others still decide
    assert time.monotonic() - start < 4  # not waited for (a bound far above the deadline, not a timing)
    info = next(p for p in reg.plugins() if p.name == "sleepy")
    assert "did not return within 0.05 s" in (info.error or "")
    alone = Registry(entry_points=False, builtin=False, plugins=[("sleepy", _plugin(hang))])
    with pytest.raises(
        PluginError, match=r"sleepy's anyquant_detect did not return within 0.05 s.*ANYQUANT_DISABLE_PLUGINS=sleepy"
    ):
        alone.detect(Probe.open(root))


def test_a_plugin_claiming_everything_is_named_in_the_ambiguity(tmp_path: Path) -> None:
    def greedy(probe: Probe) -> Claim:
        return Claim("toyq", evidence=("everything is toyq",))

    reg = Registry()
    reg.register(_plugin(greedy), name="greedy")
    for name in ("dense", "gptq_v2", "awq_gemm"):
        with pytest.raises(
            AmbiguousFormatError, match=r"third-party plugin greedy also claims.*ANYQUANT_DISABLE_PLUGINS=greedy"
        ):
            reg.detect(Probe.open(FIXTURES[name].build(tmp_path / name)))


def test_a_plugin_whose_import_hangs_is_skipped_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "IMPORT_SECONDS", 0.05)
    site = tmp_path / "site"
    _install(site, "slowq", "1.0", "slowq", "slowq_plugin", "import time\ntime.sleep(5)\n")
    monkeypatch.syspath_prepend(str(site))
    reg = Registry()
    info = {p.name: p for p in reg.plugins()}
    assert "importing slowq_plugin did not return within 0.05 s" in (info["slowq"].error or "")
    assert "ANYQUANT_DISABLE_PLUGINS=slowq" in (info["slowq"].error or "")
    assert reg.detect(Probe.open(FIXTURES["gptq_v1"].build(tmp_path / "g"))).format == "gptq"
