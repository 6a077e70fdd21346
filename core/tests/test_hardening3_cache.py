"""Issue #44: item 5 (b), the Hugging Face cache's own structure (``snapshots/``, a snapshot, a folder in it,
``refs/``, a ref) under the symlink policy files have: a link leaving the cached repository's folder is an
``UnsafePathError`` unless links are allowed (``allow_symlinks=True``, ``ANYQUANT_ALLOW_SYMLINKS=1``), while
huggingface_hub's own layout (a snapshot's files linked into ``blobs/``) and a ``models--…`` folder moved and
linked as one keep working; item 10, a download when the Hub cannot be reached (a refused connection, a DNS
failure) falls back to a complete copy in the cache, with a notice, and never suggests resuming. No network:
a cache built on disk, and test_hub.py's fake Hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from anyquant import detect
from anyquant.errors import DownloadError, UnsafePathError
from anyquant.testing import fixtures

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symlinks")

SHA = hashlib.sha1(b"tiny").hexdigest()


def _cache_repo(cache: Path, repo_id: str, checkpoint: Path, sha: str = SHA, under: str = "") -> Path:
    """``checkpoint``'s files in a Hugging Face cache as huggingface_hub lays them out: bytes in ``blobs/``,
    the snapshot's files relative links to them, ``refs/main`` naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for f in sorted(checkpoint.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / sha / under / f.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return repo


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "ANYQUANT_ALLOW_SYMLINKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixtures.gptq_v1(tmp_path_factory.mktemp("ckpt") / "gptq")


def _copy_out(path: Path, where: Path, checkpoint: Path) -> None:
    """``path`` (a snapshot or a folder in one) replaced by a link to a copy of ``checkpoint`` at ``where``,
    outside the cache: a real checkpoint, so that only the link is wrong."""
    shutil.copytree(checkpoint, where)
    shutil.rmtree(path)
    path.symlink_to(where, target_is_directory=True)


def _move_out(path: Path, where: Path) -> Path:
    """``path`` moved to ``where`` (outside the cache), a link left in its place."""
    where.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(path), where)
    path.symlink_to(where, target_is_directory=where.is_dir())
    return where


# --------------------------------------------------------------------- item 5 (b): the cache's own structure


def test_huggingface_hubs_own_layout_loads(cache: Path, checkpoint: Path) -> None:
    _cache_repo(cache, "org/tiny", checkpoint)
    assert detect("org/tiny").format == "gptq"
    assert detect(f"org/tiny@{SHA[:8]}").format == "gptq"
    assert detect(cache / "models--org--tiny").format == "gptq"


def test_a_snapshot_linked_out_of_the_cache_is_refused(cache: Path, checkpoint: Path, tmp_path: Path) -> None:
    repo = _cache_repo(cache, "org/tiny", checkpoint)
    _copy_out(repo / "snapshots" / SHA, tmp_path / "outside" / "snap", checkpoint)
    for call in (
        lambda: detect("org/tiny"),
        lambda: detect(f"org/tiny@{SHA}"),
        lambda: detect(f"org/tiny@{SHA[:8]}"),
        lambda: detect(repo),
        lambda: detect(repo / "snapshots" / SHA),
    ):
        with pytest.raises(UnsafePathError, match=rf"snapshots/{SHA}.*outside.*allow_symlinks=True"):
            call()
    # the opt-in links have for files: the snapshot is followed
    assert detect("org/tiny", allow_symlinks=True).format == "gptq"


def test_the_opt_in_from_the_environment(
    cache: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = _cache_repo(cache, "org/tiny", checkpoint)
    _copy_out(repo / "snapshots" / SHA, tmp_path / "outside" / SHA, checkpoint)
    with pytest.raises(UnsafePathError):
        detect("org/tiny")
    monkeypatch.setenv("ANYQUANT_ALLOW_SYMLINKS", "1")
    assert detect("org/tiny").format == "gptq"
    with pytest.raises(UnsafePathError):  # an explicit False wins over the environment
        detect("org/tiny", allow_symlinks=False)


def test_a_folder_in_a_snapshot_linked_out_is_refused(cache: Path, checkpoint: Path, tmp_path: Path) -> None:
    repo = _cache_repo(cache, "org/tiny", checkpoint, under="sub")
    assert detect("org/tiny/sub").format == "gptq"
    _copy_out(repo / "snapshots" / SHA / "sub", tmp_path / "outside" / "sub", checkpoint)
    with pytest.raises(UnsafePathError, match=rf"snapshots/{SHA}/sub.*outside"):
        detect("org/tiny/sub")
    with pytest.raises(UnsafePathError):
        detect("org/tiny/sub/model.safetensors")
    with pytest.raises(UnsafePathError):
        detect(repo / "snapshots" / SHA / "sub")
    assert detect("org/tiny/sub", allow_symlinks=True).format == "gptq"


def test_snapshots_or_refs_linked_out_are_refused(cache: Path, checkpoint: Path, tmp_path: Path) -> None:
    repo = _cache_repo(cache, "org/tiny", checkpoint)
    _move_out(repo / "snapshots", tmp_path / "outside" / "snapshots")
    with pytest.raises(UnsafePathError, match=r"snapshots.*outside"):
        detect("org/tiny")
    shutil.rmtree(cache)
    repo = _cache_repo(cache, "org/tiny", checkpoint)
    _move_out(repo / "refs", tmp_path / "outside" / "refs")
    with pytest.raises(UnsafePathError, match=r"refs.*outside"):
        detect("org/tiny")
    with pytest.raises(UnsafePathError, match=r"refs.*outside"):
        detect("org/tiny@main")


def test_a_ref_linked_out_of_the_cache_is_not_read(cache: Path, checkpoint: Path, tmp_path: Path) -> None:
    repo = _cache_repo(cache, "org/tiny", checkpoint)
    outside = tmp_path / "outside" / "main"
    _move_out(repo / "refs" / "main", outside)  # names the right commit: only the link is wrong
    for call in (lambda: detect("org/tiny"), lambda: detect("org/tiny@main")):
        with pytest.raises(UnsafePathError, match=r"refs/main.*outside.*allow_symlinks=True"):
            call()
    assert detect("org/tiny", allow_symlinks=True).format == "gptq"
    # with the opt-in, still never a device or a directory
    (repo / "refs" / "main").unlink()
    (repo / "refs" / "main").symlink_to("/dev/zero")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        detect("org/tiny", allow_symlinks=True)


def test_a_link_inside_the_repository_folder_is_kept(cache: Path, checkpoint: Path) -> None:
    """A ref linking to another ref, a branch's snapshot linking to another snapshot of the same repository:
    links that stay in the ``models--…`` folder are the cache's own business."""
    repo = _cache_repo(cache, "org/tiny", checkpoint)
    (repo / "refs" / "v1").symlink_to("main")
    other = "b" * 40
    (repo / "snapshots" / other).symlink_to(SHA, target_is_directory=True)
    assert detect("org/tiny@v1").format == "gptq"
    assert detect(f"org/tiny@{other}").format == "gptq"


def test_a_moved_repository_folder_or_cache_linked_as_one_loads(cache: Path, checkpoint: Path, tmp_path: Path) -> None:
    """The layout SECURITY.md allows: a whole ``models--owner--name`` folder (or the whole cache) moved to
    another disk and linked back as one, keeping its name."""
    repo = _cache_repo(cache, "org/tiny", checkpoint)
    _move_out(repo, tmp_path / "big-disk" / repo.name)
    assert detect("org/tiny").format == "gptq"
    assert detect(f"org/tiny@{SHA[:8]}").format == "gptq"
    assert detect(repo / "snapshots" / SHA).format == "gptq"
    _move_out(cache, tmp_path / "other-disk" / "hub")
    assert detect("org/tiny").format == "gptq"


# ------------------------------------------------------------------ item 10: the Hub cannot be reached


def _test_hub() -> ModuleType:
    """test_hub.py's fake Hub (loaded by path: the tests run with --import-mode=importlib)."""
    name = "_anyquant_test_hub_for_hardening3_cache"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_hub.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


TH = _test_hub()


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, bytes]]]:
    base = tmp_path_factory.mktemp("repos")
    main = TH._dir_files(fixtures.gptq_v1(base / "main"))
    gguf = (TH.GGUF_FIXTURES / "qwen3.Q4_K_M.gguf").read_bytes()
    return {"org/tiny": {"main": main}, "org/tiny-GGUF": {"main": {"tiny-Q4_K_M.gguf": gguf, "tiny-Q8_0.gguf": gguf}}}


@pytest.fixture
def hub(
    repos: dict[str, dict[str, dict[str, bytes]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    fake = TH.FakeHub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), TH._handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for var in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_TOKEN",
        "ANYQUANT_ALLOW_SYMLINKS",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["refused", "dns"])
def unreachable(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Takes the Hub away: a port nobody listens on, or a name that does not resolve (``getaddrinfo`` fails
    as it does without a network: no resolver is asked)."""

    def no_dns(host: Any, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def take_away() -> None:
        if request.param == "refused":
            monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
        else:
            monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.example")
            monkeypatch.setattr(socket, "getaddrinfo", no_dns)

    request.node.take_away = take_away
    return str(request.param)


def _notices(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_a_cached_model_is_served_when_the_hub_cannot_be_reached(
    hub: Any, unreachable: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    from anyquant.hub import download

    path = download("org/tiny")
    gguf = download("org/tiny-GGUF/tiny-Q4_K_M.gguf")
    request.node.take_away()
    hub.log.clear()
    with caplog.at_level(logging.WARNING, logger="anyquant"):
        assert download("org/tiny") == path
        assert download("org/tiny@main") == path
        assert download("org/tiny-GGUF/tiny-Q4_K_M.gguf") == gguf
        assert download("org/tiny-GGUF", include="*Q4_K_M*") == gguf
    notice = _notices(caplog)
    assert "cannot be reached" in notice and "HF_HUB_OFFLINE=1" in notice and str(path) in notice
    assert hub.log == []


def test_no_complete_copy_says_so_and_never_suggests_resuming(
    hub: Any, unreachable: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from anyquant.hub import download

    path = download("org/tiny")
    request.node.take_away()
    with pytest.raises(DownloadError) as err:
        download("org/tiny-GGUF/tiny-Q4_K_M.gguf")  # never downloaded
    text = str(err.value)
    assert "cannot be reached" in text and "resume" not in text
    assert "`hf download org/tiny-GGUF tiny-Q4_K_M.gguf`" in text
    (path / "model.safetensors").unlink()  # the snapshot is incomplete: not served
    with pytest.raises(DownloadError) as err:
        download("org/tiny")
    text = str(err.value)
    assert "cannot be reached" in text and "model.safetensors" in text and "resume" not in text


def test_cli_download_and_load_download_true_offline(
    hub: Any,
    unreachable: str,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from anyquant import load
    from anyquant.cli import main

    assert main(["download", "org/tiny-GGUF/tiny-Q4_K_M.gguf"]) == 0
    path = capsys.readouterr().out.strip()
    request.node.take_away()
    if unreachable == "refused":  # the command as a user runs it: the notice on its stderr
        done = subprocess.run(
            [sys.executable, "-m", "anyquant.cli", "download", "org/tiny-GGUF/tiny-Q4_K_M.gguf"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ),
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == path
        assert "cannot be reached" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr
        assert "resume" not in done.stderr
    with caplog.at_level(logging.WARNING, logger="anyquant"):
        assert main(["download", "org/tiny-GGUF/tiny-Q4_K_M.gguf"]) == 0
    assert capsys.readouterr().out.strip() == path
    notice = _notices(caplog)
    assert "cannot be reached" in notice and "HF_HUB_OFFLINE=1" in notice and "resume" not in notice
    with load("org/tiny-GGUF/tiny-Q4_K_M.gguf", download=True) as model:
        assert model.format == "gguf"
    assert main(["download", "org/tiny"]) == 2  # not in the cache
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "resume" not in err


def test_an_interrupted_transfer_still_says_it_resumes(hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a connection error: the Hub answered, then the transfer broke."""
    from huggingface_hub import constants

    from anyquant.hub import download

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    hub.drop.add("tiny-Q4_K_M.gguf")
    hub.down_after_drop = True
    with pytest.raises(DownloadError, match=r"the download failed.*a partial file resumes"):
        download("org/tiny-GGUF/tiny-Q4_K_M.gguf")
