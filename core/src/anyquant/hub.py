"""The explicit download of a model from the Hugging Face Hub (``load(..., download=True)``,
``anyquant download``), through huggingface_hub's own ``snapshot_download``: its cache layout (the cache
:func:`~anyquant.probe.hub_cache_dir` reads), its authentication (``HF_TOKEN``), its resume and locking,
its progress bars. Only the files the format needs are fetched: for a GGUF repository the one
quantization asked for, for a safetensors repository the configs, tokenizer files, the shard index and
its shards (never ``*.bin``/``*.pt``/``*.pth`` copies of the same weights, never code). huggingface_hub is
imported here only, on the first download.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from .errors import AnyquantError, DownloadError, ParameterError, ProbeError, UnsafePathError
from .headers import MAX_JSON_BYTES
from .probe import (
    CONFIG_FILES,
    INDEX_NAMES,
    TOKENIZER_FILES,
    ModelId,
    _check_cache_path,
    _hub_snapshot,
    allow_symlinks_opt,
    download_command,
    hub_cache_dir,
    parse_model_id,
    resolve_checkpoint,
)

__all__ = ["download", "offline", "select_files"]

log = logging.getLogger(__name__)

_WEIGHTS = (".safetensors", ".gguf")
_TRUE = {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, read now (huggingface_hub reads it once,
    at its import)."""
    env = os.environ
    return (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").strip().upper() in _TRUE


def download(
    model: str, *, revision: str | None = None, include: str | None = None, allow_symlinks: bool | None = None
) -> Path:
    """Fetch the files of Hub model ``model`` (``owner/name``, ``owner/name/file.gguf``, with
    ``@revision`` or ``revision=``) that its format needs into the Hugging Face cache, and return the
    path to load: the snapshot directory, or the one ``.gguf`` file chosen. ``include``: a glob over the
    repository's files choosing the weights (``"*Q4_K_M*"``); a GGUF repository with several ``.gguf``
    files and none chosen is a :class:`DownloadError` listing them; a quantization split by llama.cpp's
    gguf-split (``NAME-00001-of-00003.gguf`` ...) is one of them: naming its folder, any of its parts, or an
    ``include`` matching one fetches every part (the first part's path is returned). Files already in the
    cache are not fetched again; an interrupted file resumes. With ``HF_HUB_OFFLINE=1`` nothing is fetched: the cached
    copy is returned when it is complete (:func:`_cached`), or a :class:`DownloadError` says what is missing.
    When the Hub cannot be reached (a refused connection, a name that does not resolve: no network), the
    same: a complete cached copy is returned with a warning (as ``HF_HUB_OFFLINE=1`` would), else a
    :class:`DownloadError` that says the Hub cannot be reached. ``allow_symlinks``: the cache's own links,
    as :func:`~anyquant.probe.resolve_checkpoint` checks them."""
    mid = parse_model_id(model, revision)
    if mid is None or Path(model).expanduser().exists():
        raise ParameterError(f"{model}: not a Hugging Face model id (owner/name): only a Hub model is downloaded")
    _check_hub_revision(mid.revision, str(mid))
    if offline():
        return _cached(mid, include, allow_symlinks, "HF_HUB_OFFLINE is set, so nothing is downloaded")
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError as exc:
        from .errors import MissingDependencyError

        raise MissingDependencyError(f"downloading {mid} needs huggingface_hub: pip install 'anyquant[hub]'") from exc
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, as offline() is
    cache = hub_cache_dir()
    try:
        info = HfApi(endpoint=endpoint).model_info(mid.repo_id, revision=mid.revision)
        # the commit the Hub answered names folders in the cache (snapshots/<sha>, trees/<sha>.json):
        # checked before huggingface_hub sees it, then the whole download is pinned to it, so the
        # endpoint is never asked again (and cannot answer otherwise the second time)
        sha = _checked_commit(info.sha, mid)
        files = [s.rfilename for s in info.siblings or ()]
        chosen = select_files(files, mid, include)
        index = next((f for f in chosen if PurePosixPath(f).name in INDEX_NAMES), None)
        if index is not None:  # the shards the index names: not a consolidated.safetensors copy beside them
            from huggingface_hub import hf_hub_download

            named = _index_shards(
                hf_hub_download(mid.repo_id, index, revision=sha, cache_dir=cache, endpoint=endpoint), index
            )
            chosen = select_files(files, mid, include, index_shards=named)
        log.info("downloading %s (%s): %s", mid, sha, chosen)
        snapshot = Path(
            snapshot_download(mid.repo_id, revision=sha, allow_patterns=chosen, cache_dir=cache, endpoint=endpoint)
        )
        storage = Path(cache) / ("models--" + mid.repo_id.replace("/", "--"))
        if os.path.abspath(snapshot) != os.path.abspath(storage / "snapshots" / sha):
            raise DownloadError(f"{mid}: huggingface_hub returned {snapshot}, not the snapshot of commit {sha}")
        _keep_ref(storage, mid.revision or "main", sha, mid)
    except AnyquantError:
        raise
    except Exception as exc:  # huggingface_hub's HTTP errors (not found, gated, 5xx), a dropped connection, a full disk
        reason = _unreachable(exc)
        if reason is not None:  # no connection at all: nothing was interrupted, nothing resumes
            return _unreachable_fallback(mid, include, allow_symlinks, reason, exc)
        raise DownloadError(
            f"{mid}: the download failed: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}. Run it again "
            f"(a partial file resumes), or `{download_command(mid, include)}`"
        ) from exc
    weights = _gguf_models([f for f in chosen if f.endswith(".gguf")])
    if mid.inside:
        return snapshot / mid.inside
    return snapshot / next(iter(weights)) if len(weights) == 1 else snapshot


#: a commit hash as huggingface_hub's cache names it (its ``REGEX_COMMIT_HASH``)
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: bytes no git ref (so no Hub branch or tag) holds: controls, space, ``~^:?*[\\`` and DEL
_BAD_REF_CHARS = re.compile(r"[\x00-\x20~^:?*\[\\\x7f]")


def _check_hub_revision(revision: str | None, what: str) -> None:
    """Refuse (:class:`ProbeError`) a revision that no Hub repository can have, before huggingface_hub is
    called with it (it becomes a URL and a path in the cache, ``refs/<revision>``): beyond the path checks
    every model id has (no empty, ``.`` or ``..`` part, no ``\\``, NUL or leading ``/``), git's rules for a
    ref name (``git check-ref-format``): no control character, space or ``~^:?*[``, no ``@{``, no part
    starting with ``.`` or ending with ``.lock``, no ``.`` at the end, not ``@``, no ``-`` first."""
    if revision is None:
        return
    parts = revision.split("/")
    if (
        not revision
        or len(revision) > 255
        or _BAD_REF_CHARS.search(revision)
        or "@{" in revision
        or revision == "@"
        or revision.startswith("-")
        or revision.endswith(".")
        or any(not p or p.startswith(".") or p.endswith(".lock") for p in parts)
    ):
        raise ProbeError(f"{what}: {revision!r} is not a revision (a branch, tag or commit hash) the Hub can hold")


def _checked_commit(sha: object, mid: ModelId) -> str:
    """The commit hash the Hub answered for ``mid``, when it is one (40 lowercase hexadecimal digits)."""
    if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
        raise DownloadError(
            f"{mid}: the Hub answered {str(sha)[:100]!r} as the commit of {mid.revision or 'main'}, which is not a "
            "commit hash (40 hexadecimal digits): nothing was downloaded (is HF_ENDPOINT a Hub?)"
        )
    return sha


def _keep_ref(storage: Path, revision: str, sha: str, mid: ModelId) -> None:
    """Record in the cache that ``revision`` is commit ``sha`` (``refs/<revision>``), as huggingface_hub does
    when it resolves a branch itself: the download was pinned to ``sha``, so it did not. Written as a new
    file renamed into place (a link there is replaced, never written through); a ``refs`` folder that
    leads out of the repository's folder is refused."""
    if revision == sha:
        return
    refs = storage / "refs"
    ref = refs / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if storage.resolve() not in refs.resolve().parents or refs.resolve() not in (
        ref.parent.resolve(),
        *ref.parent.resolve().parents,
    ):
        raise DownloadError(f"{mid}: {ref.parent} leads out of the Hugging Face cache's {storage}: not written")
    if not ref.is_symlink() and ref.is_file() and ref.read_text(encoding="ascii", errors="replace") == sha:
        return
    tmp = ref.with_name(f"{ref.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(sha, encoding="ascii")
    os.replace(tmp, ref)


#: the names (in an exception's class hierarchy) of "no connection could be made" in the HTTP libraries
#: huggingface_hub has used: httpx's ``ConnectError``/``ConnectTimeout`` (a refused connection, a DNS failure, no
#: route), urllib3's ``NewConnectionError``/``NameResolutionError``, requests' ``ConnectTimeout``, and
#: huggingface_hub's ``OfflineModeIsEnabled``. A timeout or a broken transfer after connecting is not one.
_NO_CONNECTION = {"ConnectError", "ConnectTimeout", "NewConnectionError", "NameResolutionError", "OfflineModeIsEnabled"}


def _unreachable(exc: BaseException) -> str | None:
    """Why the Hub could not be reached at all (``"ConnectError: [Errno -2] Name or service not known"``), when
    ``exc`` or an exception it was raised from says so; None for any other failure (an HTTP error, a transfer
    broken half-way, a full disk)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        names = {c.__name__ for c in type(cause).__mro__}
        if isinstance(cause, (socket.gaierror, ConnectionRefusedError)) or names & _NO_CONNECTION:
            return f"{type(cause).__name__}: {' '.join(str(cause).split())[:200]}"
        cause = cause.__cause__ or cause.__context__
    return None


def _unreachable_fallback(
    mid: ModelId, include: str | None, allow_symlinks: bool | None, reason: str, exc: BaseException
) -> Path:
    """The Hub cannot be reached: the complete cached copy, with a warning, or a DownloadError."""
    why = f"the Hub cannot be reached ({reason})"
    try:
        path = _cached(mid, include, allow_symlinks, why, hint=False)
    except DownloadError as err:
        raise DownloadError(
            f"{err}. Check the network (and HF_ENDPOINT, if set) and run it again, or "
            f"`{download_command(mid, include)}` where the Hub is reachable"
        ) from exc
    log.warning(
        "%s: %s; the copy in the Hugging Face cache is complete and is used: %s (as HF_HUB_OFFLINE=1 would; set "
        "HF_HUB_OFFLINE=1 to use the cache without asking the Hub)",
        mid,
        why,
        path,
    )
    return path


def _cached(mid: ModelId, include: str | None, allow_symlinks: bool | None, why: str, *, hint: bool = True) -> Path:
    """Without the Hub (``why``: HF_HUB_OFFLINE, or the Hub cannot be reached): the cached copy when it is
    complete, the path an online download would return; else a DownloadError. Complete: every file an online
    download would fetch (:func:`select_files` over huggingface_hub's cached listing of the commit,
    ``trees/<commit>.json``; without one, over the snapshot's own files) is in the snapshot, and so is every
    shard its index names. Links in the cache: :func:`~anyquant.probe.resolve_checkpoint`'s rule, an
    :class:`~anyquant.errors.UnsafePathError` as it is."""
    how = f": unset HF_HUB_OFFLINE, or `{download_command(mid, include)}` where the Hub is reachable" if hint else ""
    try:
        path = resolve_checkpoint(str(ModelId(mid.repo_id, "", mid.revision)), allow_symlinks=allow_symlinks)
    except UnsafePathError:
        raise
    except ProbeError as exc:
        raise DownloadError(f"{mid}: {why}, and {exc}") from exc
    snapshot = _hub_snapshot(Path(os.path.abspath(path)))
    if not path.is_dir() or snapshot is None:
        raise DownloadError(f"{mid}: {why}, and the Hugging Face cache ({hub_cache_dir()}) does not hold it{how}")
    listing = _cached_listing(snapshot, allow_symlinks_opt(allow_symlinks))
    try:
        chosen = select_files(listing, mid, include)
        index = next((f for f in chosen if PurePosixPath(f).name in INDEX_NAMES), None)
        named: set[str] = set()
        if index is not None and (snapshot / index).is_file():
            shards = _index_shards(str(snapshot / index), index)
            named = {(PurePosixPath(index).parent / s).as_posix() for s in shards}
            chosen = select_files(listing, mid, include, index_shards=shards)
    except DownloadError as exc:
        raise DownloadError(f"{why}, and in the Hugging Face cache's copy: {exc}") from exc
    missing = sorted(
        {f for f in chosen if not (snapshot / f).is_file()} | {s for s in named if not (snapshot / s).is_file()}
    )
    if missing:
        shown = ", ".join(missing[:3]) + (f", ... ({len(missing)} in all)" if len(missing) > 3 else "")
        raise DownloadError(
            f"{mid}: {why}, and the Hugging Face cache's copy ({snapshot}) is incomplete: it lacks {shown}{how}"
        )
    weights = _gguf_models([f for f in chosen if f.endswith(".gguf")])
    if mid.inside:
        return snapshot / mid.inside
    return snapshot / next(iter(weights)) if len(weights) == 1 else snapshot


def _cached_listing(snapshot: Path, allow_symlinks: bool) -> list[str]:
    """The repository's files at the snapshot's commit, as huggingface_hub cached its listing
    (``<repo>/trees/<commit>.json``: ``{"files": {path: ...}}``), else the files the snapshot holds."""
    repo, tree = snapshot.parent.parent, snapshot.parent.parent / "trees" / f"{snapshot.name}.json"
    try:
        if tree.is_file():
            _check_cache_path(repo, tree, allow_symlinks)  # as a ref: the cache's own structure
            if tree.stat().st_size <= MAX_JSON_BYTES:
                from .headers import loads_json

                value = loads_json(tree.read_bytes(), tree.name, error=DownloadError)
                files = value.get("files") if isinstance(value, dict) else None
                if isinstance(files, dict) and files and all(isinstance(f, str) for f in files):
                    return sorted(files)
    except (DownloadError, OSError) as exc:
        log.info("%s: not read (%s); the snapshot's own files stand for the listing", tree, exc)
    return sorted(
        os.path.relpath(os.path.join(d, f), snapshot).replace(os.sep, "/")
        for d, _, names in os.walk(snapshot)
        for f in names
    )


def _index_shards(path: str, name: str) -> set[str]:
    """The shard files ``model.safetensors.index.json`` names (its ``weight_map``'s values)."""
    from .headers import loads_json

    data = Path(path).read_bytes()
    if len(data) > MAX_JSON_BYTES:
        raise DownloadError(f"{name}: {len(data)} bytes is too large for a shard index")
    value = loads_json(data, name, error=DownloadError)
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict):
        raise DownloadError(f"{name}: weight_map must be an object")
    return {v for v in weight_map.values() if isinstance(v, str)}


def select_files(
    files: Sequence[str], mid: ModelId, include: str | None = None, *, index_shards: set[str] | None = None
) -> list[str]:
    """The files of a repository (its listing ``files``) that loading ``mid`` needs; see :func:`download`.
    ``index_shards``: the shards the repository's ``model.safetensors.index.json`` names; when the
    repository has them all, no other ``.safetensors`` file is taken (as :class:`~anyquant.probe.Probe`
    reads only those)."""
    names = list(files)
    if mid.inside:
        if mid.inside in names:
            return _gguf_parts(names, mid.inside)
        under = [f for f in names if f.startswith(mid.inside + "/")]
        if not under:
            raise DownloadError(f"{mid}: the repository has no {mid.inside!r}; its weight files: {_listing(names)}")
        prefix = mid.inside + "/"
        inner = [f[len(prefix) :] for f in under]
        return [
            prefix + f for f in select_files(inner, ModelId(mid.repo_id, "", None), include, index_shards=index_shards)
        ]
    top = [f for f in names if "/" not in f]
    meta = [f for f in top if f in CONFIG_FILES or f in TOKENIZER_FILES or f in INDEX_NAMES or f.endswith(".json")]
    if include is not None:
        matched = [
            f for f in names if fnmatch.fnmatchcase(f, include) or fnmatch.fnmatchcase(PurePosixPath(f).name, include)
        ]
        weights = [f for f in matched if f.endswith(_WEIGHTS)]
        if not weights:
            raise DownloadError(
                f"{mid}: --include {include!r} matches no weight file; the repository has {_listing(names)}"
            )
        if all(f.endswith(".gguf") for f in weights):
            return sorted({p for f in weights for p in _gguf_parts(names, f)})
        return sorted(set(meta) | set(weights))
    safetensors = [f for f in top if f.endswith(".safetensors")]
    if index_shards and index_shards <= set(safetensors):
        safetensors = [f for f in safetensors if f in index_shards]
    if safetensors:
        return sorted(set(meta) | set(safetensors))
    ggufs = [f for f in names if f.endswith(".gguf")]
    if len(_gguf_models(ggufs)) == 1:  # one file, or the parts of one split model
        return ggufs
    if ggufs:
        raise DownloadError(
            f"{mid}: the repository holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); choose one: "
            f'{mid.repo_id}/{ggufs[0]} as the id, or include="*Q4_K_M*" (--include on the command line)'
        )
    raise DownloadError(
        f"{mid}: the repository has no .safetensors or .gguf weights ({_listing(names)}); anyquant downloads no "
        "pickle (.bin/.pt) weights: fetch them yourself with `hf download` and load with allow_pickle=True"
    )


#: the parts of a GGUF model split by llama.cpp's gguf-split: ``<prefix>-00001-of-00003.gguf`` (1-based)
_GGUF_PART = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf$")


def _gguf_models(ggufs: Sequence[str]) -> dict[str, list[str]]:
    """GGUF files by model, in listing order: a file alone, or every part of a split model under its first
    part's name (the file a load is given)."""
    models: dict[str, list[str]] = {}
    for f in ggufs:
        m = _GGUF_PART.match(f)
        key = f if m is None else f"{m['prefix']}-{1:0{len(m['no'])}d}-of-{m['count']}.gguf"
        models.setdefault(key, []).append(f)
    return models


def _gguf_parts(names: Sequence[str], file: str) -> list[str]:
    """``file`` and, when it is a part of a split GGUF model, the other parts of that model in the listing."""
    if not file.endswith(".gguf"):
        return [file]
    for parts in _gguf_models([f for f in names if f.endswith(".gguf")]).values():
        if file in parts:
            return sorted(parts)
    return [file]


def _listing(names: Sequence[str]) -> str:
    weights = [f for f in names if f.endswith(_WEIGHTS)]
    shown = weights or list(names)
    return ", ".join(shown[:20]) + (f", ... ({len(shown)} in all)" if len(shown) > 20 else "") if shown else "no files"
