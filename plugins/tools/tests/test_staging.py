"""Staging directories of quantize/export_dense: what killed runs leave is removed by the next run to the
same destination, and nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from anyquant_tools._staging import _host_tag, remove_stale, staging_dir

pytestmark = pytest.mark.skipif(os.name == "nt", reason="process liveness is not probed on Windows")


def _left_by_killed_process(target: Path) -> Path:
    """A staging directory with a file in it, made by a real process that then died without cleaning up."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from anyquant_tools._staging import staging_dir\n"
        "d = staging_dir(Path(sys.argv[1]))\n"
        "(d / 'model.safetensors').write_bytes(b'partial')\n"
        "print(d, flush=True)\n"
        "os._exit(9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, check=False)
    assert proc.returncode == 9, proc.stderr
    left = Path(proc.stdout.strip())
    assert left.is_dir() and left.parent == target.parent and left.name.startswith(f".{target.name}.anyquant-")
    return left


def test_a_killed_runs_directory_is_removed_by_the_next_run(tmp_path: Path) -> None:
    target = tmp_path / "out"
    left = _left_by_killed_process(target)
    fresh = staging_dir(target)
    assert not left.exists()
    assert fresh.is_dir() and not any(fresh.iterdir())
    assert fresh.name.startswith(f".out.anyquant-{_host_tag()}-{os.getpid()}-")


def test_live_foreign_unknown_and_other_targets_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "out"
    dead = _left_by_killed_process(target)
    dead_pid = int(dead.name.split("-")[2])
    kept = [
        tmp_path / f".out.anyquant-{_host_tag()}-{os.getpid()}-live",  # this process: running
        tmp_path / f".out.anyquant-{_host_tag()}-1-init",  # pid 1 exists
        tmp_path / f".out.anyquant-00000000-{dead_pid}-otherhost",  # another host's pid
        tmp_path / ".out.anyquant-abcd1234",  # no owner in the name (older anyquant, or not ours)
        tmp_path / f".other.anyquant-{_host_tag()}-{dead_pid}-x",  # another destination's
    ]
    if _host_tag() == "00000000":
        kept.pop(2)
    for d in kept:
        d.mkdir()
        (d / "f").write_text("x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("x")
    link = tmp_path / f".out.anyquant-{_host_tag()}-{dead_pid}-link"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert remove_stale(target) == [dead]
    assert not dead.exists()
    assert all((d / "f").is_file() for d in kept)
    assert link.is_symlink() and (elsewhere / "keep.txt").is_file()


def test_no_parent_yet(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out"
    assert remove_stale(target) == []
    assert staging_dir(target).parent == target.parent


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_export_dense_removes_what_a_killed_export_left(tmp_path: Path) -> None:
    """The public path: export_dense stages through staging_dir (quantize too: the GPTQ plugin's
    test_worker_failure_leaves_nothing plants the same leftover)."""
    import anyquant
    from anyquant.testing.tiny import make_tiny_dense

    src = make_tiny_dense(tmp_path / "src")
    out = tmp_path / "dense"
    left = tmp_path / f".dense.anyquant-{_host_tag()}-{_dead_pid()}-killed"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"partial")
    assert anyquant.export_dense(src, out, dtype="float32") == out
    assert not left.exists()
    assert anyquant.detect(out).format == "dense"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def _user_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fn", ["export_dense", "quantize"])
def test_destinations_that_would_lose_data_are_refused_first(tmp_path: Path, fn: str) -> None:
    """From a hostile-input audit: export_dense(S, S, overwrite=True) replaced the source, and export_dense or
    quantize to S's parent with overwrite=True deleted the source and its siblings; overwrite=True emptied any
    directory. Each is now refused before any work, and every file is still there."""
    import anyquant
    from anyquant.errors import AnyquantError
    from anyquant.testing.tiny import make_tiny_dense

    parent = tmp_path / "work"
    src = make_tiny_dense(parent / "src")
    (src / "MY_NOTES.txt").write_text("keep")
    (parent / "thesis.tex").write_text("keep")
    user = tmp_path / "userdata"
    user.mkdir()
    (user / "thesis.tex").write_text("keep")
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    a_file = tmp_path / "file.safetensors"
    a_file.write_bytes(b"x")
    before = _user_files(tmp_path)

    def run(dst: Path) -> None:
        if fn == "export_dense":
            anyquant.export_dense(src, dst, overwrite=True)
        else:
            anyquant.quantize(src, dst, method="gptq", overwrite=True, calibration=["x " * 64] * 4)

    cases = {
        src: "the source",
        src / "out": "the source",
        parent: "inside the",
        user: "not a model's files",
        link: "symbolic link",
        a_file: "is a file",
        a_file / "sub": "is a file, not a directory",
    }
    for dst, why in cases.items():
        with pytest.raises(AnyquantError, match=why):
            run(dst)
    assert _user_files(tmp_path) == before


def test_overwrite_replaces_a_previous_model_output(tmp_path: Path) -> None:
    import anyquant
    from anyquant.testing.tiny import make_tiny_dense

    src = make_tiny_dense(tmp_path / "src")
    out = anyquant.export_dense(src, tmp_path / "out", dtype="float32")
    (out / ".cache").mkdir()  # what hf download --local-dir leaves: still a model directory
    for name in ("LICENSE", ".gitattributes", "quant_log.csv", "README.md"):  # a hub upload's, GPTQModel's log
        (out / name).write_text("x")
    assert anyquant.export_dense(src, out, dtype="float32", overwrite=True) == out
    assert anyquant.detect(out).format == "dense"


def test_tokenizer_files_follow_the_probes_rules(tmp_path: Path) -> None:
    """A tokenizer file (or chat template) linking outside the model directory is an UnsafePathError like a
    config's (chat_template.jinja -> /etc/hostname was read as the template); a huge one is refused unparsed."""
    import anyquant
    from anyquant.testing.tiny import make_tiny_dense

    root = make_tiny_dense(tmp_path / "m")
    outside = tmp_path / "elsewhere.jinja"
    outside.write_text("{{ messages }}")
    (root / "chat_template.jinja").unlink(missing_ok=True)
    (root / "chat_template.jinja").symlink_to(outside)
    with pytest.raises(anyquant.UnsafePathError, match=r"chat_template\.jinja"):
        anyquant.detect(root)
    (root / "chat_template.jinja").unlink()
    with open(root / "tokenizer.json", "r+b") as fh:  # sparse: 300 MiB on paper, nothing on disk
        fh.truncate(300 << 20)
    with pytest.raises(anyquant.CheckpointError, match="over the 256 MiB"):
        anyquant.load(root)


@pytest.mark.parametrize(
    ("fixture", "suffix", "dtype"),
    [("gptq_v1", "scales", "I16"), ("awq_gemm", "scales", "I16"), ("exl3_mul1", "suh", "I16")],
)
def test_integer_scales_are_refused(tmp_path: Path, fixture: str, suffix: str, dtype: str) -> None:
    """From a hostile-input audit: int16 scales loaded as if float (GPTQ q_proj max |w| 32768 instead of 5)."""
    import anyquant
    from anyquant.testing.fixtures import FIXTURES, write_safetensors

    root = FIXTURES[fixture].build(tmp_path / "m")
    probe = anyquant.Probe.open(root)
    tensors = {n: (dtype if n.endswith("." + suffix) else t.dtype, list(t.shape)) for n, t in probe.tensors.items()}
    for f in root.glob("*.safetensors"):
        f.unlink()
    write_safetensors(root / "model.safetensors", tensors, {"format": "pt"})
    with pytest.raises(anyquant.CheckpointError, match=rf"wrong dtypes: .*\.{suffix} is {dtype}"):
        anyquant.load(root)


def test_written_files_follow_the_umask(tmp_path: Path) -> None:
    """Issue #27 item 11: export_dense's model.safetensors was 0600 (save_pretrained writes it through a
    temporary file) while its siblings were 0644; every written file and directory now follows the umask."""
    import os
    import stat

    import anyquant
    from anyquant.testing.tiny import make_tiny_dense

    src = make_tiny_dense(tmp_path / "src")
    old = os.umask(0o022)
    try:
        outs = [
            anyquant.export_dense(src, tmp_path / "dense", dtype="float32"),
            anyquant.quantize(src, tmp_path / "gptq", method="gptq", bits=4, group_size=32, quality=False),
        ]
    finally:
        os.umask(old)
    for out in outs:
        assert stat.S_IMODE(out.stat().st_mode) == 0o755
        modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir() if p.is_file()}
        assert "model.safetensors" in modes
        assert set(modes.values()) == {"0o644"}, modes
