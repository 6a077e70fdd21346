"""Links leaving the model directory: refused by default, followed to regular files when asked
(allow_symlinks=True, --allow-symlinks, ANYQUANT_ALLOW_SYMLINKS=1), never to a device, fifo or directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import anyquant
from anyquant.cli import main
from anyquant.errors import UnsafePathError

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symlinks")


@pytest.fixture
def linked_gguf(tmp_path: Path) -> Path:
    """The bundled model's .gguf, linked from another directory (a shared /data/models tree)."""
    try:
        gguf = anyquant.default_model()
    except Exception as exc:  # the demo extra is optional
        pytest.skip(f"no bundled model: {exc}")
    link = tmp_path / "mine" / "model.gguf"
    link.parent.mkdir()
    link.symlink_to(gguf)
    return link


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANYQUANT_ALLOW_SYMLINKS", raising=False)


def test_refused_by_default_with_the_way_out_named(linked_gguf: Path, no_env: None) -> None:
    with pytest.raises(UnsafePathError, match=r"allow_symlinks=True.*--allow-symlinks.*ANYQUANT_ALLOW_SYMLINKS=1"):
        anyquant.detect(linked_gguf)
    with pytest.raises(UnsafePathError):
        anyquant.inspect(linked_gguf)


def test_followed_when_asked(linked_gguf: Path, no_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert anyquant.detect(linked_gguf, allow_symlinks=True).format == "gguf"
    assert anyquant.inspect(linked_gguf, allow_symlinks=True).detection.format == "gguf"
    assert anyquant.detect(linked_gguf.parent, allow_symlinks=True).format == "gguf"
    monkeypatch.setenv("ANYQUANT_ALLOW_SYMLINKS", "1")
    assert anyquant.detect(linked_gguf).format == "gguf"
    with pytest.raises(UnsafePathError):  # an explicit False wins over the environment
        anyquant.detect(linked_gguf, allow_symlinks=False)


def test_cli_flag_before_or_after_the_command(linked_gguf: Path, no_env: None) -> None:
    assert main(["detect", str(linked_gguf)]) == 2
    assert main(["detect", str(linked_gguf), "--allow-symlinks"]) == 0
    os.environ.pop("ANYQUANT_ALLOW_SYMLINKS", None)  # main sets it for its own process
    assert main(["--allow-symlinks", "detect", str(linked_gguf)]) == 0
    os.environ.pop("ANYQUANT_ALLOW_SYMLINKS", None)


def test_never_to_a_device_fifo_or_directory(tmp_path: Path, no_env: None) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "fifo")
    for name, target in [
        ("config.json", Path("/dev/zero")),
        ("config.json", outside / "fifo"),
        ("model.gguf", outside),
    ]:
        model = tmp_path / f"m-{target.name}"
        model.mkdir()
        (model / name).symlink_to(target)
        # never opened (a fifo would block, a device stream for ever): refused, or not taken for a file
        with pytest.raises(
            (UnsafePathError, anyquant.errors.UnknownFormatError), match=r"not a regular file|no config"
        ):
            anyquant.detect(model, allow_symlinks=True)


def test_the_files_followed_are_still_checked(tmp_path: Path, no_env: None) -> None:
    """A followed link's content gets the same checks as a file's: a huge or malformed config is refused."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("[1, 2")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(anyquant.errors.ConfigError, match=r"config\.json"):
        anyquant.detect(model, allow_symlinks=True)
