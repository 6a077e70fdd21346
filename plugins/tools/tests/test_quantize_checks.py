"""quantize(), export_dense() and perplexity(): arguments refused before any work, destinations replaced
without a window that loses both, and workers that do not outlive their parent. From an audit of the
quantize and evaluate APIs; every case here used to run (for seconds to minutes) before failing, or
silently did something else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import anyquant
from anyquant.testing.tiny import make_tiny_dense
from anyquant_tools._staging import check_destination, replace_dir, staging_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dense(tmp_path_factory.mktemp("q") / "tiny")


def _refused(tiny: Path, dst: Path, message: str, **kw: Any) -> None:
    kw = {"method": "gptq", **kw}
    t0 = time.monotonic()
    with pytest.raises(anyquant.QuantizeError, match=message):
        anyquant.quantize(tiny, dst, **kw)
    assert time.monotonic() - t0 < 20  # before any quantizer ran (GPTQModel's import alone takes longer)
    assert not dst.exists() and not [p for p in dst.parent.iterdir() if ".anyquant-" in p.name]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"max_ppl_ratio": "3"}, r"max_ppl_ratio='3': expected a finite number >= 1"),
        ({"max_ppl_ratio": 0}, "max_ppl_ratio=0"),
        ({"max_ppl_ratio": float("nan")}, "max_ppl_ratio=nan"),
        ({"sym": "no"}, r"sym='no': expected True, False or None"),  # bool("no") is True: it ran symmetric
        ({"desc_act": "false"}, "desc_act='false'"),
        ({"group_size": 4.5}, "group_size=4.5: expected an integer"),
        ({"group_size": "128"}, "group_size='128'"),
        ({"bits": "4"}, "bits='4': expected a number"),
        ({"calibration_samples": 0}, "calibration_samples=0"),
        ({"calibration_samples": 2.5}, "calibration_samples=2.5"),
        ({"calibration_seq_len": 1}, "calibration_seq_len=1"),
        ({"calibration": ""}, "calibration='' names no source"),
        ({"calibration": "nonexistent"}, "unknown calibration source 'nonexistent'"),
        ({"calibration": "c4:1e308,code:1e308"}, "add up to infinity"),
        ({"calibration": []}, "non-empty list of texts"),
        ({"method": "exl3", "group_size": 64}, "exl3 has no groups"),  # was ignored
        ({"method": "exl3", "ldlq": False, "calibration": "nonexistent"}, "unknown calibration source"),
        ({"method": "awq", "zero_point": "false"}, r"zero_point='false': expected True or False"),
        ({"method": "awq", "n_grid": 0}, "n_grid=0"),
        ({"method": "awq", "dtype": "bfloat16"}, "writes float16 scales"),  # was dropped
        ({"dtype": "foo"}, "dtype='foo'"),  # GPTQ: failed in the worker, after gptqmodel's import
        ({"batch_size": 0}, "batch_size=0"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(tiny: Path, tmp_path: Path, kw: dict, message: str) -> None:
    _refused(tiny, tmp_path / "out", message, **kw)


def test_sources_quantize_cannot_use_are_refused_first(tiny: Path, tmp_path: Path) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    for f in bare.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            f.unlink()
    _refused(bare, tmp_path / "a", "no tokenizer files")  # GPTQ: a WorkerError ~7 s in; EXL3: after encoding
    (weights,) = tiny.glob("*.safetensors")
    _refused(weights, tmp_path / "b", "needs a model directory")  # GPTQ/AWQ failed late, EXL3 went ahead


def test_a_calibration_file_as_a_path_object(tiny: Path, tmp_path: Path) -> None:
    """calibration=Path(file) was a bare TypeError ('PosixPath' object is not iterable)."""
    text = tmp_path / "cal.txt"
    text.write_bytes(b"\xff\xfe not UTF-8")
    with pytest.raises(anyquant.AnyquantError, match="not UTF-8 text"):
        anyquant.quantize(tiny, tmp_path / "out", method="exl3", calibration=text, quality=False, ldlq=True)


def test_overwrite_replaces_only_a_model_directory(tiny: Path, tmp_path: Path) -> None:
    """A project folder (main.py, notes.txt, README.md, LICENSE, .env) passed the file-name test and was
    deleted by overwrite=True."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("main.py", "notes.txt", "README.md", "LICENSE", ".env", "data.csv"):
        (project / name).write_text("mine")
    with pytest.raises(anyquant.QuantizeError, match="does not look like a model directory"):
        check_destination(tiny, project, True, anyquant.QuantizeError)
    assert sorted(p.name for p in project.iterdir()) == sorted(
        ["main.py", "notes.txt", "README.md", "LICENSE", ".env", "data.csv"]
    )
    (project / "config.json").write_text("{}")
    check_destination(tiny, project, True, anyquant.QuantizeError)  # now it is a model's directory


def test_replacing_a_directory_never_loses_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old output was deleted before the new one was renamed in: a failed rename (a full disk) or a
    Ctrl-C during the deletion left nothing."""
    dst, new = tmp_path / "dst", tmp_path / "new"
    dst.mkdir()
    (dst / "config.json").write_text("old")
    new.mkdir()
    (new / "config.json").write_text("new")
    real = os.replace
    calls = []

    def failing(a: Any, b: Any) -> None:
        calls.append((Path(a).name, Path(b).name))
        if Path(a) == new:
            raise OSError(28, "No space left on device")
        real(a, b)

    from anyquant_tools import _staging

    monkeypatch.setattr(_staging, "_exchange", lambda a, b: False)  # the two-rename fallback (no renameat2)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="No space"):
        replace_dir(new, dst)
    monkeypatch.setattr(os, "replace", real)
    assert (dst / "config.json").read_text() == "old" and (new / "config.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir() if ".anyquant-" in p.name] == []
    replace_dir(new, dst)
    assert (dst / "config.json").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_a_long_destination_name_stages_under_the_name_limit(tmp_path: Path) -> None:
    """A valid 235-character name gave a raw OSError (ENAMETOOLONG) from the staging directory's name."""
    dst = tmp_path / ("x" * 235)
    staged = staging_dir(dst)
    assert staged.is_dir() and len(os.fsencode(staged.name)) < 255
    staged.rmdir()


def test_export_output_has_the_usual_mode(tiny: Path, tmp_path: Path) -> None:
    """export_dense's output kept mkdtemp's 0700."""
    out = anyquant.export_dense(tiny, tmp_path / "dense")
    mask = os.umask(0o022)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask


def test_workers_exit_with_their_parent(tmp_path: Path) -> None:
    """A quantization worker whose parent was SIGKILLed went on for its whole run (GPTQModel on SmolLM2:
    ~30 minutes of orphaned CPU)."""
    pid_file = tmp_path / "worker.pid"
    worker = (
        "import os, sys, time\n"
        "from anyquant_tools.quantize import watch_parent\n"
        "watch_parent(0.1)\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(60)",
        ]
    )
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie (exited, not reaped by its new parent) counts as gone
        with open(f"/proc/{child}/stat") as fh:
            if fh.read().split(")")[-1].split()[0] == "Z":
                break
        assert time.monotonic() < deadline, "the worker outlived its parent"
        time.sleep(0.1)


def test_perplexity_arguments(tiny: Path) -> None:
    from anyquant_tools.evaluate import EvaluationError

    model = anyquant.load(tiny)  # max_position_embeddings 512, vocabulary 259
    ids = list(range(100, 164))
    base = anyquant.perplexity(model, ids, window=32)["perplexity"]
    for bad, message in [
        ({"batch_size": 0}, "batch_size must be a positive integer"),  # was read as 1
        ({"batch_size": 2.5}, "batch_size must be"),
        ({"window": "32"}, "window must be"),
        ({"window": 1000}, "longer than this model's context"),
    ]:
        with pytest.raises(EvaluationError, match=message):
            anyquant.perplexity(model, ids, **{"window": 32, **bad})
    with pytest.raises(EvaluationError, match="token id 300 is not in this model's vocabulary"):
        anyquant.perplexity(model, [*ids[:-1], 300], window=32)  # was a bare IndexError
    with pytest.raises(EvaluationError, match="must be integers"):
        anyquant.perplexity(model, [float(i) + 0.5 for i in ids], window=32)  # was truncated
    import numpy as np

    assert anyquant.perplexity(model, np.array(ids), window=32, batch_size=np.int64(2))["perplexity"] == pytest.approx(
        base, rel=1e-6
    )


def test_compare_checks_the_plot_path_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.cli import main
    from anyquant_tools.evaluate import EvaluationError, check_png_path, plot

    (tmp_path / "file").write_text("x")
    for bad, message in [
        (tmp_path, "is a directory"),
        (tmp_path / "file" / "x.png", "is a file, not a directory"),
        (tmp_path / "x.jpg", "give a name ending in .png"),
    ]:
        with pytest.raises(EvaluationError, match=message):
            check_png_path(bad)
    t0 = time.monotonic()
    assert main(["compare", "nonexistent-model", "--png", str(tmp_path / "x.jpg"), "--json"]) == 2
    assert "EvaluationError" in capsys.readouterr().out and time.monotonic() - t0 < 10
    with pytest.raises(EvaluationError, match="no results"):
        plot([], tmp_path / "x.png")
