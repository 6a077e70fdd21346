"""The CLI: JSON output, exit code 2 with a typed error body, generate streams."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from anyquant.cli import main
from anyquant.testing.fixtures import FIXTURES


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict]:
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_detect_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = FIXTURES["exl3_mul1"].build(tmp_path / "m")
    code, out = _json(capsys, ["detect", str(root), "--json"])
    assert code == 0 and out["format"] == "exl3" and out["variant"] == "mul1"
    assert out["details"]["k_histogram"] == {"4.0": 2}


def test_error_exit_code_and_json_body(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = FIXTURES["awq_gemm"].build(tmp_path / "m")
    code, out = _json(capsys, ["detect", str(root), "--format", "gptq", "--json"])
    assert code == 2
    assert out["error"] == "FormatMismatchError" and "awq" in out["message"]
    code = main(["detect", str(tmp_path / "missing")])
    assert code == 2 and "ProbeError" in capsys.readouterr().err


def test_inspect_json_totals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = FIXTURES["dense"].build(tmp_path / "m")
    code, out = _json(capsys, ["inspect", str(root), "--json"])
    assert code == 0
    names = {m["name"] for m in out["modules"]}
    assert "model.layers.0.self_attn.q_proj" in names
    assert out["totals"]["parameters"] == 2 * 256 * 128 + 2 * 128 * 128 + 2 * 128


def test_inspect_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = FIXTURES["dense"].build(tmp_path / "m")
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "q_proj" in out and "parameters" in out


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _json(capsys, ["plugins", "--json"])
    assert code == 0
    names = {p["name"] for p in out["plugins"]}
    assert {"anyquant", "anyquant-gptq", "anyquant-awq", "anyquant-exl3", "anyquant-gguf"} <= names
    assert out["formats"]["dense"]["loader"] == "anyquant_runtime.dense:DenseLoader"


def test_generate_streams(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.testing.tiny import make_tiny_dense

    root = make_tiny_dense(tmp_path / "m")
    code, out = _json(capsys, ["generate", str(root), "--prompt", "Hi", "--max-new-tokens", "5", "--json"])
    assert code == 0 and out["format"] == "dense" and isinstance(out["text"], str)
    assert main(["generate", str(root), "--prompt", "Hi", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_option_values_are_json_or_strings() -> None:
    import argparse

    from anyquant.console import parse_option as _option

    assert _option("head_bits=6") == ("head_bits", 6)
    assert _option("ldlq=false") == ("ldlq", False)
    assert _option("codebook=mcg") == ("codebook", "mcg")
    assert _option("batch-tiles=null") == ("batch_tiles", None)
    assert _option('dynamic={"-:.*down": {}}') == ("dynamic", {"-:.*down": {}})
    assert _option("x=NaN") == ("x", "NaN")  # not a float nan
    assert _option("x=" + "[" * 100_000) == ("x", "[" * 100_000)  # too deep for JSON: the string
    assert _option("path=a=b") == ("path", "a=b")
    for bad in ("codebook", "=1", "1x=2", "a b=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _option(bad)


def test_options_a_flag_sets_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.testing.tiny import make_tiny_dense

    code, out = _json(capsys, ["quantize", "a", "b", "--method", "gptq", "-o", "bits=3", "--json"])
    assert code == 2 and out["error"] == "ParameterError" and "--bits" in out["message"]
    code, out = _json(
        capsys, ["quantize", "a", "b", "--method", "awq", "--zero-point", "1", "-o", "zero_point=0", "--json"]
    )
    assert code == 2 and "--zero-point" in out["message"]
    root = make_tiny_dense(tmp_path / "m")
    gen = ["generate", str(root), "--prompt", "Hi", "--max-new-tokens", "2", "--json"]
    code, out = _json(capsys, [*gen, "-o", "dtype=float16"])
    assert code == 2 and "--dtype" in out["message"]
    code, out = _json(capsys, [*gen, "-o", "no_such_option=1"])  # the loader refuses what it does not read
    assert code == 2 and out["error"] == "ParameterError" and "no_such_option" in out["message"]
    code, out = _json(capsys, [*gen, "--format", "gptq"])
    assert code == 2 and out["error"] == "FormatMismatchError"
    code, out = _json(capsys, [*gen, "-o", "runtime=transformers"])  # a load option the dense loader reads
    assert code == 0 and out["format"] == "dense"
    code, out = _json(capsys, [*gen, "-o", "runtime=nonsense"])  # ... and it arrived: its value is checked
    assert code == 2 and "nonsense" in out["message"]


def test_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    """`anyquant ... | head` printed a BrokenPipeError traceback (exit 1) in every command."""
    import subprocess
    import sys

    root = FIXTURES["dense"].build(tmp_path / "m")
    cmd = [sys.executable, "-c", "import sys; from anyquant.cli import main; sys.exit(main())", "inspect", str(root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the command (still importing) writes its table
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode in (0, 141) and b"Traceback" not in err and b"BrokenPipe" not in err, err


def test_file_system_errors_are_exit_2_with_a_json_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An OSError (a name too long, an unwritable destination) came out as a traceback with exit 1."""
    code, out = _json(capsys, ["detect", str(tmp_path / ("x" * 300)), "--json"])
    assert code == 2 and out["error"] == "ProbeError" and "File name too long" in out["message"]
    code, out = _json(
        capsys, ["calibration", "sample", "wiki", "-n", "1", "--output", str(tmp_path / "no/dir/x.jsonl"), "--json"]
    )
    assert code == 2 and out["error"] == "FileNotFoundError" and "no/dir/x.jsonl" in out["message"]


def test_json_output_is_strict_json() -> None:
    from anyquant.console import json_line

    line = json_line({"perplexity": float("nan"), "rows": [{"x": float("inf")}, 1.5], "path": Path("/a")})
    assert json.loads(line) == {"perplexity": None, "rows": [{"x": None}, 1.5], "path": "/a"}


def test_refused_calibration_check_prints_one_json_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i}" for i in range(4000)))
    code = main(["calibration", "check", str(text), str(text), "-n", "4", "--seq-len", "64", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 2 and len(out) == 1 and json.loads(out[0])["error"] == "CalibrationOverlapError"


def test_quantize_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # was read as False
        main(["quantize", "a", "b", "--method", "awq", "--zero-point", "garbage"])
    assert exc.value.code == 2 and "is not one of true/false" in capsys.readouterr().err
    code, out = _json(capsys, ["quantize", "a", "b", "--method", "awq", "--asym", "--zero-point", "off", "--json"])
    assert code == 2 and out["error"] == "ParameterError" and "--asym" in out["message"]
    code, out = _json(capsys, ["quantize", "a", "b", "--method", "exl3", "--group-size", "64", "--json"])
    assert code == 2 and "exl3 has no groups" in out["message"]  # was ignored


def test_backends_lists_each_format_and_an_unknown_format_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _json(capsys, ["backends", "--json"])
    assert code == 0 and {"gptq", "awq", "exl3", "exl2", "gguf", "dense"} <= set(out["formats"])
    assert {b["name"] for b in out["formats"]["exl3"]} >= {"exllamav3", "reference", "dequantized"}
    assert any(not b["available"] and b["reason"] for b in out["formats"]["exl3"])  # no GPU here: says why
    root = FIXTURES["dense"].build(tmp_path / "m")
    code, out = _json(capsys, ["detect", str(root), "--format", "nosuch", "--json"])
    assert code == 2 and out["error"] == "UnsupportedFormatError" and "'nosuch' is not registered" in out["message"]


def test_undecodable_prompt_is_a_parameter_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.testing.tiny import make_tiny_dense

    root = make_tiny_dense(tmp_path / "m")
    prompt = b"hi \xff\xfe".decode("utf-8", "surrogateescape")  # what argv holds for those bytes
    code, out = _json(capsys, ["generate", str(root), "--prompt", prompt, "--json"])
    assert code == 2 and out["error"] == "ParameterError" and "not valid text" in out["message"]


def test_verbose_touches_only_anyquants_loggers_and_only_for_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``main()`` used to call ``logging.basicConfig``: embedded in a host, ``-vv`` set the ROOT logger to
    DEBUG and left a stderr handler on it for good. Now ``-v`` shows anyquant's records for the command's
    duration and leaves the root logger, its handlers and other libraries' loggers as they were."""
    import logging

    from anyquant.testing.tiny import make_tiny_dense

    model = make_tiny_dense(tmp_path / "m")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()  # a host that configured nothing (pytest's own capture handlers set aside)
    try:
        assert main(["-v", "generate", str(model), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
        err = capsys.readouterr().err
        assert "INFO anyquant.api: loading" in err
        assert root.handlers == [] and root.level == logging.WARNING
        assert logging.getLogger("anyquant").level == logging.NOTSET
        assert logging.getLogger("anyquant").handlers == []
    finally:
        root.handlers[:], root.level = saved[0], saved[1]


def _walk(parser: Any, prefix: str = "anyquant") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{prefix} {name}")


def test_every_flag_and_argument_has_help() -> None:
    """Every command's flags and positional arguments, core's and the installed plugins' alike, say what they
    are in ``--help`` (argparse's own ``--help`` and the subcommand choosers aside)."""
    from anyquant.cli import build_parser

    missing = [
        f"{where}: {'/'.join(a.option_strings) or a.dest}"
        for where, parser in _walk(build_parser(with_plugins=True))
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and (a.help is None or not str(a.help).strip())
    ]
    assert not missing, "no help text: " + ", ".join(missing)


def test_version_prints_the_version_without_torch() -> None:
    """``anyquant --version`` prints anyquant's version and imports neither torch nor any plugin."""
    import anyquant

    code = (
        "import sys\n"
        "from anyquant.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'anyquant_gptq', 'anyquant_awq') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines()[0] == f"anyquant {anyquant.__version__}"
    assert "HEAVY []" in out.stdout


@pytest.mark.parametrize("problem", ["missing source", "existing destination", "bad bits"])
def test_quantize_failing_validation_prints_no_progress_bar(
    problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quantize refused before any work (its arguments checked in well under a second) prints its error
    line and nothing else: no empty progress bar on stderr."""
    src = FIXTURES["dense"].build(tmp_path / "src") if problem != "missing source" else tmp_path / "nowhere"
    dst = tmp_path / "dst"
    bits = "99" if problem == "bad bits" else "4"
    if problem == "existing destination":
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
    code = main(["quantize", str(src), str(dst), "--method", "gptq", "--bits", bits, "--no-quality-check"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("anyquant: ") and err.count("\n") == 1, err  # the error line only
    assert "%|" not in err and "\r" not in err


def test_inspect_sorts_layers_naturally(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rows in layer order, ``layers.2`` before ``layers.10`` (not the string order 0, 1, 10, 11, 2)."""
    from anyquant.testing.fixtures import write_safetensors

    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    write_safetensors(
        root / "model.safetensors", {f"model.layers.{i}.mlp.down_proj.weight": ("F16", [8, 8]) for i in range(12)}
    )
    code, out = _json(capsys, ["inspect", str(root), "--json"])
    assert code == 0
    layers = [int(m["name"].split(".")[2]) for m in out["modules"]]
    assert layers == list(range(12))


def test_serve_without_anyquant_serve_names_the_distribution(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``anyquant serve`` is anyquant-serve's (issue #41): where no installed plugin registers it, the command says
    which distribution to install (a typed error, exit 2), not argparse's "invalid choice"; ``--help`` says so too."""
    import anyquant.cli as cli

    monkeypatch.setattr(cli, "_add_plugin_commands", lambda commands: None)  # no plugin registers serve
    assert main(["serve", "model"]) == 2
    err = capsys.readouterr().err
    assert "MissingDependencyError" in err and "pip install anyquant-serve" in err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "anyquant-serve" in capsys.readouterr().out
