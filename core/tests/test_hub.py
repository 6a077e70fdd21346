"""Models from the Hugging Face Hub: revisions in the local cache, and the opt-in download through
huggingface_hub, run against a fake Hub on 127.0.0.1 (``HF_ENDPOINT``) serving the routes this
huggingface_hub version uses: model info, the tree listing and ``resolve`` with ETag, X-Repo-Commit,
Content-Length and Range."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from anyquant import Probe, detect
from anyquant.errors import DownloadError, ProbeError, RevisionNotFoundError
from anyquant.testing import fixtures

GGUF_FIXTURES = Path(__file__).resolve().parents[2] / "plugins" / "gguf" / "tests" / "fixtures"


def _commit(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


class FakeHub:
    """Repositories ``{repo_id: {revision: {file: bytes}}}``; every request is logged as
    ``(method, repo, revision, file, range)``."""

    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]) -> None:
        self.repos = repos
        self.log: list[tuple[str, str, str, str, str | None]] = []
        self.drop: set[str] = set()  # files whose next GET sends half and drops the connection
        self.down: set[str] = set()  # files whose GET answers 500
        self.down_after_drop = False  # a drop takes the Hub away: the file's GETs answer 500 from then on

    def commit(self, repo: str, rev: str) -> str | None:
        revs = self.repos.get(repo, {})
        if rev in revs:
            return _commit(repo + "@" + rev)
        return next((_commit(repo + "@" + r) for r in revs if _commit(repo + "@" + r) == rev), None)

    def files(self, repo: str, rev: str) -> dict[str, bytes]:
        commit = self.commit(repo, rev)
        return next(f for r, f in self.repos[repo].items() if _commit(repo + "@" + r) == commit)

    def resolve_gets(self) -> list[str]:
        return [f"{r}@{rev}/{f}" for m, r, rev, f, _ in self.log if m == "GET" and f]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, value: Any) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        def _missing(self, code: int = 404) -> None:
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.send_header("X-Error-Code", "RevisionNotFound" if code == 404 else "")
            self.end_headers()

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            parts = [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]
            if parts[:2] == ["api", "models"]:
                repo = "/".join(parts[2:4])
                rev = parts[5] if len(parts) > 5 else "main"
                commit = hub.commit(repo, rev)
                hub.log.append((self.command, repo, rev, "", None))
                if commit is None:
                    return self._missing()
                names = sorted(hub.files(repo, rev))
                if len(parts) > 4 and parts[4] == "tree":
                    data = hub.files(repo, rev)
                    tree = [
                        {"type": "file", "path": n, "size": len(data[n]), "oid": hashlib.sha1(data[n]).hexdigest()}
                        for n in names
                    ]
                    return self._json(tree)
                return self._json({"id": repo, "sha": commit, "siblings": [{"rfilename": n} for n in names]})
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                rng = self.headers.get("Range")
                hub.log.append((self.command, repo, rev, name, rng))
                commit = hub.commit(repo, rev)
                if commit is None or name not in hub.files(repo, rev):
                    return self._missing()
                data = hub.files(repo, rev)[name]
                if self.command == "GET" and name in hub.down:
                    return self._missing(500)
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng and self.command == "GET" else 0
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if self.command == "HEAD":
                    return
                if name in hub.drop:
                    hub.drop.discard(name)
                    if hub.down_after_drop:
                        hub.down.add(name)
                    self.wfile.write(data[start : start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data[start:])
                return
            self._missing()

    return Handler


def _dir_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, bytes]]]:
    base = tmp_path_factory.mktemp("repos")
    # org/tiny: main is a GPTQ checkpoint, branch "4bit/awq" an AWQ one (detection tells which was fetched);
    # both carry a pickle copy of the weights and a modeling file that must never be fetched
    main, awq = _dir_files(fixtures.gptq_v1(base / "main")), _dir_files(fixtures.awq_gemm(base / "awq"))
    # main has a shard index, and beside its shard another copy of the weights the index does not name
    # (Mistral's consolidated.safetensors): only the index and the shard it names are fetched
    names = Probe.open(base / "main").tensors
    main["model.safetensors.index.json"] = json.dumps(
        {"weight_map": dict.fromkeys(names, "model.safetensors")}
    ).encode()
    main["consolidated.safetensors"] = main["model.safetensors"]
    for files in (main, awq):
        files["pytorch_model.bin"] = b"pickle copy of the weights"
        files["modeling_tiny.py"] = b"raise SystemExit('remote code ran')\n"
        files["README.md"] = b"# tiny\n"
    ggufs = {  # real llama.cpp outputs standing for three quantizations of one model
        "tiny-Q4_K_M.gguf": (GGUF_FIXTURES / "qwen3.Q4_K_M.gguf").read_bytes(),
        "tiny-Q5_K_M.gguf": (GGUF_FIXTURES / "phi3.Q4_K_M.gguf").read_bytes(),
        "tiny-Q8_0.gguf": (GGUF_FIXTURES / "gemma2.Q4_K_M.gguf").read_bytes(),
        "README.md": b"# tiny GGUF\n",
    }
    split = {  # two quantizations split by gguf-split, each in its folder (header-only parts: detection reads them)
        f"{q}/tiny-{q}-0000{k + 1}-of-00002.gguf": fixtures.write_gguf(
            base / "split" / q / f"tiny-{q}-0000{k + 1}-of-00002.gguf",
            {
                **({"general.architecture": "llama", "llama.block_count": 1} if k == 0 else {}),
                "split.no": k,
                "split.count": 2,
                "split.tensors.count": 2,
            },
            {f"blk.0.t{k}.weight": (0, [8, 8])},
        ).read_bytes()
        for q in ("Q4_K_M", "Q8_0")
        for k in range(2)
    }
    return {
        "org/tiny": {"main": main, "4bit/awq": awq},
        "org/tiny-GGUF": {"main": ggufs},
        "org/split-GGUF": {"main": {**split, "README.md": b"# split GGUF\n"}},
    }


@pytest.fixture
def hub(
    repos: dict[str, dict[str, dict[str, bytes]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeHub]:
    fake = FakeHub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _cached_files(tmp_path: Path, repo: str) -> set[str]:
    snaps = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots"
    return {p.relative_to(snaps).as_posix().split("/", 1)[1] for p in snaps.rglob("*") if not p.is_dir()}


def test_download_fetches_the_revision_and_only_the_files_its_format_needs(hub: FakeHub, tmp_path: Path) -> None:
    from anyquant.hub import download

    path = download("org/tiny@4bit/awq")
    assert detect(path).format == "awq"
    fetched = set(hub.resolve_gets())
    assert fetched == {
        "org/tiny@" + _commit("org/tiny@4bit/awq") + "/" + n for n in ("config.json", "model.safetensors")
    }
    assert _cached_files(tmp_path, "org/tiny") == {"config.json", "model.safetensors"}
    # the branch (with a "/") is a ref in the cache now: read without the Hub
    assert detect("org/tiny@4bit/awq").format == "awq"
    assert detect("org/tiny", revision="4bit/awq").format == "awq"
    with pytest.raises(ProbeError, match="not in the Hugging Face cache"):
        detect("org/tiny")  # main was not downloaded

    hub.log.clear()
    assert download("org/tiny", revision="4bit/awq") == path
    assert hub.resolve_gets() == []  # a second call fetches nothing

    hub.log.clear()
    main = download("org/tiny")
    assert detect(main).format == "gptq"
    needed = ("config.json", "model.safetensors", "model.safetensors.index.json")
    assert sorted(hub.resolve_gets()) == ["org/tiny@" + _commit("org/tiny@main") + "/" + n for n in needed]
    assert detect("org/tiny").format == "gptq"  # refs/main
    assert detect("org/tiny@4bit/awq").format == "awq"
    commit = _commit("org/tiny@4bit/awq")
    assert detect(f"org/tiny@{commit}").format == "awq"
    assert detect(f"org/tiny@{commit[:8]}").format == "awq"  # a unique prefix


def test_a_revision_the_cache_lacks_is_a_typed_error_listing_what_it_holds(hub: FakeHub, tmp_path: Path) -> None:
    from anyquant.hub import download

    download("org/tiny")
    download("org/tiny@4bit/awq")
    with pytest.raises(RevisionNotFoundError) as err:
        detect("org/tiny@4.0bpw")
    text = str(err.value)
    assert "4bit/awq -> " in text and "main -> " in text and _commit("org/tiny@main") in text
    assert "`hf download org/tiny --revision 4.0bpw`" in text
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    (repo / "refs" / "main").unlink()
    with pytest.raises(RevisionNotFoundError, match=r"no refs/main and 2 snapshots.*Pick one: revision="):
        detect("org/tiny")
    with pytest.raises(ProbeError, match="revision='x' applies to a Hugging Face model id"):
        detect(tmp_path, revision="x")


def test_a_gguf_repository_downloads_one_quantization(hub: FakeHub, tmp_path: Path) -> None:
    from anyquant.hub import download

    with pytest.raises(DownloadError, match=r"3 GGUF files \(tiny-Q4_K_M.gguf, tiny-Q5_K_M.gguf, tiny-Q8_0.gguf\)"):
        download("org/tiny-GGUF")
    assert hub.resolve_gets() == []
    path = download("org/tiny-GGUF", include="*Q5_K_M*")
    assert path.name == "tiny-Q5_K_M.gguf" and detect(path).format == "gguf"
    assert _cached_files(tmp_path, "org/tiny-GGUF") == {"tiny-Q5_K_M.gguf"}
    one = download("org/tiny-GGUF/tiny-Q8_0.gguf")
    assert one.name == "tiny-Q8_0.gguf"
    assert _cached_files(tmp_path, "org/tiny-GGUF") == {"tiny-Q5_K_M.gguf", "tiny-Q8_0.gguf"}
    assert [g.split("/")[-1] for g in hub.resolve_gets()] == ["tiny-Q5_K_M.gguf", "tiny-Q8_0.gguf"]
    assert detect("org/tiny-GGUF/tiny-Q8_0.gguf").format == "gguf"
    with pytest.raises(DownloadError, match="matches no weight file"):
        download("org/tiny-GGUF", include="*Q3_K*")


def test_a_split_gguf_quantization_downloads_all_its_parts(hub: FakeHub, tmp_path: Path) -> None:
    """A quantization stored split by gguf-split (``NAME-0000K-of-0000N.gguf``): its folder, any of its parts, or
    an include pattern fetches every part (and only those); the path returned loads the model."""
    from anyquant.hub import download, select_files
    from anyquant.probe import ModelId

    parts = [f"tiny-Q4_K_M-0000{k}-of-00002.gguf" for k in (1, 2)]
    with pytest.raises(DownloadError, match="4 GGUF files"):
        download("org/split-GGUF")  # two quantizations: one must be chosen
    folder = download("org/split-GGUF/Q4_K_M")
    assert folder.name == "Q4_K_M" and detect(folder).details["parts"] == parts
    assert _cached_files(tmp_path, "org/split-GGUF") == {f"Q4_K_M/{p}" for p in parts}
    later = download("org/split-GGUF/Q8_0/tiny-Q8_0-00002-of-00002.gguf")
    assert later.name == "tiny-Q8_0-00002-of-00002.gguf"
    assert detect(later).details["parts"] == [f"tiny-Q8_0-0000{k}-of-00002.gguf" for k in (1, 2)]
    hub.log.clear()
    first = download("org/split-GGUF", include="*Q4_K_M*")
    assert first.name == parts[0] and hub.resolve_gets() == []  # already cached: the first part's path
    # the selection alone: a flat repository holding one split model, a part named by --include
    flat = ["a-00001-of-00003.gguf", "a-00002-of-00003.gguf", "a-00003-of-00003.gguf", "README.md"]
    assert select_files(flat, ModelId("o/r", "", None)) == flat[:3]
    assert select_files(flat, ModelId("o/r", "", None), "*00002*") == flat[:3]
    assert select_files(flat, ModelId("o/r", "a-00003-of-00003.gguf", None)) == flat[:3]


def test_a_dropped_connection_resumes_and_a_failed_download_leaves_nothing_complete(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    from anyquant.hub import download

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)  # a fixture of 0.8 MB is many chunks, not one

    name = "tiny-Q4_K_M.gguf"
    data = hub.repos["org/tiny-GGUF"]["main"][name]
    hub.drop.add(name)  # the connection drops half-way: huggingface_hub asks for the rest (Range) and gets it
    path = download(f"org/tiny-GGUF/{name}")
    assert path.read_bytes() == data and detect(path).format == "gguf"
    ranges = [r for m, _, _, f, r in hub.log if m == "GET" and f]
    assert len(ranges) == 2 and ranges[0] is None and ranges[1] is not None  # resumed, not restarted
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= len(data) // 2

    shutil.rmtree(tmp_path / "hf")
    hub.log.clear()
    hub.drop.add(name)
    hub.down_after_drop = True  # ... and the Hub goes away: the download fails
    with pytest.raises(DownloadError, match=r"the download failed.*`hf download org/tiny-GGUF tiny-Q4_K_M.gguf`"):
        download(f"org/tiny-GGUF/{name}")
    with pytest.raises(ProbeError, match="no such file"):
        detect(f"org/tiny-GGUF/{name}")  # nothing that detects as complete
    repo = tmp_path / "hf" / "hub" / "models--org--tiny-GGUF"
    assert [p.name for p in repo.rglob("*") if p.is_file() and "blobs" in p.parts] == []  # no partial blob
    hub.down.clear()
    assert download(f"org/tiny-GGUF/{name}").read_bytes() == data  # the retry completes it
    assert detect(f"org/tiny-GGUF/{name}").format == "gguf"


def test_offline_mode_refuses_cleanly_and_serves_the_cache(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from anyquant.hub import download

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"HF_HUB_OFFLINE is set.*`hf download org/tiny --revision 4bit/awq`"):
        download("org/tiny@4bit/awq")
    assert hub.log == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    path = download("org/tiny@4bit/awq")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.log.clear()
    assert download("org/tiny@4bit/awq") == path
    assert hub.log == []


def test_load_downloads_only_when_asked(hub: FakeHub, tmp_path: Path) -> None:
    from anyquant import load

    with pytest.raises(ProbeError, match=r"`hf download org/tiny-GGUF tiny-Q4_K_M.gguf`"):
        load("org/tiny-GGUF/tiny-Q4_K_M.gguf")
    assert hub.log == []  # the default never downloads
    with pytest.raises(DownloadError, match="3 GGUF files"):
        load("org/tiny-GGUF", download=True)
    with load("org/tiny-GGUF/tiny-Q4_K_M.gguf", download=True) as model:  # fetched, then loaded as a local file
        assert model.format == "gguf"
    assert [g.split("/")[-1] for g in hub.resolve_gets()] == ["tiny-Q4_K_M.gguf"]
    hub.log.clear()
    local = next((tmp_path / "hf" / "hub").rglob("tiny-Q4_K_M.gguf"))
    with load(local, download=True) as model:  # a local path: nothing asked of the Hub
        assert model.format == "gguf"
    assert hub.log == []


def test_cli_download(hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.cli import main

    assert main(["download", "org/tiny-GGUF", "--include", "*Q4_K_M*"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith("tiny-Q4_K_M.gguf") and os.path.isfile(out)
    assert main(["detect", "org/tiny-GGUF/tiny-Q4_K_M.gguf"]) == 0
    capsys.readouterr()
    assert main(["download", "org/tiny", "--revision", "4bit/awq", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"].endswith(_commit("org/tiny@4bit/awq"))
    assert main(["detect", "org/tiny@4bit/awq", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "awq"
    assert main(["inspect", "org/tiny", "--revision", "4bit/awq", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["detection"]["format"] == "awq"
    assert main(["detect", "org/tiny@nope"]) != 0
    assert "`hf download org/tiny --revision nope`" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "hf")
