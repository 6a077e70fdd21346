"""One writer per destination (a lock held for the whole job, its holder named), ``overwrite`` rechecked at
commit, and an old output moved aside by a run killed mid-commit put back by the next run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from anyquant.errors import DestinationLockedError, ParameterError, QuantizeError
from anyquant_tools import _staging
from anyquant_tools._staging import _host_tag, check_destination, lock_destination, replace_dir, staging_dir

pytestmark = pytest.mark.skipif(os.name == "nt", reason="flock and process liveness are POSIX here")

HOLD = (
    "import sys\n"
    "from pathlib import Path\n"
    "from anyquant_tools._staging import lock_destination\n"
    "lock = lock_destination(Path(sys.argv[1]))\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"  # until the test closes stdin, or kills it
)


def _holder(target: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _model(root: Path, text: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(text)
    (root / "model.safetensors").write_text(text)
    return root


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    target = tmp_path / "out"
    proc = _holder(target)
    try:
        with pytest.raises(DestinationLockedError, match=rf"pid {proc.pid} on host"):
            lock_destination(target)
        with pytest.raises(DestinationLockedError, match=rf"{target}.*pid {proc.pid}"):  # before any work
            check_destination(_model(tmp_path / "src", "s"), target, False, ParameterError)
    finally:
        proc.kill()  # killed, not released: the kernel drops its flock, so its lock file is not stale
        proc.wait()
    assert (tmp_path / ".out.anyquant-lock").exists()
    with lock_destination(target):
        pass
    assert not (tmp_path / ".out.anyquant-lock").exists()


def test_export_dense_is_refused_while_another_job_writes_there(tmp_path: Path) -> None:
    import anyquant
    from anyquant.testing.tiny import make_tiny_dense

    src = make_tiny_dense(tmp_path / "src")
    out = tmp_path / "dense"
    proc = _holder(out)
    try:
        with pytest.raises(DestinationLockedError, match=rf"pid {proc.pid}"):
            anyquant.export_dense(src, out, dtype="float32")
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists()
    assert anyquant.export_dense(src, out, dtype="float32") == out
    assert not (tmp_path / ".dense.anyquant-lock").exists()


def test_the_commit_rechecks_overwrite(tmp_path: Path) -> None:
    """The destination was empty when the job was checked; another writer filled it meanwhile: with
    overwrite=False its result is kept and ours refused, not silently replaced."""
    dst = tmp_path / "out"
    new = staging_dir(dst)
    (new / "config.json").write_text("ours")
    _model(dst, "theirs")
    with pytest.raises(QuantizeError, match="appeared while this job ran"):
        replace_dir(new, dst, overwrite=False, error=QuantizeError)
    assert (dst / "config.json").read_text() == "theirs"
    replace_dir(new, dst, overwrite=True, error=QuantizeError)
    assert (dst / "config.json").read_text() == "ours"


@pytest.mark.parametrize("atomic", [True, False])
def test_replace_leaves_nothing_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool) -> None:
    if not atomic:
        monkeypatch.setattr(_staging, "_exchange", lambda a, b: False)
    dst = _model(tmp_path / "out", "old")
    new = staging_dir(dst)
    (new / "config.json").write_text("new")
    replace_dir(new, dst)
    assert (dst / "config.json").read_text() == "new" and not (dst / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_run_killed_between_the_renames_has_its_old_output_put_back(tmp_path: Path) -> None:
    """The fallback commit's kill state on disk: the old output renamed aside by a process that then died,
    the destination missing. The next run's check puts it back, so overwrite=False refuses to replace it
    (it used to pass the check, and the staging cleanup deleted the old output)."""
    dst = tmp_path / "out"
    aside = _model(tmp_path / f".out.anyquant-old-{_host_tag()}-{_dead_pid()}-k1ll", "old output")
    src = _model(tmp_path / "src", "s")
    with pytest.raises(ParameterError, match="exists and is not empty"):
        check_destination(src, dst, False, ParameterError)
    assert (dst / "config.json").read_text() == "old output" and not aside.exists()
    staging_dir(dst)
    assert (dst / "model.safetensors").read_text() == "old output"


def test_an_aside_whose_replacement_landed_is_removed_and_others_kept(tmp_path: Path) -> None:
    dst = _model(tmp_path / "out", "new output")
    done = _model(tmp_path / f".out.anyquant-old-{_host_tag()}-{_dead_pid()}-done", "old")
    live = _model(tmp_path / f".out.anyquant-old-{_host_tag()}-{os.getpid()}-live", "mine")
    other = _model(tmp_path / f".out.anyquant-old-00000000-{_dead_pid()}-host", "theirs")
    staging_dir(dst)
    assert not done.exists() and live.exists() and (dst / "config.json").read_text() == "new output"
    assert other.exists() or _host_tag() == "00000000"
