"""The calling thread's OpenMP worker pool, handed back when a call that ran the model returns (standard library only).

libgomp, the OpenMP runtime of torch's Linux wheels (and of anyquant's compiled kernels, which share it), keeps a pool
of worker threads for every thread that has run a parallel region, for as long as that thread lives. Once two threads
hold one, more OpenMP threads exist than cores, libgomp stops spinning between regions, and each region of the thread
that computes sleeps and wakes its workers on a futex: on 2 cores ``torch.exp`` of 64K floats took 49 us instead of
22 us on a second thread, and the bundled model decoded at 88 instead of 234 tok/s in an async call after one sync
call on the main thread (``bench/threads.py``). ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` do not change it.

OpenMP 5's ``omp_pause_resource_all(omp_pause_soft)`` ends the calling thread's pool in libgomp (its workers joined);
the next parallel region on that thread makes a new one (~0.1 ms on 2 cores). The model's public calls
(``anyquant.load``, ``LoadedModel.generate``, ``stream`` ... ``loglikelihood_rolling``) call :func:`release_thread_pool`
when they return, so the thread that ran one keeps no pool for the next call on another thread. Other OpenMP runtimes
(LLVM's ``libomp``, Intel's ``libiomp5``: a soft pause there puts every thread's workers to sleep) and systems
without ``/proc/self/maps`` are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["pool_released", "release_thread_pool", "released_after"]

_T = TypeVar("_T")

#: ``omp_pause_soft`` in OpenMP 5's ``omp_pause_resource_t``
OMP_PAUSE_SOFT = 1

#: the loaded libgomp's omp_pause_resource_all once found; ``False`` once none was found with torch imported (the
#: library that loads it: no later call looks again); ``None`` not looked for yet
_pause: Any = None


def _find_pause() -> Any:
    """``omp_pause_resource_all`` of the libgomp this process has loaded (``None``: none loaded, or too old)."""
    global _pause
    if _pause is None:
        found = _scan()
        if found is not None or "torch" in sys.modules:  # before torch, a later call may find it loaded
            _pause = found if found is not None else False
        return found
    return _pause or None


def _scan() -> Any:
    """Look for it among the process's mapped libraries (``/proc/self/maps``; ``None``: none, or no such file)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if Path(p).name.startswith("libgomp")):
        try:  # RTLD_NOLOAD: only a library already loaded, never a new one
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):  # gone, or a libgomp before OpenMP 5 (GCC < 9)
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP worker pool, if it has one; whether libgomp did (``False``: no libgomp loaded,
    or the thread is inside a parallel region). Other threads' pools are untouched."""
    pause = _find_pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


@contextlib.contextmanager
def pool_released() -> Iterator[None]:
    """Run the block, then :func:`release_thread_pool` (also when it raises)."""
    try:
        yield
    finally:
        release_thread_pool()


def released_after(items: Iterable[_T]) -> Iterator[_T]:
    """``items`` as an iterator that calls :func:`release_thread_pool` when it ends or is closed, on the thread that
    started iterating it (a stream finished or dropped on another thread leaves that thread's pool alone);
    ``close()`` reaches ``items``."""
    owner = threading.get_ident()
    try:
        yield from items
    finally:
        if threading.get_ident() == owner:
            release_thread_pool()
