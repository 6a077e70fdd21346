"""Staging directories for atomic output (``quantize``, ``export_dense``), and the leftovers of killed runs.

Output is written to a hidden directory beside its destination and renamed into place only when complete,
so a failure never leaves something ``detect`` would take for the result. An exception or Ctrl-C removes
the staging directory; a process killed outright (SIGKILL, the OOM killer, a closed terminal's SIGHUP,
a power cut) cannot, and a quantization's partial output can be gigabytes. So the directory's name
records who made it (a hash of the host name and the process id), and the next run writing to the same
destination removes those whose process has ended on this host. A directory of a live process, of another
host (a shared file system) or of unknown origin is never touched. No signal handler is installed: a
library does not take over its host's signals.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path

__all__ = [
    "MODEL_FILE_SUFFIXES",
    "check_destination",
    "publish_modes",
    "remove_stale",
    "replace_dir",
    "staging_dir",
]

log = logging.getLogger(__name__)

#: what a model directory holds (weights, configs, tokenizer files, a model card): ``overwrite=True``
#: replaces a directory only when every file in it is one of these
MODEL_FILE_SUFFIXES = frozenset(
    {".json", ".safetensors", ".gguf", ".txt", ".model", ".jinja", ".md", ".bin", ".pt", ".tiktoken", ".py", ".csv"}
    | {".yaml", ".yml", ".log"}
)


def _model_file(name: str) -> bool:
    """A file a model directory holds: a known suffix, a licence-like upper-case name, or a dotfile."""
    suffix = Path(name).suffix.lower()
    return suffix in MODEL_FILE_SUFFIXES or (not suffix and (name.isupper() or name.startswith(".")))


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _prefix(target: Path) -> str:
    """The staging names' prefix for ``target``; a long name is cut (with a hash of the whole) so that the
    staging name stays under the file system's 255 bytes whatever ``target``'s own length."""
    name = target.name
    if len(os.fsencode(name)) > 120:
        digest = hashlib.sha1(os.fsencode(name)).hexdigest()[:12]
        name = name[:40] + "~" + digest  # 40 characters: at most 160 bytes
    return f".{name}.anyquant-"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (``True`` when that cannot be told safely)."""
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT there
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, another user's
        return True
    return True


def remove_stale(target: Path) -> list[Path]:
    """Remove the staging directories beside ``target`` left by ended processes of this host; return them."""
    parent, prefix = target.parent, _prefix(target)
    pattern = re.compile(re.escape(prefix) + r"([0-9a-f]{8})-([0-9]+)-")
    host, removed = _host_tag(), list[Path]()
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or m.group(1) != host or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            log.info("removed %s, left by process %d of this host, which has ended", entry, pid)
            removed.append(entry)
    return removed


def check_destination(
    src: Path, dst: Path, overwrite: bool, error: type[Exception], *, what: str = "destination"
) -> None:
    """Refuse, before any work, a destination whose replacement could lose data: the source itself, inside the
    source, a directory the source is inside (replacing it would delete the source), a symlink, a file, or,
    even with ``overwrite=True``, a directory that does not look like a model (a file whose suffix is not in
    :data:`MODEL_FILE_SUFFIXES` and which is no upper-case licence name or dotfile, or a subdirectory other
    than ``.cache``)."""
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise error(f"{what} {dst} is the source itself or inside the source {src}; choose a directory elsewhere")
    if d in s.parents:
        raise error(f"the source {src} is inside the {what} {dst}: replacing it would delete the source")
    if dst.is_symlink():
        raise error(f"{what} {dst} is a symbolic link; give the directory it points to, or another path")
    for parent in d.parents:
        if parent.exists() and not parent.is_dir():
            raise error(f"{what} {dst}: {parent} is a file, not a directory")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise error(f"{what} {dst} is a file; give a directory path")
    entries = list(dst.iterdir())
    if not entries:
        return
    if not overwrite:
        raise error(f"{what} {dst} exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it")
    strange = sorted(
        e.name for e in entries if (e.is_dir() and e.name != ".cache") or (not e.is_dir() and not _model_file(e.name))
    )
    if strange:
        raise error(
            f"{what} {dst} holds {strange[:5]}{' ...' if len(strange) > 5 else ''}, which are not a model's files: "
            "overwrite=True replaces only a model directory; move those or choose another path"
        )
    if not any(e.name == "config.json" or e.suffix in (".safetensors", ".gguf") for e in entries):
        # a project folder (main.py, notes.txt, README.md, LICENSE) passes the file-name test above
        raise error(
            f"{what} {dst} has no config.json and no weights: it does not look like a model directory, and "
            "overwrite=True replaces only a model directory; move its files or choose another path"
        )


def replace_dir(new: Path, dst: Path) -> None:
    """Put the finished directory ``new`` at ``dst`` (same parent), replacing what is there without a window
    in which both are lost: the old ``dst`` is first renamed aside (to a name of this process, which a later
    run removes if this one is killed right then), then ``new`` is renamed in, and only then is the old one
    deleted. If the second rename fails, the old directory is put back."""
    if not dst.exists():
        os.replace(new, dst)
        return
    aside = Path(tempfile.mkdtemp(prefix=f"{_prefix(dst)}{_host_tag()}-{os.getpid()}-", dir=dst.parent))
    os.replace(dst, aside)  # onto the empty directory mkdtemp made: atomic
    try:
        os.replace(new, dst)
    except BaseException:
        os.replace(aside, dst)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def staging_dir(target: Path) -> Path:
    """A new, empty hidden directory beside ``target`` (created with its parent), named for this process;
    first removes what killed runs left for the same ``target`` (:func:`remove_stale`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    return Path(tempfile.mkdtemp(prefix=f"{_prefix(target)}{_host_tag()}-{os.getpid()}-", dir=target.parent))


def umask() -> int:
    """The process's umask, read without setting it (``os.umask`` would change it for every thread a moment):
    Linux reports it in /proc; elsewhere the usual 022."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def publish_modes(root: Path) -> None:
    """Give a finished staging directory, and everything written in it, the modes the umask gives new files
    (0755 directories, 0644 files under the usual 022): ``mkdtemp`` made the directory 0700, and some writers
    (transformers' ``save_pretrained`` writes ``model.safetensors`` through a temporary file) leave 0600
    files beside 0644 siblings. Executable bits are kept; links are not followed."""
    mask = umask()
    for path in [root, *root.rglob("*")]:
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            os.chmod(path, 0o777 & ~mask)
        elif stat.S_ISREG(st.st_mode):
            os.chmod(path, (0o777 if st.st_mode & 0o111 else 0o666) & ~mask)
