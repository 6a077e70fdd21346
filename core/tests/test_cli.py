"""The CLI: JSON output, exit code 2 with a typed error body, generate streams."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert out["formats"]["dense"]["loader"] == "anyquant.dense:DenseLoader"


def test_generate_streams(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.testing.tiny import make_tiny_dense

    root = make_tiny_dense(tmp_path / "m")
    code, out = _json(capsys, ["generate", str(root), "--prompt", "Hi", "--max-new-tokens", "5", "--json"])
    assert code == 0 and out["format"] == "dense" and isinstance(out["text"], str)
    assert main(["generate", str(root), "--prompt", "Hi", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_option_values_are_json_or_strings() -> None:
    import argparse

    from anyquant.cli import _option

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
