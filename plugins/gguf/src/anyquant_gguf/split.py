"""GGUF models split by llama.cpp's ``gguf-split`` (or ``GGUFWriter(split_max_tensors=/split_max_size=)``),
found and checked as llama.cpp's loader (``llama_model_loader``) finds and checks them.

A split model is ``N`` complete GGUF files named ``<prefix>-<K>-of-<N>.gguf`` (``%s-%05d-of-%05d.gguf``, ``K``
1-based; llama.cpp's ``llama_split_path``), all in one directory. Every part holds the keys ``split.no`` (``K - 1``),
``split.count`` (``N``) and ``split.tensors.count`` (the tensors of all parts) and its own tensors, with their
data; the first part also holds all the model's metadata (gguf-split writes the other parts' metadata as the split
keys only; with ``--no-tensor-first-split`` the first part holds no tensor).

:func:`resolve_split` takes the file asked for and returns its parts: the metadata is the first part's; the parts'
names come from the first part's name and ``split.count`` as llama.cpp derives them (``llama_split_prefix``);
every part's header is read by the caller's bounded header reader and checked: the same ``split.count`` as the
first, its position as ``split.no``, no tensor in two parts, and all of them ``split.tensors.count`` (where the
first part has the key; llama.cpp requires it). The files are neither merged nor copied: the reader maps each
and reads every tensor from its own part.

Unlike llama.cpp (which refuses a part other than the first), a later part asked for loads the model from its
first part, found by the same naming rule. Importing this module imports neither torch nor numpy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anyquant.plugin import CheckpointError, GGUFHeader, MissingTensorError

from .metadata import GGUFMetadataError, metadata_int

__all__ = [
    "MAX_SPLIT_PARTS",
    "SPLIT_COUNT",
    "SPLIT_NO",
    "SPLIT_TENSORS_COUNT",
    "GGUFSplitError",
    "SplitModel",
    "model_entries",
    "part_name",
    "resolve_split",
    "split_info",
    "split_name_parts",
    "split_prefix",
]

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
#: the most parts a split model may have here (llama.cpp stores the count as a uint16; gguf-split's parts are
#: tens of GB each, so a real model has tens of parts): the bound on the files one load opens
MAX_SPLIT_PARTS = 1024
#: llama.cpp's part names: ``<prefix>-00001-of-00003.gguf`` (at least five digits each, 1-based)
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf$")


class GGUFSplitError(CheckpointError):
    """The parts of a split GGUF model do not fit together: a part missing, named or numbered wrongly, with another
    ``split.count``, a tensor in two parts, or fewer or more tensors than ``split.tensors.count``. The message names
    the part."""


def part_name(prefix: str, no: int, count: int) -> str:
    """The name of part ``no`` (0-based) of ``count``: llama.cpp's ``llama_split_path``."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def split_prefix(name: str, no: int, count: int) -> str | None:
    """The prefix of ``name`` when it is part ``no`` (0-based) of ``count`` named as llama.cpp names it, else
    ``None`` (llama.cpp's ``llama_split_prefix``)."""
    postfix = f"-{no + 1:05d}-of-{count:05d}.gguf"
    if len(name) > len(postfix) and name.endswith(postfix):
        return name[: -len(postfix)]
    return None


def split_name_parts(name: str) -> tuple[str, int, int] | None:
    """``(prefix, no (0-based), count)`` of a file named as a part, else ``None`` (a name alone, not checked against
    the file's header)."""
    match = _PART_NAME.match(name)
    if match is None:
        return None
    no, count = int(match["no"]) - 1, int(match["count"])
    if not 0 <= no < count:
        return None
    return match["prefix"], no, count


def split_info(header: GGUFHeader) -> tuple[int, int] | None:
    """``(split.no, split.count)`` of a part of a split model; ``None`` for a file that is not one (no
    ``split.count``, or 1). A value of the wrong type or out of range (``split.count`` 0, negative, over
    :data:`MAX_SPLIT_PARTS`, a string; ``split.no`` not below the count) is a :class:`GGUFMetadataError` naming the
    file, the key and the value, raised before any other part is looked for."""
    meta = header.metadata
    try:
        count = metadata_int(SPLIT_COUNT, meta.get(SPLIT_COUNT), minimum=1, maximum=MAX_SPLIT_PARTS)
        if count is None or count == 1:
            return None
        no = metadata_int(SPLIT_NO, meta.get(SPLIT_NO), minimum=0, maximum=count - 1, required=True)
    except GGUFMetadataError as exc:
        raise GGUFMetadataError(f"{header.file}: {exc}") from None
    assert no is not None
    return no, count


def model_entries(headers: Sequence[GGUFHeader]) -> list[GGUFHeader]:
    """The files of a directory's GGUF headers that each stand for one model: a file that is not a part (no
    ``split.count`` over 1 in its header), and for each split model (its parts grouped by name) the part with the
    lowest number present: the first part, or a later one when the first is missing (:func:`resolve_split` then
    names it). A part whose name is not llama.cpp's stands alone (and is refused by :func:`resolve_split`)."""
    entries: list[GGUFHeader] = []
    groups: dict[tuple[str, int], tuple[int, GGUFHeader]] = {}
    for h in headers:
        count = h.metadata.get(SPLIT_COUNT)
        parsed = split_name_parts(h.file)
        if isinstance(count, int) and not isinstance(count, bool) and count > 1 and parsed is not None:
            prefix, no, named = parsed
            best = groups.get((prefix, named))
            if best is None:
                entries.append(h)  # its place in the listing, replaced below by the lowest part
                groups[(prefix, named)] = (no, h)
            elif no < best[0]:
                entries[entries.index(best[1])] = h
                groups[(prefix, named)] = (no, h)
        else:
            entries.append(h)
    return entries


@dataclass(frozen=True)
class SplitModel:
    """A GGUF model's files: ``paths[0]``/``headers[0]`` the file whose metadata is the model's (the first part, or
    the one file of an unsplit model), then the other parts in order. ``asked``: the file asked for (a later part
    loads from the first)."""

    paths: tuple[Path, ...]
    headers: tuple[GGUFHeader, ...]
    asked: Path

    @property
    def count(self) -> int:
        return len(self.paths)

    @property
    def is_split(self) -> bool:
        return len(self.paths) > 1

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.paths]

    @property
    def tensor_count(self) -> int:
        return sum(len(h.tensors) for h in self.headers)

    def describe(self) -> str:
        """``"split in 3 parts: a-00001-of-00003.gguf, ..."`` (evidence for detect)."""
        shown = ", ".join(self.names[:4]) + (f", ... ({self.count} in all)" if self.count > 4 else "")
        return f"split in {self.count} parts: {shown}"


def resolve_split(
    path: Path,
    header: GGUFHeader,
    read_header: Callable[[Path], GGUFHeader],
    known: Sequence[GGUFHeader] = (),
) -> SplitModel:
    """The files of the model ``path`` (whose header is ``header``) belongs to: itself alone when it is not a part;
    else every part, each header read with ``read_header`` (or taken from ``known``, headers already read, by
    file name) and checked (see the module doc). Bounded: the part count is checked (at most
    :data:`MAX_SPLIT_PARTS`) and every part's existence looked up before any other header is read. Raises
    :class:`GGUFMetadataError` (a bad split key), :class:`GGUFSplitError` (parts that do not fit together, a
    missing part) or :class:`~anyquant.errors.MissingTensorError` (fewer tensors than ``split.tensors.count``)."""
    info = split_info(header)
    if info is None:
        return SplitModel((path,), (header,), path)
    no, count = info
    prefix = split_prefix(path.name, no, count)
    if prefix is None:
        raise GGUFSplitError(
            f"{path.name} is part {no + 1} of a GGUF model split into {count} files, but it is not named as "
            f"llama.cpp names the parts ('<name>-{no + 1:05d}-of-{count:05d}.gguf'), so its other parts cannot be "
            "found: rename the parts as llama-gguf-split wrote them"
        )
    folder = path.parent
    paths = tuple(folder / part_name(prefix, i, count) for i in range(count))
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f", ... ({len(missing)} in all)" if len(missing) > 3 else "")
        raise GGUFSplitError(
            f"{path.name} is part {no + 1} of a GGUF model split into {count} files; {shown} "
            f"{'is' if len(missing) == 1 else 'are'} not in {folder} (download every part of the model into one "
            "directory)"
        )
    by_name = {h.file: h for h in known}
    by_name[path.name] = header
    headers = []
    for i, part in enumerate(paths):
        h = by_name.get(part.name)
        if h is None:
            h = read_header(part)
        _check_part(h, part.name, i, count)
        headers.append(h)
    _check_tensors(headers, paths)
    return SplitModel(paths, tuple(headers), path)


def _check_part(header: GGUFHeader, name: str, no: int, count: int) -> None:
    info = split_info(header)
    got_count = 1 if info is None else info[1]
    if got_count != count:
        raise GGUFSplitError(
            f"{name}: split.count is {header.metadata.get(SPLIT_COUNT)!r}, not {count} as in the first part: "
            "the parts are of different models (or one was re-split); download the parts again"
        )
    assert info is not None
    if info[0] != no:
        raise GGUFSplitError(
            f"{name}: split.no is {info[0]} (part {info[0] + 1}), but its name makes it part {no + 1} of {count}: "
            "the parts were renamed or mixed up"
        )


def _check_tensors(headers: Sequence[GGUFHeader], paths: Sequence[Path]) -> None:
    where: dict[str, str] = {}
    for h, p in zip(headers, paths, strict=True):
        for t in h.tensors:
            other = where.get(t.name)
            if other is not None:
                raise GGUFSplitError(f"tensor {t.name!r} is in two parts of the split GGUF model: {other} and {p.name}")
            where[t.name] = p.name
    expected: Any = headers[0].metadata.get(SPLIT_TENSORS_COUNT)
    if expected is None:
        return
    try:
        want = metadata_int(SPLIT_TENSORS_COUNT, expected, minimum=0)
    except GGUFMetadataError as exc:
        raise GGUFMetadataError(f"{paths[0].name}: {exc}") from None
    for h, p in zip(headers[1:], paths[1:], strict=True):
        theirs = h.metadata.get(SPLIT_TENSORS_COUNT)
        if theirs is not None and theirs != expected:
            raise GGUFSplitError(f"{p.name}: split.tensors.count is {theirs!r}, not {expected!r} as in the first part")
    if len(where) < (want or 0):
        raise MissingTensorError(
            f"{paths[0].name}: the split GGUF model's parts hold {len(where)} tensors, but split.tensors.count is "
            f"{want}: a part is truncated or of another model"
        )
    if len(where) > (want or 0):
        raise GGUFSplitError(
            f"{paths[0].name}: the split GGUF model's parts hold {len(where)} tensors, more than its "
            f"split.tensors.count ({want})"
        )
