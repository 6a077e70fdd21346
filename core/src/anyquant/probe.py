"""The probe: everything detection may look at, read from a checkpoint without touching tensor data.

:meth:`Probe.open` reads ``config.json``, ``quantization_config.json``, ``quantize_config.json``,
ModelOpt's ``hf_quant_config.json``,
the tokenizer file names, every ``*.safetensors`` header (found by globbing, not from the index),
the shard index, and GGUF headers. The result is immutable. Standard library only: never
imports torch.

Every file it reads must resolve inside the checkpoint directory: a link leaving it is an
:class:`~anyquant.errors.UnsafePathError`. One layout is allowed besides: a snapshot directory of a
Hugging Face hub cache (``models--<owner>--<name>/snapshots/<revision>``), whose files are links to
the same repository's ``blobs/``. With ``allow_symlinks=True`` (or ``ANYQUANT_ALLOW_SYMLINKS=1``) a link
may leave the directory when it ends at a regular file (never a device, fifo or directory), whose
content is then checked as any other file's (:func:`require_inside` is the one place that decides).

The cache's own structure gets the same rule (:func:`_check_cache_path`): ``snapshots/``, a snapshot, a
folder in it, ``refs/`` and a ref must resolve inside the cached repository's folder
``models--<owner>--<name>``, which may itself be a link (a repository folder, or the whole cache, moved
to another disk and linked back as one); a link leaving it is an :class:`~anyquant.errors.UnsafePathError`
unless links are allowed, and then a snapshot or folder must end at a directory, a ref at a regular file.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

from .errors import ConfigError, HeaderError, ProbeError, RevisionNotFoundError, UnsafePathError
from .headers import (
    MAX_JSON_BYTES,
    GGUFHeader,
    SafetensorsHeader,
    TensorInfo,
    loads_json,
    read_gguf_header,
    read_safetensors_header,
)

__all__ = [
    "ModelId",
    "Probe",
    "display_name",
    "download_command",
    "hub_cache_dir",
    "parse_model_id",
    "read_checkpoint_json",
    "require_inside",
    "resolve_checkpoint",
    "with_revision",
]

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "quantization_config.json", "quantize_config.json", "hf_quant_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
INDEX_NAMES = ("model.safetensors.index.json",)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A mutable deep copy of a frozen probe value (dicts and lists again)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class Probe:
    """What a checkpoint says about itself, from its config files and headers only."""

    path: Path  # what the caller passed (directory or file); for a model id, its Hugging Face cache snapshot
    root: Path  # the checkpoint directory
    config: Mapping[str, Any] | None
    quantization_config_file: Mapping[str, Any] | None
    quantize_config_file: Mapping[str, Any] | None
    tokenizer_files: tuple[str, ...]
    safetensors: tuple[SafetensorsHeader, ...]
    tensors: Mapping[str, TensorInfo]
    index: Mapping[str, Any] | None
    gguf: tuple[GGUFHeader, ...]
    pickle_files: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    by_suffix: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    #: shards the index names that are not in the directory (an interrupted download, a stale index)
    missing_shards: tuple[str, ...] = ()
    #: links leaving the directory were allowed when they end at a regular file (:func:`allow_symlinks`)
    allow_symlinks: bool = False
    #: NVIDIA ModelOpt's ``hf_quant_config.json`` (``{"producer": {"name": "modelopt"}, "quantization": {...}}``)
    hf_quant_config_file: Mapping[str, Any] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, revision: str | None = None, allow_symlinks: bool | None = None
    ) -> Probe:
        """Read a checkpoint directory, a single ``.safetensors`` file, or a ``.gguf`` file; or, for a model
        id ``owner/name`` that is not a local path, its snapshot in the local Hugging Face cache
        (:func:`resolve_checkpoint`). A file-system error (a directory without read permission, a name
        too long) is a :class:`ProbeError`. ``revision``: a model id's branch, tag or commit
        (as ``owner/name@revision``). ``allow_symlinks``: follow links that leave the directory when
        they end at a regular file (default: ``ANYQUANT_ALLOW_SYMLINKS=1`` in the environment, else no)."""
        if not isinstance(path, (str, os.PathLike)):
            raise ProbeError(f"a checkpoint path is a str or os.PathLike, got {type(path).__name__}")
        path = with_revision(path, revision)
        try:
            return cls._open(path, allow_symlinks_opt(allow_symlinks))
        except OSError as exc:
            where = exc.filename if exc.filename is not None else path
            raise ProbeError(f"{where}: cannot read ({exc.strerror or exc})") from None

    @classmethod
    def _open(cls, path: str | os.PathLike[str], allow_symlinks: bool = False) -> Probe:
        notes: list[str] = []
        p, asked = resolve_checkpoint(path, allow_symlinks=allow_symlinks), Path(path).expanduser()
        if not p.exists():
            model_id, hint = _model_id(path), ""
            if model_id is not None and p != asked:  # the model is cached, the file is not
                hint = f" (in the Hugging Face cache's snapshot of {model_id.repo_id}: it has no {model_id.inside!r})"
            elif model_id is not None:
                hint = (
                    f", nor a model in the Hugging Face cache ({hub_cache_dir()}). anyquant reads local files and "
                    f"downloads only when asked: `{download_command(model_id)}` (or load(..., download=True), "
                    f"`anyquant download {model_id}`) first, or pass a directory"
                )
            raise ProbeError(f"{p}: no such file or directory{hint}")
        if p != asked:
            notes.append(f"{os.fspath(path)!r} is the Hugging Face cache's snapshot {p}")
        if p.is_file():
            root = p.parent.resolve()
            files = [root / p.name]  # a single file was asked for: only that file's tensors, by the name it is asked by
            if p.suffix not in (".safetensors", ".gguf"):
                raise ProbeError(f"{p}: expected a directory, a .safetensors file or a .gguf file")
        else:
            root = p.resolve()
            files = []
        listing = _Listing(root, allow_symlinks)
        configs = [read_checkpoint_json(root, name, listing) for name in CONFIG_FILES]
        tokenizer_files = tuple(n for n in TOKENIZER_FILES if listing.is_file(n))
        for name in tokenizer_files:  # read by the tokenizer libraries: the same rule as configs and weights
            listing.check_inside(name)
        if p.is_dir():
            st_files = listing.files(".safetensors")
            gguf_files = listing.files(".gguf")
            pickle_files = tuple(
                n for n in sorted(listing.entries) if _suffix(n) in PICKLE_SUFFIXES and listing.is_file(n)
            )
        else:
            st_files = files if p.suffix == ".safetensors" else []
            gguf_files = files if p.suffix == ".gguf" else []
            pickle_files = ()
        for f in [*st_files, *gguf_files]:
            listing.check_inside(f.name)
        headers = tuple(read_safetensors_header(f, f.name) for f in st_files)
        index, missing = _read_index(root, set(h.file for h in headers), notes, listing) if p.is_dir() else (None, ())
        if index is not None and not missing:
            headers = _listed_shards(headers, index, notes)
        tensors = _merge_tensors(headers)
        if index is not None:
            unlisted = [t for t in tensors if t not in index["weight_map"]]
            if unlisted:
                notes.append(
                    f"{INDEX_NAMES[0]} does not list {len(unlisted)} tensor(s) found in the shards (e.g. {unlisted[0]!r})"
                )
        ggufs = tuple(read_gguf_header(f, f.name) for f in gguf_files)
        return cls(
            path=p,
            root=root,
            config=_freeze(configs[0]) if configs[0] is not None else None,
            quantization_config_file=_freeze(configs[1]) if configs[1] is not None else None,
            quantize_config_file=_freeze(configs[2]) if configs[2] is not None else None,
            tokenizer_files=tokenizer_files,
            safetensors=headers,
            tensors=MappingProxyType(tensors),
            index=_freeze(index) if index is not None else None,
            gguf=ggufs,
            pickle_files=pickle_files,
            notes=tuple(notes),
            by_suffix=_suffix_index(tensors),
            missing_shards=missing,
            allow_symlinks=allow_symlinks,
            hf_quant_config_file=_freeze(configs[3]) if configs[3] is not None else None,
        )

    # ------------------------------------------------------------------ queries
    @property
    def quantization_config(self) -> Mapping[str, Any] | None:
        """``config.json``'s ``quantization_config`` (or ``compression_config``), if any."""
        if self.config is None:
            return None
        for key in ("quantization_config", "compression_config"):
            qc = self.config.get(key)
            if isinstance(qc, Mapping) and qc:
                return qc
        return None

    @property
    def quant_method(self) -> str | None:
        """The declared quantization method, lowercased (``None`` when nothing declares one).

        ``config.json``'s ``quant_method`` (or GPTQModel's ``method``) wins; a lone
        ``quantize_config.json`` with GPTQ keys (old AutoGPTQ) declares ``gptq``; a lone ``hf_quant_config.json``
        whose producer is ModelOpt (its exports before ``quantization_config`` went into ``config.json``) declares
        ``modelopt``.
        """
        for qc in (self.quantization_config, self.quantization_config_file):
            if qc is not None:
                for key in ("quant_method", "method"):
                    value = qc.get(key)
                    if isinstance(value, str) and value:
                        return value.strip().lower()
        qf = self.quantize_config_file
        if qf is not None:
            value = qf.get("quant_method") or qf.get("method")
            if isinstance(value, str) and value:
                return value.strip().lower()
            if "bits" in qf and ("group_size" in qf or "desc_act" in qf):
                return "gptq"
        hq = self.hf_quant_config_file
        if hq is not None:
            producer = hq.get("producer")
            if isinstance(producer, Mapping) and str(producer.get("name", "")).strip().lower() == "modelopt":
                return "modelopt"
        if self.quantization_config is not None and (
            self.quantization_config.get("load_in_4bit") or self.quantization_config.get("load_in_8bit")
        ):
            return "bitsandbytes"
        return None

    @property
    def is_gguf(self) -> bool:
        return bool(self.gguf) and not self.safetensors

    def suffixes(self) -> dict[str, int]:
        """How many tensors end in each last dotted component (``qweight``, ``trellis`` ...)."""
        return {suffix: len(prefixes) for suffix, prefixes in self.by_suffix.items()}

    def modules_with(self, suffix: str) -> Iterator[str]:
        """Prefixes ``P`` such that tensor ``P.<suffix>`` exists."""
        return iter(self.by_suffix.get(suffix, ()))

    def tensor(self, name: str) -> TensorInfo | None:
        return self.tensors.get(name)

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def describe(self) -> str:
        """One line saying what was seen, for error messages."""
        parts = []
        if self.config is None:
            parts.append("no config.json")
        else:
            qm = self.quant_method
            parts.append(f"quant_method={qm!r}" if qm else "no quantization_config")
        if self.safetensors:
            suffixes = self.suffixes()
            top = ", ".join(f"{k}x{v}" for k, v in sorted(suffixes.items(), key=lambda kv: -kv[1])[:6])
            parts.append(f"{len(self.tensors)} tensors in {len(self.safetensors)} safetensors file(s) ({top})")
        if self.gguf:
            parts.append(f"{len(self.gguf)} GGUF file(s)")
        if self.pickle_files:
            parts.append(f"pickle files {list(self.pickle_files)[:3]}")
        if not (self.safetensors or self.gguf or self.pickle_files):
            parts.append("no weight files")
        return "; ".join(parts)


# ---------------------------------------------------------------------- Hugging Face cache

_MODEL_ID = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})(?:/(.+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_COMMIT_PREFIX = re.compile(r"[0-9a-f]{7,40}")
#: a pull request's revision: ``refs/pr/N``, the Hub's name, or ``pr/N``
_PULL_REQUEST = re.compile(r"(?:refs/)?(pr/[0-9]{1,9})")


def hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps downloaded repositories: ``$HF_HUB_CACHE``, else
    ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub`` (huggingface_hub's own order)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(os.path.expandvars(env[var])).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


@dataclass(frozen=True)
class ModelId:
    """A Hugging Face model id as anyquant reads it: ``owner/name[/path][@revision]``."""

    repo_id: str  # owner/name
    inside: str  # a path inside the repository ("" for the whole repository)
    revision: str | None  # a branch, tag or commit (hash or prefix); None: main

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.inside}" if self.inside else "")
        return text + (f"@{self.revision}" if self.revision else "")


def parse_model_id(path: str | os.PathLike[str], revision: str | None = None) -> ModelId | None:
    """``path`` as a Hugging Face model id (``owner/name``, ``owner/name/file.gguf``, either with
    ``@revision``: everything after the last ``@``, so a branch may hold ``/``), or None when it cannot
    be one. ``revision`` (the ``revision=`` argument) must agree with one written in the id."""
    text = os.fspath(path)
    if not isinstance(text, str):
        return None
    name, at, rev = text.rpartition("@")
    if not at:
        name, rev = text, ""
    m = _MODEL_ID.fullmatch(name)
    if m is None or "--" in m.group(1) or ".." in m.group(1):
        return None
    inside = m.group(2) or ""
    if inside and any(part in ("", ".", "..") or "\\" in part or "\0" in part for part in inside.split("/")):
        return None
    if at:
        _check_revision(rev, text)
    if revision is not None:
        _check_revision(revision, text)
        if at and rev != revision:
            raise ProbeError(f"{text}: names revision {rev!r} and revision={revision!r} was passed: give one")
        rev = revision
    return ModelId(m.group(1), inside, rev or None)


def _check_revision(rev: str, text: str) -> None:
    parts = rev.split("/")
    if not rev or len(rev) > 255 or any(p in ("", ".", "..") for p in parts) or "\\" in rev or "\0" in rev:
        raise ProbeError(f"{text}: {rev!r} is not a revision (a branch, tag or commit hash)")


def with_revision(path: str | os.PathLike[str], revision: str | None) -> str | os.PathLike[str]:
    """``path`` with ``revision=`` folded into it (``owner/name@revision``) for the functions that take a
    model id; ``path`` itself when ``revision`` is None. A revision for a path that is not a model id
    (a local directory) is a :class:`ProbeError`."""
    if revision is None:
        return path
    if not isinstance(revision, str):
        raise ProbeError(f"revision= is a str (a branch, tag or commit hash), got {type(revision).__name__}")
    mid = parse_model_id(path, revision)
    if mid is None or Path(path).expanduser().exists():
        raise ProbeError(
            f"{os.fspath(path)}: revision={revision!r} applies to a Hugging Face model id (owner/name), "
            "not to a local path"
        )
    return str(mid)


def download_command(mid: ModelId, include: str | None = None) -> str:
    """The ``hf download`` command (huggingface_hub's CLI) that fetches ``mid`` into the cache anyquant reads."""
    parts = ["hf download", mid.repo_id]
    if mid.inside:
        parts.append(_quote(mid.inside))
    if mid.revision:
        parts += ["--revision", _quote(mid.revision)]
    if include:
        parts += ["--include", _quote(include)]
    return " ".join(parts)


def _quote(text: str) -> str:
    return text if re.fullmatch(r"[A-Za-z0-9_./@:+=-]+", text) else '"' + text.replace('"', '\\"') + '"'


def _model_id(path: str | os.PathLike[str]) -> ModelId | None:
    try:
        return parse_model_id(path)
    except ProbeError:
        return None


def resolve_checkpoint(
    path: str | os.PathLike[str], revision: str | None = None, *, allow_symlinks: bool | None = None
) -> Path:
    """``path`` itself when it exists (a cached repository's own directory, ``.../models--owner--name``,
    stands for its snapshot); else, when it reads as a model id ``owner/name`` (:func:`parse_model_id`),
    that model's snapshot in the local Hugging Face cache (:func:`hub_cache_dir`), and for
    ``owner/name/<path>`` that path in the snapshot (one ``.gguf`` of a repository that holds several);
    else ``path`` unchanged. The snapshot is the revision asked for (``@revision`` or ``revision=``: a
    branch or tag the cache's ``refs/`` names, a pull request as ``refs/pr/N`` or ``pr/N``, or a commit hash
    or a unique prefix of one), else the one
    ``refs/main`` names, or the only one there is. Reads only the local cache: nothing is downloaded. A
    revision the cache does not hold is a :class:`~anyquant.errors.RevisionNotFoundError` listing those
    it holds; a ref that is not a commit hash, or names no snapshot, or several snapshots and no
    ``refs/main`` and no revision asked, are a :class:`ProbeError`. Every part of the cache's structure it
    goes through resolves inside the cached repository's folder, or is an
    :class:`~anyquant.errors.UnsafePathError` (:func:`_check_cache_path`; ``allow_symlinks``: as
    :meth:`Probe.open`'s)."""
    allow = allow_symlinks_opt(allow_symlinks)
    p = Path(path).expanduser()
    if p.exists():
        if p.name.startswith("models--") and (p / "snapshots").is_dir() and not (p / "config.json").exists():
            return _cached_snapshot(p, ModelId(_repo_id_of(p), "", revision), allow)
        if revision is not None:
            with_revision(path, revision)  # raises: a revision for a local path
        _check_snapshot_path(Path(os.path.abspath(p)), allow)  # a path into a cache's snapshot, named as a path
        return p
    mid = parse_model_id(path, revision)
    if mid is None:
        return p
    repo = hub_cache_dir() / ("models--" + mid.repo_id.replace("/", "--"))
    if not (repo / "snapshots").is_dir():
        return p
    snapshot = _cached_snapshot(repo, mid, allow)
    if mid.inside:
        _check_inner(repo, snapshot, snapshot / mid.inside, allow)
    return snapshot / mid.inside


def _cached_snapshot(repo: Path, mid: ModelId, allow_symlinks: bool = False) -> Path:
    """The snapshot of cached repository ``repo`` for ``mid.revision``; without one, the snapshot
    ``refs/main`` names, or its only one; checked by :func:`_check_cache_path`."""
    snapshots = repo / "snapshots"
    _check_cache_path(repo, snapshots, allow_symlinks)
    if (repo / "refs").exists() or (repo / "refs").is_symlink():
        _check_cache_path(repo, repo / "refs", allow_symlinks)
    snapshot = _find_snapshot(repo, mid, allow_symlinks)
    _check_cache_path(repo, snapshot, allow_symlinks)
    return snapshot


def _find_snapshot(repo: Path, mid: ModelId, allow_symlinks: bool) -> Path:
    snapshots = repo / "snapshots"
    if mid.revision is not None:
        return _revision_snapshot(repo, mid, allow_symlinks)
    ref = repo / "refs" / "main"
    if ref.is_symlink() or ref.exists():
        _check_cache_path(repo, ref, allow_symlinks)
    if ref.is_file():
        return _ref_snapshot(repo, ref, mid)
    found = sorted(d.name for d in snapshots.iterdir() if d.is_dir())
    if len(found) == 1 and _named_refs(repo):  # only other branches were downloaded (hf download --revision X)
        return _revision_snapshot(repo, ModelId(mid.repo_id, mid.inside, "main"), allow_symlinks)
    if len(found) != 1:
        raise RevisionNotFoundError(
            f"{mid.repo_id}: the Hugging Face cache ({repo}) has no refs/main and {len(found)} snapshots: "
            f"{_present(repo)}. Pick one: revision=... in Python, {mid.repo_id}@<revision> on the command line"
        )
    return snapshots / found[0]


def _check_cache_path(repo: Path, path: Path, allow_symlinks: bool = False) -> None:
    """``path``, a part of cached repository ``repo``'s own structure (``snapshots/``, a snapshot or a
    folder in it, ``refs/``, a ref, huggingface_hub's ``trees/<commit>.json``), resolves inside ``repo``'s folder: the rule :func:`require_inside`
    applies to a checkpoint's files. ``repo`` itself may be a link (a ``models--…`` folder, or the whole
    cache, moved and linked back as one), and links that stay in it (a ref naming another, huggingface_hub's
    snapshot files linked into ``blobs/``) are the cache's own. With ``allow_symlinks`` a link may leave it
    when it ends at a directory (``snapshots/``, a snapshot, a folder) or at a regular file (a ref, a listing); never at
    a device, fifo or socket. A ref is read only once it has passed."""
    real_repo, real = repo.resolve(), path.resolve()
    if real_repo in real.parents:
        return
    try:
        where = path.relative_to(repo).as_posix()
    except ValueError:
        where = str(path)
    where = f"{repo.name}/{where}"
    is_ref = (repo / "refs") in path.parents or (repo / "trees") in path.parents  # a file; else a folder
    if allow_symlinks:
        try:
            mode = os.stat(real).st_mode
        except OSError as exc:
            raise UnsafePathError(f"{where}: is a link to {real}, which cannot be read ({exc.strerror})") from None
        if stat.S_ISREG(mode) if is_ref else stat.S_ISDIR(mode):
            return
        raise UnsafePathError(
            f"{where}: is a link to {real}, which is not a {'regular file' if is_ref else 'directory'}; "
            "allow_symlinks follows a ref only to a regular file, a snapshot only to a directory"
        )
    raise UnsafePathError(
        f"{where}: is a link to {real}, outside the Hugging Face cache's {repo} (links in a cached repository stay "
        "in its folder; the folder itself may be a link). To follow it, pass allow_symlinks=True (CLI: "
        "--allow-symlinks; or ANYQUANT_ALLOW_SYMLINKS=1)"
    )


def _check_inner(repo: Path, snapshot: Path, target: Path, allow_symlinks: bool) -> None:
    """Every folder from ``snapshot`` down to ``target`` (a path in it: the folder asked for, or the folder
    of the file asked for) under :func:`_check_cache_path`; a file's own link is the probe's to check."""
    inner = target.relative_to(snapshot).parts
    folder = snapshot
    for i, part in enumerate(inner):
        folder = folder / part
        if i == len(inner) - 1 and not folder.is_dir():
            return
        _check_cache_path(repo, folder, allow_symlinks)


def _check_snapshot_path(p: Path, allow_symlinks: bool) -> None:
    """A path given as such that lies in a cache's snapshot (``.../models--o--n/snapshots/<commit>/...``,
    ``p`` made absolute without following links): its snapshot and folders under :func:`_check_cache_path`.
    A path leading into a snapshot through a link of the caller's own is not one: the caller named it."""
    snap = _hub_snapshot(p)
    if snap is None:
        return
    repo = snap.parent.parent
    _check_cache_path(repo, snap.parent, allow_symlinks)
    _check_cache_path(repo, snap, allow_symlinks)
    if p != snap:
        _check_inner(repo, snap, p, allow_symlinks)


def _ref_snapshot(repo: Path, ref: Path, mid: ModelId) -> Path:
    with ref.open("rb") as fh:
        commit = fh.read(256).decode("ascii", "replace").strip()
    if not _COMMIT.fullmatch(commit):
        raise ProbeError(f"{ref}: expected a commit hash (40 hexadecimal digits)")
    snapshots = repo / "snapshots"
    if not (snapshots / commit).is_dir():
        name = ref.relative_to(repo / "refs").as_posix()
        raise ProbeError(
            f"{mid.repo_id}: the Hugging Face cache's refs/{name} names {commit}, but {snapshots} has no such snapshot"
        )
    return snapshots / commit


def _revision_snapshot(repo: Path, mid: ModelId, allow_symlinks: bool = False) -> Path:
    """The snapshot of a branch or tag (a file under ``refs/``, whose name may hold ``/``) or of a
    commit hash (or a unique prefix of at least 7 hexadecimal digits)."""
    rev = mid.revision or "main"
    refs, snapshots = repo / "refs", repo / "snapshots"
    for name in _ref_names(rev):
        ref = refs / name
        if ref.is_symlink() or ref.exists():
            _check_cache_path(repo, ref, allow_symlinks)
        if ref.is_file():
            return _ref_snapshot(repo, ref, mid)
    if _COMMIT_PREFIX.fullmatch(rev):
        found = sorted(d.name for d in snapshots.iterdir() if d.is_dir() and d.name.startswith(rev))
        if len(found) == 1:
            return snapshots / found[0]
        if len(found) > 1:
            raise RevisionNotFoundError(
                f"{mid.repo_id}@{rev}: the prefix matches {len(found)} snapshots ({', '.join(found)}): give more digits"
            )
    raise RevisionNotFoundError(
        f"{mid.repo_id}: revision {rev!r} is not in the Hugging Face cache ({repo}), which holds {_present(repo)}. "
        f"Download it: `{download_command(ModelId(mid.repo_id, mid.inside, rev))}` (or load(..., download=True), "
        f"`anyquant download {mid.repo_id}@{rev}`)"
    )


def _ref_names(rev: str) -> tuple[str, ...]:
    """The names under a cached repository's ``refs/`` that may hold revision ``rev``: ``rev`` itself
    (huggingface_hub keeps a revision asked for as ``refs/<revision>``), then, for a pull request, its
    other spelling: the Hub names pull request N ``refs/pr/N`` (kept as ``refs/refs/pr/N``), which
    ``pr/N`` also finds, and ``refs/pr/N`` finds a ref kept as ``pr/N``. ``rev`` has passed
    :func:`_check_revision`, and the other spelling only adds or drops the leading ``refs/``."""
    m = _PULL_REQUEST.fullmatch(rev)
    if m is None:
        return (rev,)
    return (rev, m.group(1)) if rev.startswith("refs/") else (rev, "refs/" + rev)


def _named_refs(repo: Path) -> list[Path]:
    refs = repo / "refs"
    return sorted(f for f in refs.rglob("*") if f.is_file() and not f.is_symlink()) if refs.is_dir() else []


def _present(repo: Path) -> str:
    """The revisions a cached repository holds: its refs (branch or tag -> commit) and snapshot hashes."""
    refs, snapshots = repo / "refs", repo / "snapshots"
    named: list[str] = []
    for f in _named_refs(repo):
        with f.open("rb") as fh:
            commit = fh.read(64).decode("ascii", "replace").strip()
        named.append(f"{f.relative_to(refs).as_posix()} -> {commit[:12]}")
    hashes = sorted(d.name for d in snapshots.iterdir() if d.is_dir()) if snapshots.is_dir() else []
    text = f"refs [{', '.join(named)}]" if named else "no refs"
    return text + f" and snapshots [{', '.join(hashes) or 'none'}]"


def display_name(path: str | os.PathLike[str]) -> str:
    """A checkpoint's name for tables and reports: ``owner/name`` for a snapshot in a Hugging Face
    cache (or a model id found there; a file or folder in the snapshot adds its path, and a revision
    asked for, ``owner/name@4.0bpw``, is kept), otherwise the file or directory name. Never raises."""
    try:
        p = Path(os.path.abspath(resolve_checkpoint(path)))  # links not followed: a snapshot's files are links
    except (OSError, ProbeError):
        return Path(path).name
    snap = _hub_snapshot(p)
    if snap is None:
        return p.name
    name = _repo_id_of(snap.parent.parent)
    rest = p.relative_to(snap).as_posix()
    mid = _model_id(path) if not Path(path).expanduser().exists() else None
    at = f"@{mid.revision}" if mid is not None and mid.revision else ""
    return (name if rest == "." else f"{name}/{rest}") + at


def _repo_id_of(repo: Path) -> str:
    """``owner/name`` of a cached repository's folder ``models--owner--name``."""
    return repo.name.removeprefix("models--").replace("--", "/")


def _hub_snapshot(p: Path) -> Path | None:
    """The Hugging Face cache snapshot ``models--<owner>--<name>/snapshots/<revision>`` that ``p`` is
    or is in, or None."""
    for snap in (p, *p.parents):
        if snap.parent.name == "snapshots" and snap.parent.parent.name.startswith("models--"):
            return snap
    return None


# ---------------------------------------------------------------------- helpers


def _suffix_index(tensors: Mapping[str, TensorInfo]) -> Mapping[str, tuple[str, ...]]:
    index: dict[str, list[str]] = {}
    for prefix, _, suffix in map(str.rpartition, tensors, repeat(".")):
        index.setdefault(suffix, []).append(prefix)
    return MappingProxyType({k: tuple(v) for k, v in index.items()})


class _Listing:
    """The checkpoint directory read once (``os.scandir``): which names are files, and which are
    links that must be resolved to check they stay inside it. A plain file listed in the resolved
    directory is inside it without a ``realpath`` call (a 70B checkpoint has dozens of shards)."""

    def __init__(self, root: Path, allow_symlinks: bool = False) -> None:
        self.root, self.allow_symlinks = root, allow_symlinks
        with os.scandir(root) as it:
            self.entries = {e.name: e for e in it}

    def is_file(self, name: str) -> bool:
        entry = self.entries.get(name)
        return entry is not None and entry.is_file()

    def files(self, suffix: str) -> list[Path]:
        """The files matching ``*<suffix>`` (links to files included), sorted by name."""
        return [self.root / n for n in sorted(self.entries) if n.endswith(suffix) and self.entries[n].is_file()]

    def check_inside(self, name: str) -> None:
        if self.entries[name].is_symlink():
            require_inside(self.root, self.root / name, self.allow_symlinks)


def allow_symlinks_opt(value: bool | None) -> bool:
    """``allow_symlinks`` as asked, or, when not (``None``), from ``ANYQUANT_ALLOW_SYMLINKS`` (``1``, ``true``,
    ``yes``)."""
    if value is not None:
        return bool(value)
    return os.environ.get("ANYQUANT_ALLOW_SYMLINKS", "").strip().lower() in ("1", "true", "yes")


def _suffix(name: str) -> str:
    return PurePosixPath(name).suffix


def require_inside(root: Path, f: Path, allow_symlinks: bool = False) -> None:
    """``f`` (a file the probe or a loader reads) resolves inside ``root``, or, when ``root`` is a
    snapshot in a Hugging Face hub cache, to a blob of the same cached repository: every file of a
    snapshot is a link to ``<repo>/blobs/<hash>``, where the repository keeps its files' bytes.
    With ``allow_symlinks`` a link may end anywhere at a regular file (its size and content are checked
    by whatever reads it, as any file's); never at a directory, device, fifo or socket."""
    real = f.resolve()
    if real == root or root in real.parents or real.parent == _hub_blobs(root):
        return
    if allow_symlinks:
        try:
            mode = os.stat(real).st_mode
        except OSError as exc:
            raise UnsafePathError(f"{f.name}: is a link to {real}, which cannot be read ({exc.strerror})") from None
        if stat.S_ISREG(mode):
            return
        raise UnsafePathError(
            f"{f.name}: is a link to {real}, which is not a regular file; allow_symlinks follows links to files only"
        )
    raise UnsafePathError(
        f"{f.name}: is a link to {real}, outside the model directory {root}. To follow links to files outside "
        "it (a shared model tree), pass allow_symlinks=True (CLI: --allow-symlinks; or ANYQUANT_ALLOW_SYMLINKS=1)"
    )


def _hub_blobs(root: Path) -> Path | None:
    """``<repo>/blobs`` when ``root`` is ``<repo>/snapshots/<revision>`` (or a folder in it) of a
    Hugging Face hub cache, ``<repo>`` being named ``models--<owner>--<name>``; otherwise None."""
    snap = _hub_snapshot(root)
    return snap.parent.parent / "blobs" if snap is not None else None


def read_checkpoint_json(root: Path, name: str, listing: _Listing | None = None) -> dict[str, Any] | None:
    """``root / name`` parsed as JSON (bounded in size, inside the checkpoint: :func:`require_inside`), or ``None``
    where there is no such file."""
    f = root / name
    listing = listing if listing is not None else _Listing(root)
    if not listing.is_file(name):
        return None
    listing.check_inside(name)
    size = f.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ConfigError(f"{name}: {size} bytes is too large for a config file")
    try:
        data = f.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read ({exc.strerror})") from None
    value = loads_json(data, name, error=ConfigError)
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a JSON object, got a {type(value).__name__}")
    qc = value.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"{name}: quantization_config must be an object, got {type(qc).__name__}")
    return value


def _merge_tensors(headers: tuple[SafetensorsHeader, ...]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for h in headers:
        before = len(tensors)
        tensors.update(zip(map(_name, h.tensors), h.tensors, strict=False))
        if len(tensors) != before + len(h.tensors):
            seen: dict[str, str] = {}
            for prev in headers:
                for t in prev.tensors:
                    if t.name in seen:
                        raise HeaderError(f"tensor {t.name!r} is in both {seen[t.name]} and {t.file}")
                    seen[t.name] = t.file
    return tensors


_name = operator.attrgetter("name")


def _listed_shards(
    headers: tuple[SafetensorsHeader, ...], index: Mapping[str, Any], notes: list[str]
) -> tuple[SafetensorsHeader, ...]:
    """The shards of a complete index: a ``*.safetensors`` file that the index (which names every other
    file present) does not name at all is another copy of the weights, such as the
    ``consolidated.safetensors`` in Mistral's uploads beside the transformers shards; transformers reads
    only the index's shards, and so does anyquant (with a note)."""
    named = set(index["weight_map"].values())
    extra = [h.file for h in headers if h.file not in named]
    if not extra or len(extra) == len(headers):
        return headers
    notes.append(
        f"{', '.join(extra)}: not named by {INDEX_NAMES[0]}, which names the other shard(s); ignored "
        "(weights in another layout, such as Mistral's consolidated.safetensors, as transformers ignores them)"
    )
    return tuple(h for h in headers if h.file in named)


def _read_index(
    root: Path, shard_names: set[str], notes: list[str], listing: _Listing
) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The shard index, if any, and the shards it names that are not in the directory."""
    for name in INDEX_NAMES:
        index = read_checkpoint_json(root, name, listing)
        if index is None:
            continue
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{name}: weight_map must be an object")
        missing: set[str] = set()
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str):
                raise ConfigError(f"{name}: weight_map[{tensor!r}] is not a file name")
            pp = PurePosixPath(shard)
            if pp.is_absolute() or ".." in pp.parts or "\\" in shard or (len(shard) > 1 and shard[1] == ":"):
                raise UnsafePathError(f"{name}: weight_map[{tensor!r}] = {shard!r} leaves the model directory")
            if shard not in shard_names:
                missing.add(shard)
        if missing:
            notes.append(
                f"{name} names {len(missing)} shard(s) that do not exist ({sorted(missing)[:3]}); "
                "the index is stale and was ignored: the shard files themselves were read"
            )
            log.info("stale index in %s: missing %s", root, sorted(missing))
        return index, tuple(sorted(missing))
    return None, ()
