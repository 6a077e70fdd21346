"""anyquant._memory.release_free_heap: freed C-heap pages leave the RSS, and load() trims after loading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import anyquant
from anyquant import _memory
from anyquant.testing.tiny import make_tiny_dense

PROBE = r"""
import sys
from anyquant._memory import release_free_heap

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

# ~60 MiB of 2 kB objects (above pymalloc's 512-byte limit, below glibc's mmap threshold: they live on
# the C heap), then freed except one allocated last, which keeps the heap top in place: free() alone
# cannot shrink the heap, malloc_trim can
junk = [bytes(2000) + i.to_bytes(4, "little") for i in range(30_000)]
keep = bytes(3000) + b"x"

del junk
before = rss_mib()
ran = release_free_heap()
after = rss_mib()
print(ran, before, after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_release_free_heap_returns_freed_pages() -> None:
    if _memory._libc() is None:
        pytest.skip("not glibc")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    ran, before, after = out[0] == "True", float(out[1]), float(out[2])
    assert ran
    assert before - after > 20, f"RSS {before:.0f} -> {after:.0f} MiB"


def test_load_trims_the_heap_after_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr("anyquant.api.release_free_heap", lambda: calls.append("trim") or True)
    model = anyquant.load(make_tiny_dense(tmp_path / "tiny"))
    assert calls == ["trim"] and model.format == "dense"


def test_collector_paused_nests_and_restores() -> None:
    import gc

    assert gc.isenabled()
    with _memory.collector_paused():
        assert not gc.isenabled()
        with _memory.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still runs
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        with _memory.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collector_paused_across_threads() -> None:
    """Two blocks overlapping in two threads: the collector stays off until the last one ends."""
    import gc
    import threading

    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with _memory.collector_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with _memory.collector_paused():
        thread.start()
        assert entered.wait(10)
    assert not gc.isenabled()  # the other thread's block still runs
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_load_runs_no_garbage_collection(tmp_path: Path) -> None:
    """No collection runs while a load works (none is called, none is scheduled: the collector is paused), and no
    full one (a full one walks every object of the process: ~80 ms with torch imported) as the load ends; the
    collector is on again after it, also after a load that fails. What the load made is young: the collector's next
    scheduled run, a young-generation one, may start as the pause ends (after other tests it does)."""
    import gc

    from anyquant import _memory

    path = make_tiny_dense(tmp_path / "tiny")
    anyquant.load(path)  # the first load imports what loads need (imports may collect: outside the pause)
    started: list[tuple[int, bool]] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append((info["generation"], _memory._gc_depth > 0))

    gc.callbacks.append(record)
    try:
        for _ in range(3):
            anyquant.load(path)
        with pytest.raises(anyquant.AnyquantError):
            anyquant.load(path, backend="no-such-backend")
    finally:
        gc.callbacks.remove(record)
    assert not [s for s in started if s[1] or s[0] == 2], started
    assert gc.isenabled()
