"""exllamav3's converter behind quantize(method="exl3", quantizer_backend="exllamav3"): what can be checked
without CUDA. Backend choice and refusal, the converter's command line, the packed calibration file in the
layout exllamav3's ``get_file_calibration`` reads, progress from its output, and the worker's relay and
judgement run against a stand-in converter process. The real conversion runs in bench/gpu_exl3.sh."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import anyquant
from anyquant.errors import QuantizeError
from anyquant.protocols import QuantizeSpec
from anyquant.testing.tiny import make_tiny_dense, make_tokenizer
from anyquant_exl3 import exllamav3_kernels
from anyquant_exl3.exllamav3_convert import (
    MODULE,
    converted_ok,
    converter_command,
    job,
    layer_progress,
    write_calibration,
)
from anyquant_exl3.quantize import quantizer_backend
from anyquant_tools.quantize import WorkerError, run_worker

CUDA = torch.cuda.is_available()


def _spec(**options: object) -> QuantizeSpec:
    return QuantizeSpec(method="exl3", bits=3.5, calibration_samples=16, calibration_seq_len=256, options=options)


@pytest.mark.skipif(CUDA, reason="checks the choice on a machine without CUDA")
def test_backend_choice_without_cuda() -> None:
    assert quantizer_backend(_spec()) == "anyquant"
    assert quantizer_backend(_spec(quantizer_backend="anyquant")) == "anyquant"
    with pytest.raises(QuantizeError, match="quantizer_backend='exllamav3' cannot run here"):
        quantizer_backend(_spec(quantizer_backend="exllamav3"))
    with pytest.raises(QuantizeError, match="is not one of"):
        quantizer_backend(_spec(quantizer_backend="autoround"))


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_quantize_refuses_exllamav3_without_cuda_before_writing(tmp_path: Path) -> None:
    dense = make_tiny_dense(tmp_path / "tiny", num_hidden_layers=1)
    with pytest.raises(QuantizeError, match="cannot run here"):
        anyquant.quantize(dense, tmp_path / "out", method="exl3", quantizer_backend="exllamav3")
    assert not (tmp_path / "out").exists()


def test_backend_specific_options_choose_or_conflict(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option only one quantizer reads is never silently dropped: with "auto" it picks that quantizer (so
    ``encode_device="cuda"`` runs anyquant's encoder on the GPU even where exllamav3's converter could run), and
    naming the other quantizer with it is an error."""
    available = exllamav3_kernels.BackendInfo("exllamav3", True)
    monkeypatch.setattr(exllamav3_kernels, "backend_info", lambda: available)
    assert quantizer_backend(_spec()) == "exllamav3"  # auto, where the converter can run
    for option in ("encode_device", "ldlq", "batch_tiles"):
        assert quantizer_backend(_spec(**{option: "cpu"})) == "anyquant"
        with pytest.raises(
            QuantizeError, match=rf"'exllamav3' does not read \['{option}'\] \(quantizer_backend 'anyquant' does"
        ):
            quantizer_backend(_spec(quantizer_backend="exllamav3", **{option: "cpu"}))
    for option in ("devices", "out_scales", "scaled_hessian"):
        assert quantizer_backend(_spec(**{option: "0"})) == "exllamav3"
        with pytest.raises(
            QuantizeError, match=rf"'anyquant' does not read \['{option}'\] \(quantizer_backend 'exllamav3' does"
        ):
            quantizer_backend(_spec(quantizer_backend="anyquant", **{option: "0"}))
    with pytest.raises(QuantizeError, match=r"'devices' by 'exllamav3'; 'encode_device' by 'anyquant'\): one runs"):
        quantizer_backend(_spec(encode_device="cuda", devices="0"))
    # where the converter cannot run, its own options say so instead of falling back to anyquant's encoder
    missing = exllamav3_kernels.BackendInfo("exllamav3", False, "no CUDA device")
    monkeypatch.setattr(exllamav3_kernels, "backend_info", lambda: missing)
    assert quantizer_backend(_spec()) == "anyquant"
    with pytest.raises(QuantizeError, match=r"options \['scaled_hessian'\] \(exllamav3's converter\) cannot run here"):
        quantizer_backend(_spec(scaled_hessian=True))


def test_head_bits_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant.probe import Probe
    from anyquant_exl3.quantize import EXL3Quantizer

    probe = Probe.open(make_tiny_dense(tmp_path / "tiny", num_hidden_layers=1))
    with pytest.raises(QuantizeError, match="head_bits=16 only"):
        EXL3Quantizer().validate(probe, _spec(quantizer_backend="anyquant", head_bits=6))
    # where exllamav3 can run, its converter quantizes the head: 1..8 or 16
    monkeypatch.setattr(exllamav3_kernels, "backend_info", lambda: exllamav3_kernels.BackendInfo("exllamav3", True))
    EXL3Quantizer().validate(probe, _spec(quantizer_backend="exllamav3", head_bits=6))
    EXL3Quantizer().validate(probe, _spec(head_bits=16))  # auto -> exllamav3 here
    with pytest.raises(QuantizeError, match="head_bits must be"):
        EXL3Quantizer().validate(probe, _spec(quantizer_backend="exllamav3", head_bits=12))


def test_converter_command(tmp_path: Path) -> None:
    j = job(tmp_path / "src", tmp_path / "q" / "model", _spec(codebook="MCG", scaled_hessian=True), tmp_path / "c", 30)
    cmd = converter_command(j, python="py")
    assert cmd[:3] == ["py", "-m", MODULE] == ["py", "-m", "exllamav3.conversion.convert_model"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["-i"] == str((tmp_path / "src").resolve()) and flags["-o"] == str((tmp_path / "q/model").resolve())
    assert flags["-w"] == str((tmp_path / "q/exllamav3-work").resolve())
    assert (flags["-b"], flags["-hb"], flags["-cb"], flags["-cr"], flags["-cc"]) == ("3.5", "6", "mcg", "16", "256")
    assert flags["-cd"] == str((tmp_path / "c").resolve()) and flags["-d"] == "0" and flags["--out_scales"] == "auto"
    assert cmd[-1] == "-sh"
    assert "-sh" not in converter_command(job(tmp_path, tmp_path / "o", _spec(head_bits=16), tmp_path, 1))
    with pytest.raises(QuantizeError, match="out_scales"):
        job(tmp_path, tmp_path / "o", _spec(out_scales="yaqa"), tmp_path, 1)
    # a ring-coded token embedding: exllamav3 1.6's --embed_bits (whole bits only)
    eb = converter_command(job(tmp_path, tmp_path / "o", _spec(embed_bits=4), tmp_path, 1))
    assert eb[-2:] == ["-eb", "4"] and "-eb" not in cmd
    with pytest.raises(QuantizeError, match="embed_bits"):
        job(tmp_path, tmp_path / "o", _spec(embed_bits=3.5), tmp_path, 1)


def test_calibration_file_reads_back_as_exllamav3_reads_it(tmp_path: Path) -> None:
    tok = make_tokenizer()
    texts = ["short text", "a much longer calibration text with many more words in it " * 3, ""]
    rows = write_calibration(tok, texts, 20, tmp_path / "cal.safetensors")
    data = load_file(tmp_path / "cal.safetensors")
    ids, lengths = data["input_ids"], data["lengths"]
    assert rows == 2 and ids.dtype == torch.int64 and ids.shape[0] == 2 and lengths.tolist()[1] == 20
    for i, text in enumerate(texts[:2]):
        want = tok(text, add_special_tokens=False)["input_ids"][:20]
        # exllamav3's get_file_calibration: row i cropped to min(cal_cols, lengths[i])
        assert ids[i, : int(lengths[i])].tolist() == want
        assert ids[i, int(lengths[i]) :].eq(0).all()
    with pytest.raises(QuantizeError, match="no calibration text"):
        write_calibration(tok, [""], 20, tmp_path / "none.safetensors")


def test_progress_and_judgement_of_converter_output(tmp_path: Path) -> None:
    line = " -- Quantized: model.layers.3.self_attn.q_proj          bpw: 4.00  rfn: 0.012345  [3.51 s]"
    assert layer_progress(line, 30) == pytest.approx(4 / 30)
    assert layer_progress(" -- Quantized: model.embed_tokens  bpw: 8", 30) is None
    assert layer_progress(" -- Captured: model.layers.3", 30) is None
    assert (
        converted_ok(tmp_path, " -- All done\n") == f"the converter wrote no config.json / *.safetensors to {tmp_path}"
    )
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert converted_ok(tmp_path, " -- All done\n") is None
    assert "before 'All done'" in str(converted_ok(tmp_path, " -- Quantized: x\n"))
    assert "Error: bad bits" in str(converted_ok(tmp_path, " !! Error: bad bits\n -- All done\n"))


STAND_IN = """
import argparse, json, pathlib, sys
ap = argparse.ArgumentParser()
for flag in ("-i", "-o", "-w", "-b", "-hb", "-cb", "-cd", "-cr", "-cc", "-d", "--out_scales"):
    ap.add_argument(flag)
ap.add_argument("-sh", action="store_true")
args = ap.parse_args()
out = pathlib.Path(args.o)
if args.b == "9":
    print(" !! Error: bits out of range")
    sys.exit(0)  # exllamav3's converter exits 0 on some bad arguments
for i in range(2):
    print(f" -- Quantized: model.layers.{i}.mlp.down_proj  bpw: {args.b}", flush=True)
out.mkdir(parents=True)
(out / "config.json").write_text(json.dumps({"argv": sys.argv[1:]}))
(out / "model.safetensors").write_bytes(b"")
print(" -- All done")
"""


def test_worker_relays_progress_and_judges_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "stand_in_convert.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    j = job(tmp_path / "src", tmp_path / "q" / "model", _spec(), tmp_path / "cal", 2)
    j["module"] = "stand_in_convert"
    seen: list[tuple[str, float]] = []
    result = run_worker(
        "anyquant_exl3.exllamav3_convert", j, scratch=tmp_path / "s1", progress=lambda *a: seen.append(a)
    )
    assert result == {"out": j["out"]}
    assert [f for _, f in seen] == [0.0, 0.5, 1.0]
    assert seen[1][0] == "model.layers.0.mlp.down_proj"
    argv = json.loads((tmp_path / "q" / "model" / "config.json").read_text())["argv"]
    assert argv[argv.index("-b") + 1] == "3.5"
    assert "model.layers.1.mlp.down_proj" in (tmp_path / "s1" / "worker.log").read_text()
    j.update(bits=9.0, out=str(tmp_path / "q2" / "model"))
    with pytest.raises(WorkerError, match="bits out of range"):
        run_worker("anyquant_exl3.exllamav3_convert", j, scratch=tmp_path / "s2")


@pytest.mark.parametrize(("kwargs", "message"), [({"sym": True}, "sym=True"), ({"desc_act": True}, "desc_act=True")])
def test_gptq_parameters_are_refused_not_ignored(tmp_path: Path, kwargs: dict, message: str) -> None:
    """quantize()'s GPTQ-shaped parameters mean nothing to EXL3: an error before any work, not a silent no-op."""
    dense = make_tiny_dense(tmp_path / "tiny", num_hidden_layers=1)
    with pytest.raises(QuantizeError, match=f"{message}: EXL3 has no act-order and no zero points"):
        anyquant.quantize(dense, tmp_path / "out", method="exl3", **kwargs)
    assert not (tmp_path / "out").exists()
