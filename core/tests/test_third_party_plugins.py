"""Third-party plugins as the entry-point machinery really finds them (a dist-info on sys.path, no
install): who owns a format id, versions, misspelt or unmarked hooks, and hooks that raise."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from types import MappingProxyType

import pytest

import anyquant
import anyquant.plugin
from anyquant import Registry, hookimpl
from anyquant.errors import PluginError
from anyquant.testing import PluginConformance
from anyquant.testing.fixtures import FIXTURES, Fixture


def _install(site: Path, dist: str, version: str, ep_name: str, module: str, code: str) -> None:
    """A plugin distribution as importlib.metadata finds it: a module and ``<dist>-<version>.dist-info``."""
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(code))
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[anyquant]\n{ep_name} = {module}\n")


SQUATTER = """
from anyquant import FormatSpec, hookimpl

@hookimpl
def anyquant_register_formats(register):
    register(FormatSpec(name="gptq", loader=None, description="not the real one"))
"""


def test_a_third_party_cannot_take_a_first_party_format_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry points used to register in name order, so "aaa-gptq" took "gptq" and the real plugin was
    skipped whole (a real GPTQ checkpoint then failed to detect); anyquant's own plugins now go first."""
    site = tmp_path / "site"
    _install(site, "aaa-gptq-squatter", "9.9", "aaa-gptq-squatter", "aaa_squat", SQUATTER)
    monkeypatch.syspath_prepend(str(site))
    reg = Registry()
    assert reg.format_owner("gptq") == "anyquant-gptq"
    info = {p.name: p for p in reg.plugins()}
    assert "already registered by anyquant-gptq" in (info["aaa-gptq-squatter"].error or "")
    assert info["anyquant-gptq"].error is None
    assert reg.detect(anyquant.Probe.open(FIXTURES["gptq_v1"].build(tmp_path / "g"))).format == "gptq"


def test_version_comes_from_the_declaring_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    _install(site, "toyq2", "0.3.1", "anyquant-toyq2", "toyq2_plugin", "X = 1\n")
    monkeypatch.syspath_prepend(str(site))
    info = {p.name: p for p in Registry().plugins()}
    assert info["anyquant-toyq2"].version == "0.3.1"  # entry-point name != distribution name


class _Misspelt:
    @hookimpl
    def anyquant_register_command(self, cli: object) -> None:  # the hook is anyquant_register_commands
        raise AssertionError("never called")

    def anyquant_detect(self, probe: object) -> None:  # no @hookimpl: pluggy ignores it
        raise AssertionError("never called")


def test_misspelt_or_unmarked_hooks_are_reported(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING, logger="anyquant.registry"):
        reg = Registry(entry_points=False, plugins=[("typo", _Misspelt())])
        reg.formats()
    text = caplog.text
    assert "anyquant_register_command is not an anyquant hook" in text and "anyquant_register_commands?" in text
    assert "anyquant_detect is not marked with @anyquant.hookimpl" in text
    monkeypatch.setenv("ANYQUANT_STRICT_PLUGINS", "yes")
    with pytest.raises(PluginError, match="did you mean anyquant_register_commands"):
        Registry(entry_points=False, plugins=[("typo", _Misspelt())]).formats()


class _BadCommands:
    @hookimpl
    def anyquant_register_commands(self, cli: object) -> None:
        raise RuntimeError("boom")


class _GoodCommands:
    @hookimpl
    def anyquant_register_commands(self, cli) -> None:  # type: ignore[no-untyped-def]
        cli.add_command("toy-hello", "say hello", lambda p: p.add_argument("who"), lambda a: print("hi", a.who) or 0)


def test_a_raising_command_hook_is_skipped_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from anyquant import api
    from anyquant.cli import main

    reg = Registry(entry_points=False, plugins=[("bad", _BadCommands()), ("good", _GoodCommands())])
    monkeypatch.setattr(api, "default_registry", lambda: reg)
    assert main(["-v", "toy-hello", "you"]) == 0  # a global option before a plugin's command
    assert "hi you" in capsys.readouterr().out
    assert "anyquant_register_commands raised RuntimeError: boom" in (
        {p.name: p for p in reg.plugins()}["bad"].error or ""
    )
    root = FIXTURES["dense"].build(tmp_path / "m")
    assert main(["-v", "detect", str(root), "--json"]) == 0  # built-in commands never load plugin commands
    monkeypatch.setenv("ANYQUANT_STRICT_PLUGINS", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["toy-hello", "you"])


class _BadCalibration:
    @hookimpl
    def anyquant_register_calibration(self, register: object) -> None:
        raise RuntimeError("no texts")


def test_strict_mode_reads_the_same_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant_tools.calibration import sources

    reg = Registry(entry_points=False, plugins=[("cal", _BadCalibration())])
    assert "wiki" in sources(reg)  # logged and skipped
    monkeypatch.setenv("ANYQUANT_STRICT_PLUGINS", "true")  # was "1" only here, any true value elsewhere
    with pytest.raises(RuntimeError, match="no texts"):
        sources(reg)


TOYQ_PLUGIN = """
from anyquant import Claim, FormatSpec, hookimpl

@hookimpl
def anyquant_register_formats(register):
    register(FormatSpec(name="toyq", loader=None, description="int8 codes + fp16 row scales"))

@hookimpl
def anyquant_detect(probe):
    n = sum(1 for name in probe.tensors if name.endswith(".toyq_weight"))
    return Claim("toyq", evidence=(f"{n} *.toyq_weight tensors",)) if n else None
"""


def _toyq_fixture(root: Path) -> Path:
    from anyquant.testing.fixtures import write_safetensors

    root.mkdir(parents=True)
    tensors = {
        "model.embed_tokens.weight": ("F16", [64, 32]),
        "model.layers.0.mlp.up_proj.toyq_weight": ("I8", [32, 32]),
        "model.layers.0.mlp.up_proj.toyq_scale": ("F16", [32]),
    }
    write_safetensors(root / "model.safetensors", tensors, {"format": "pt"})
    (root / "config.json").write_text('{"model_type": "llama"}')
    return root


@pytest.fixture(scope="class")
def toyq_installed(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The made-up third-party plugin ``toyq`` (package ``toyq_pkg``, with py.typed), found through its
    dist-info on sys.path and PYTHONPATH (the kit's import check runs in a subprocess)."""
    import os

    site = tmp_path_factory.mktemp("site")
    pkg = site / "toyq_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "py.typed").write_text("")
    (pkg / "plugin.py").write_text(TOYQ_PLUGIN)
    info = site / "anyquant_toyq-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: anyquant-toyq\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[anyquant]\nanyquant-toyq = toyq_pkg.plugin\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        yield site


@pytest.mark.usefixtures("toyq_installed")
class TestThirdPartyKit(PluginConformance):
    """The conformance kit run on a third party's plugin: its own fixture through ``extra_fixtures``."""

    entry_point = "anyquant-toyq"
    package = "toyq_pkg"
    formats = ("toyq",)
    recognised_only = ("toyq",)
    extra_fixtures = MappingProxyType({"toyq_linear": Fixture("toyq_linear", "toyq", _toyq_fixture)})


@pytest.mark.usefixtures("toyq_installed")
def test_kit_refuses_a_misspelt_own_fixture() -> None:
    class Misnamed(TestThirdPartyKit):
        own_fixtures = ("toyq_fixture",)

    with pytest.raises(AssertionError, match=r"own_fixtures \['toyq_fixture'\] are not in"):
        Misnamed().test_fixtures_exist()


@pytest.mark.usefixtures("toyq_installed")
def test_inspect_without_a_plugin_inspect_never_shows_codes_as_dense(tmp_path: Path) -> None:
    """A plugin with no ``inspect()`` (toyq has no loader at all): its coded modules are rows of its format,
    bits unknown, not "dense 16-bit" rows with a scale's shape."""
    report = anyquant.inspect(_toyq_fixture(tmp_path / "t"), registry=Registry())
    rows = {m.name: m for m in report.modules}
    up = rows["model.layers.0.mlp.up_proj"]
    assert (up.format, up.bits, up.shape, up.nbytes) == ("toyq", None, (32, 32), 32 * 32 + 2 * 32)
    assert rows["model.embed_tokens"].format == "dense"
    assert report.totals["quantized_modules"] == 1


class _SecondDense:
    @hookimpl
    def anyquant_detect(self, probe: anyquant.Probe) -> anyquant.Claim | None:
        return anyquant.Claim("dense", evidence=("me too",)) if "model.embed_tokens.weight" in probe.tensors else None


def test_messages_say_what_helps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Two plugins naming the same format: format= cannot help, the message says to disable one; a disabled
    (not missing) plugin is named as such; `anyquant plugins` lists a disabled plugin as disabled, not ERROR."""
    from anyquant.errors import AmbiguousFormatError, UnknownFormatError

    dense = FIXTURES["dense"].build(tmp_path / "d")
    reg = Registry(entry_points=False, plugins=[("second", _SecondDense())])
    with pytest.raises(
        AmbiguousFormatError,
        match=r"They name the same format: third-party plugin second .*ANYQUANT_DISABLE_PLUGINS=second\.",
    ):
        reg.detect(anyquant.Probe.open(dense), format="dense")
    exl3 = FIXTURES["exl3_mul1"].build(tmp_path / "e")
    with pytest.raises(UnknownFormatError, match="its plugin anyquant-exl3 is installed but disabled"):
        Registry(disable={"anyquant-exl3"}).detect(anyquant.Probe.open(exl3))
    from anyquant import api
    from anyquant.cli import main

    monkeypatch.setattr(api, "default_registry", lambda: Registry(disable={"anyquant-exl3"}))
    assert main(["plugins"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("anyquant-exl3"))
    assert "disabled (ANYQUANT_DISABLE_PLUGINS)" in line and "ERROR" not in line


def test_detection_carries_the_probes_notes(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from anyquant.cli import main

    root = FIXTURES["dense"].build(tmp_path / "d")
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})
    )
    notes = anyquant.detect(root).notes
    assert notes and any("model-00001-of-00002.safetensors" in n for n in notes)
    assert main(["detect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == list(notes)


SLOW = """
import time

from anyquant import FormatSpec, hookimpl

time.sleep(0.4)  # a plugin with a heavy import: the first use is still discovering while other threads ask


@hookimpl
def anyquant_register_formats(register):
    register(FormatSpec(name="toyslow", loader=None, description="slow to import"))
"""


def test_threads_racing_the_first_use_all_see_every_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin manager used to be published before discovery had filled it: a second thread's first
    ``detect`` then saw no format at all ("Installed formats: []"). Now every thread waits for the full set."""
    import threading

    site = tmp_path / "site"
    _install(site, "toyslow", "0.1", "anyquant-toyslow", "toyslow_plugin", SLOW)
    monkeypatch.syspath_prepend(str(site))
    ckpt = FIXTURES["gptq_v1"].build(tmp_path / "g")
    reg = Registry()
    seen: list[object] = []
    start = threading.Barrier(4)

    def first_use() -> None:
        start.wait()
        try:
            seen.append((sorted(reg.formats()), reg.detect(anyquant.Probe.open(ckpt)).format))
        except Exception as exc:
            seen.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 4
    for got in seen:
        assert not isinstance(got, Exception), got
        formats, detected = got  # type: ignore[misc]
        assert {"gptq", "awq", "exl3", "gguf", "toyslow"} <= set(formats)
        assert detected == "gptq"


class ToyQuantizer:
    """A third party's quantizer with a flag of its own (``--levels``) and a check of it."""

    method = "toyq"
    quantize_options = MappingProxyType({"levels": "quantization levels per weight"})
    quantize_flags = (anyquant.plugin.QuantizeFlag("levels", "toyq: levels per weight", "str"),)

    @staticmethod
    def check_flags(given: dict[str, object]) -> None:
        if not str(given.get("levels", "1")).isdigit():
            raise anyquant.plugin.ParameterError("--levels: a whole number")

    def quantize(self, src: Path, dst: Path, spec: object, progress: object) -> Path:  # pragma: no cover
        raise AssertionError("never reached: the source does not exist")


class _ToyQuantizerPlugin:
    @hookimpl
    def anyquant_register_formats(self, register) -> None:  # type: ignore[no-untyped-def]
        register(anyquant.FormatSpec(name="toyq", loader=None, quantizer=f"{__name__}:ToyQuantizer"))


def test_quantize_methods_and_their_flags_come_from_the_registry(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`anyquant quantize --method` used to be gptq/awq/exl3 hard-coded in core (a third party's quantizer was
    unreachable from the CLI), and --zero-point/--desc-act core's flags: both now come from the registered
    quantizers (``quantize_flags``, ``check_flags``)."""
    import json

    import anyquant_tools.plugin  # the quantize command's (anyquant-tools') plugin, beside the toy quantizer's
    from anyquant import api
    from anyquant.cli import main

    plugins = [("anyquant-tools", anyquant_tools.plugin), _ToyQuantizerPlugin()]
    monkeypatch.setattr(api, "default_registry", lambda: Registry(entry_points=False, plugins=plugins))
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--method {toyq}" in out and "--levels LEVELS" in out and "toyq: levels" in out
    assert "--desc-act" not in out and "--zero-point" not in out  # no GPTQ or AWQ plugin in this registry
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "a", "b", "--method", "gptq"])
    assert exc.value.code == 2 and "invalid choice: 'gptq'" in capsys.readouterr().err
    assert main(["quantize", "a", "b", "--method", "toyq", "--levels", "x", "--json"]) == 2  # its check_flags
    assert json.loads(capsys.readouterr().out) == {"error": "ParameterError", "message": "--levels: a whole number"}
    assert main(["quantize", "a", "b", "--method", "toyq", "--levels", "4", "-o", "levels=5", "--json"]) == 2
    assert "-o levels=...: use --levels" in capsys.readouterr().out
    assert main(["quantize", "a", "b", "--method", "toyq", "--levels", "4", "--json"]) == 2  # reached quantize()
    assert "source a does not exist" in json.loads(capsys.readouterr().out)["message"]
