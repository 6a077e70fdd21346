"""Staging directories for atomic output (``quantize``, ``export_dense``), and the leftovers of killed runs.

Output is written to a hidden directory beside its destination and renamed into place only when complete,
so a failure never leaves something ``detect`` would take for the result. An exception or Ctrl-C removes
the staging directory; a process killed outright (SIGKILL, the OOM killer, a closed terminal's SIGHUP,
a power cut) cannot, and a quantization's partial output can be gigabytes. So the directory's name
records who made it (a hash of the host name and the process id), and the next run writing to the same
destination removes those whose process has ended on this host. A directory of a live process, of another
host (a shared file system) or of unknown origin is never touched. No signal handler is installed: a
library does not take over its host's signals.

One job at a time writes a destination: :func:`lock_destination` takes a lock file beside it
(``.<name>.anyquant-lock``, an ``flock`` the kernel releases when its process ends, so a killed job's lock
is never stale) for the whole job, and a second job is refused with :class:`DestinationLockedError` naming
the holder. The commit (:func:`replace_dir`) rechecks ``overwrite=False`` and swaps the finished directory
in with one atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``); where that is missing it renames the
old output aside first, and a run killed between the two renames has its old output put back by the
next run to the same destination (:func:`recover_aside`).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

from anyquant.errors import DestinationLockedError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "MODEL_FILE_SUFFIXES",
    "DestinationLock",
    "check_destination",
    "lock_destination",
    "publish_modes",
    "recover_aside",
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
    recover_aside(dst)
    holder = _lock_holder(dst)
    if holder is not None:
        raise DestinationLockedError(_locked_message(dst, holder))
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


def _aside_prefix(target: Path) -> str:
    return f"{_prefix(target)}old-{_host_tag()}-{os.getpid()}-"


def recover_aside(target: Path) -> list[Path]:
    """Finish what a commit killed between its two renames left (the fallback of :func:`replace_dir`): an old
    output renamed aside by an ended process of this host is put back at ``target`` when ``target`` is missing
    (the new output never arrived), and removed when ``target`` is there (the new output did). Returns the
    directories handled. Another host's, or a live process's, are never touched."""
    pattern = re.compile(re.escape(_prefix(target)) + r"old-([0-9a-f]{8})-([0-9]+)-")
    handled: list[Path] = []
    try:
        entries = sorted(target.parent.iterdir(), key=lambda e: e.name)
    except OSError:
        return handled
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or m.group(1) != _host_tag() or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        if not target.exists() and not target.is_symlink():
            try:
                os.rename(entry, target)
            except OSError:
                continue  # another run got there first
            log.warning(
                "%s was missing: a run (process %d) was killed while replacing it; its previous content, "
                "moved aside as %s, is restored",
                target,
                pid,
                entry.name,
            )
        else:
            shutil.rmtree(entry, ignore_errors=True)
            log.info("removed %s, the old output process %d replaced before it ended", entry, pid)
        handled.append(entry)
    return handled


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system
    or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl without it
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, dst: Path, *, overwrite: bool = True, error: type[Exception] = FileExistsError) -> None:
    """Put the finished directory ``new`` at ``dst`` (same parent), replacing what is there without a window
    in which both are lost. With ``overwrite=False``, a non-empty ``dst`` that appeared while the job ran
    (the check before the job saw none) is refused with ``error``, never replaced.

    Where the system has it, one atomic exchange swaps the two and the old one (now at ``new``) is deleted.
    Otherwise the old ``dst`` is renamed aside (to a name of this process), then ``new`` is renamed in,
    and only then is the old one deleted; if the second rename fails the old directory is put back, and if
    the process is killed right then, the next run puts it back (:func:`recover_aside`)."""
    exists = dst.exists() or dst.is_symlink()
    if exists and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise error(
            f"{dst} appeared while this job ran and is not empty; nothing was replaced. "
            "Pass overwrite=True (CLI: --overwrite) to replace it"
        )
    if not exists:
        os.rename(new, dst)  # a rename onto a missing name; fails (never replaces) if one appeared meanwhile
        return
    if _exchange(new, dst):
        shutil.rmtree(new, ignore_errors=True)
        return
    aside = Path(tempfile.mkdtemp(prefix=_aside_prefix(dst), dir=dst.parent))
    os.replace(dst, aside)  # onto the empty directory mkdtemp made: atomic
    try:
        os.replace(new, dst)
    except BaseException:
        os.replace(aside, dst)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _lock_path(target: Path) -> Path:
    return target.parent / f"{_prefix(target)}lock"


def _locked_message(target: Path, holder: str) -> str:
    return (
        f"{target} is being written by another anyquant job ({holder}); nothing was done. Wait for it to "
        f"finish, or choose another destination (lock file: {_lock_path(target)})"
    )


def _read_holder(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(200).strip()
    except OSError:
        text = ""
    return text or "a process that has not written its name yet"


def _lock_holder(target: Path) -> str | None:
    """Who holds ``target``'s lock, or None when nobody does (checked without taking it or creating files)."""
    path = _lock_path(target)
    if fcntl is None:
        if not path.exists():
            return None
        holder = _read_holder(path)
        return None if _stale(holder) else holder
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_holder(path)
    finally:
        os.close(fd)
    return None


def _stale(holder: str) -> bool:
    """Whether a lock file's holder (written as ``pid N on host H``) is an ended process of this host."""
    m = re.match(r"pid ([0-9]+) on host (\S+)", holder)
    return m is not None and m.group(2) == socket.gethostname() and not _alive(int(m.group(1)))


class DestinationLock:
    """A held lock on a destination (:func:`lock_destination`); :meth:`release` (or leaving a ``with``
    block) gives it up and removes the lock file."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)  # still held: nobody can have taken this file meanwhile
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> DestinationLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)  # the kernel drops the flock with the last descriptor


def lock_destination(target: Path) -> DestinationLock:
    """Take ``target``'s lock for a job that will write it, creating its parent; raises
    :class:`DestinationLockedError` naming the holder when another job has it. The lock is an ``flock`` on
    ``.<name>.anyquant-lock`` beside ``target``: the kernel releases it when its process ends however it
    ends, so a killed job leaves no stale lock. Without ``flock`` (Windows) the file is created exclusively
    and one whose process has ended on this host is taken over."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = _lock_path(target)
    me = f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    for _ in range(50):
        if fcntl is None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read_holder(path)
                if _stale(holder):
                    path.unlink(missing_ok=True)
                    continue
                raise DestinationLockedError(_locked_message(target, holder)) from None
            os.write(fd, me.encode())
            return DestinationLock(path, fd)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DestinationLockedError(_locked_message(target, _read_holder(path))) from None
        try:  # the holder before us may have removed the file between our open and our flock
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if not same:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, me.encode())
        return DestinationLock(path, fd)
    raise DestinationLockedError(_locked_message(target, _read_holder(path)))  # pragma: no cover - a lock storm


def staging_dir(target: Path) -> Path:
    """A new, empty hidden directory beside ``target`` (created with its parent), named for this process;
    first removes what killed runs left for the same ``target`` (:func:`remove_stale`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_aside(target)
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
