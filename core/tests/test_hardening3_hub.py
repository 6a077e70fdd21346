"""Issue #44, Hub revisions: item 12, ``refs/pr/N`` (the Hub's own name for a pull request's revision) is
accepted as ``org/model@refs/pr/N`` and ``revision="refs/pr/N"``, mapped to what the cache holds, with the
path checks kept; item 5 (a), every revision and commit hash anyquant passes on to, or reads back from,
huggingface_hub is checked before huggingface_hub is called with it, so a hostile endpoint's answer never
names a path in the cache. Run against test_hub.py's fake Hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

from anyquant import detect
from anyquant.errors import DownloadError, ParameterError, ProbeError, RevisionNotFoundError, UnsafePathError
from anyquant.testing import fixtures


def _test_hub() -> ModuleType:
    """test_hub.py's fake Hub (loaded by path: the tests run with --import-mode=importlib)."""
    name = "_anyquant_test_hub_for_hardening3"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_hub.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


TH = _test_hub()
PR = "refs/pr/1"


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, bytes]]]:
    base = tmp_path_factory.mktemp("repos")
    main = TH._dir_files(fixtures.gptq_v1(base / "main"))
    awq = TH._dir_files(fixtures.awq_gemm(base / "awq"))
    # org/tiny: main is GPTQ, pull request #1 (the Hub's refs/pr/1) AWQ; org/branchy has a branch named "pr/1"
    return {"org/tiny": {"main": main, PR: awq}, "org/branchy": {"main": main, "pr/1": awq}}


def _serve(fake: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), TH._handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub(
    repos: dict[str, dict[str, dict[str, bytes]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[object]:
    fake = TH.FakeHub(repos)
    for _ in _serve(fake, tmp_path, monkeypatch):
        yield fake


def _repo(tmp_path: Path, repo_id: str) -> Path:
    return tmp_path / "hf" / "hub" / ("models--" + repo_id.replace("/", "--"))


# ------------------------------------------------------------------------------ item 12: refs/pr/N


def test_refs_pr_n_downloads_and_reads_back_in_every_spelling(hub: object, tmp_path: Path) -> None:
    from anyquant.hub import download

    path = download(f"org/tiny@{PR}")
    commit = TH._commit(f"org/tiny@{PR}")
    assert path.name == commit and detect(path).format == "awq"
    # huggingface_hub keeps the ref as it was asked for, under refs/: refs/refs/pr/1
    assert (_repo(tmp_path, "org/tiny") / "refs" / "refs" / "pr" / "1").read_text() == commit
    assert detect(f"org/tiny@{PR}").format == "awq"
    assert detect("org/tiny", revision=PR).format == "awq"
    assert detect("org/tiny@pr/1").format == "awq"  # the short spelling finds the same ref
    assert detect("org/tiny", revision="pr/1").format == "awq"
    assert download("org/tiny", revision=PR) == path


def test_refs_pr_n_finds_a_cache_that_holds_the_short_name(hub: object, tmp_path: Path) -> None:
    from anyquant.hub import download

    path = download("org/branchy@pr/1")  # a cache holding refs/pr/1: what `@pr/1` always found
    assert detect("org/branchy@pr/1").format == "awq"
    assert detect(f"org/branchy@{PR}").format == "awq"
    assert detect("org/branchy", revision=PR).format == "awq"
    assert detect(path).format == "awq"


def test_refs_pr_n_offline_and_when_missing(hub: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anyquant.hub import download

    path = download(f"org/tiny@{PR}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert download(f"org/tiny@{PR}") == path
    assert download("org/tiny@pr/1") == path
    with pytest.raises(RevisionNotFoundError) as err:
        detect("org/tiny@refs/pr/2")
    assert "refs/pr/1 -> " in str(err.value) and "`hf download org/tiny --revision refs/pr/2`" in str(err.value)


def test_cli_reads_refs_pr_n(hub: object, capsys: pytest.CaptureFixture[str]) -> None:
    from anyquant.cli import main
    from anyquant.hub import download

    download(f"org/tiny@{PR}")
    assert main(["detect", f"org/tiny@{PR}", "--json"]) == 0
    assert '"awq"' in capsys.readouterr().out
    assert main(["inspect", "org/tiny", "--revision", PR, "--json"]) == 0
    assert '"awq"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "rev",
    [
        "refs/pr/../../../x",
        "refs/pr/1/..",
        "refs/pr/./1",
        "refs//pr/1",
        "/refs/pr/1",
        "refs/pr/1/",
        "refs/pr/1\0",
        "refs\\pr\\1",
        "..",
    ],
)
def test_pr_revisions_keep_the_path_checks(hub: object, rev: str) -> None:
    from anyquant.hub import download

    for call in (
        lambda: detect(f"org/tiny@{rev}"),
        lambda: detect("org/tiny", revision=rev),
        lambda: download("org/tiny", revision=rev),
    ):
        with pytest.raises((ProbeError, ParameterError), match="not a revision"):
            call()
    assert hub.log == []  # type: ignore[attr-defined]


def test_a_cache_ref_leaving_refs_through_the_pr_alias_is_not_followed(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The alias adds a name under the cache's ``refs/``, never a way out of it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "cache" / "models--org--tiny"
    commit = hashlib.sha1(b"x").hexdigest()
    fixtures.gptq_v1(repo / "snapshots" / commit)
    outside = tmp_path / "outside"
    outside.write_text(commit)
    (repo / "refs" / "refs" / "pr").mkdir(parents=True)
    (repo / "refs" / "refs" / "pr" / "1").symlink_to(outside)
    # a ref linked out of the cached repository is refused as a file would be (item 5 (b)), never read
    with pytest.raises(UnsafePathError, match="outside the Hugging Face cache"):
        detect("org/tiny@pr/1")
    with pytest.raises(UnsafePathError, match="outside the Hugging Face cache"):
        detect(f"org/tiny@{PR}")


# ------------------------------------------------------------- item 5 (a): revisions and commit hashes


class _HostileHub(TH.FakeHub):  # type: ignore[misc,name-defined]
    """Answers commit ``sha`` for the branch asked for, after ``honest`` honest answers, and serves the
    files under that name too (its tree listing included), as an endpoint that means harm would."""

    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]], sha: str, honest: int = 0) -> None:
        super().__init__(repos)
        self.sha, self.honest = sha, honest

    def commit(self, repo: str, rev: str) -> str | None:
        if rev == self.sha:
            return self.sha
        honest: str | None = super().commit(repo, rev)
        if rev not in self.repos.get(repo, {}):  # asked by commit: the honest answer
            return honest
        if self.honest > 0:  # asked by branch
            self.honest -= 1
            return honest
        return self.sha

    def files(self, repo: str, rev: str) -> dict[str, bytes]:
        return dict(self.repos[repo]["main"])


def _outside_writes(tmp_path: Path) -> list[str]:
    """Files written under ``tmp_path`` but outside the Hugging Face cache ``hf/hub``."""
    cache = tmp_path / "hf" / "hub"
    return sorted(
        p.relative_to(tmp_path).as_posix()
        for p in tmp_path.rglob("*")
        if (p.is_file() or p.is_symlink()) and cache not in p.parents and p.name != "outside"
    )


HOSTILE_SHAS = [
    "../../../victim",
    "../victim",
    "<tmp_path>/victim",  # absolute: under the test's own directory, outside the cache
    "a" * 40 + "/../../../victim",
    "A" * 40,  # not what huggingface_hub's cache calls a commit (it would keep it as a branch)
    "a" * 39,
    "a" * 41,
    "",
]


@pytest.mark.parametrize("sha", HOSTILE_SHAS)
@pytest.mark.parametrize("honest", [0, 1], ids=["first answer", "second answer"])
def test_a_commit_hash_read_back_from_the_hub_is_checked_before_use(
    repos: dict[str, dict[str, dict[str, bytes]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sha: str,
    honest: int,
) -> None:
    """The endpoint answers ``sha`` as the commit of ``main``, at once or on the second question (after
    anyquant has checked the first answer): nothing outside the cache is written, the answer is refused
    or never asked for again, and only a checked commit is handed to huggingface_hub."""
    from anyquant.hub import download

    sha = sha.replace("<tmp_path>", str(tmp_path))
    fake = _HostileHub(repos, sha, honest)
    for _ in _serve(fake, tmp_path, monkeypatch):
        if honest:
            # the first (honest) answer is used for the whole download: the commit is pinned
            path = download("org/tiny")
            assert path.name == TH._commit("org/tiny@main") and detect(path).format == "gptq"
            assert detect("org/tiny").format == "gptq"  # refs/main written, as huggingface_hub would
            infos = [rev for m, _, rev, f, _ in fake.log if not f]
            assert infos[0] == "main" and all(rev == path.name for rev in infos[1:])
        else:
            with pytest.raises(DownloadError, match="not a commit hash"):
                download("org/tiny")
            assert [(m, rev) for m, _, rev, f, _ in fake.log] == [("GET", "main")]  # nothing asked after the answer
        assert _outside_writes(tmp_path) == []


@pytest.mark.parametrize(
    "rev",
    ["main:x", "a b", "main\n", "x\x7f", "-x", "a.lock", "v1.", "@", "a@{1}", "~1", "a^", "a?", "a*", "a[0]", ".x"],
)
def test_a_revision_the_hub_cannot_hold_is_refused_before_huggingface_hub_is_called(
    hub: object, tmp_path: Path, rev: str
) -> None:
    from anyquant.hub import download

    with pytest.raises(ProbeError, match="not a revision"):
        download("org/tiny", revision=rev)
    # in an id, "@" parts the revision from the name: "org/tiny@a@{1}" is no model id at all
    with pytest.raises((ProbeError, ParameterError), match=r"not a revision|not a Hugging Face model id"):
        download(f"org/tiny@{rev}")
    assert hub.log == []  # type: ignore[attr-defined]
    assert not (tmp_path / "hf" / "hub").exists()


def test_download_does_not_write_through_a_linked_ref(hub: object, tmp_path: Path) -> None:
    """A ``refs/main`` that is a link out of the cache is replaced by the ref, never written through."""
    from anyquant.hub import download

    outside = tmp_path / "outside"
    outside.write_text("precious")
    refs = _repo(tmp_path, "org/tiny") / "refs"
    refs.mkdir(parents=True)
    (refs / "main").symlink_to(outside)
    path = download("org/tiny")
    assert outside.read_text() == "precious"
    assert not (refs / "main").is_symlink() and (refs / "main").read_text() == path.name
    assert detect("org/tiny").format == "gptq"
