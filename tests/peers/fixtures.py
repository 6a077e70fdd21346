"""Build and cache peer-library fixtures by running a worker script in a subprocess.

A fixture is a directory written by ``tests/peers/<worker>.py --out DIR --params FILE``.
It is cached under ``$ANYQUANT_TEST_CACHE`` (default ``<repo>/.cache/test-fixtures``)
in ``<worker>/<key>``, where ``key`` hashes the worker source, the params, the
Python version and the installed versions of the named packages.  A worker that
cannot import its peer library exits with :data:`UNAVAILABLE_EXIT`; that raises
:class:`PeerUnavailable` (tests skip).  Any other failure raises ``RuntimeError``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "PeerUnavailable",
    "UNAVAILABLE_EXIT",
    "build_peer_fixture",
    "cache_root",
    "fixture_key",
    "peer_fixture_or_skip",
]

UNAVAILABLE_EXIT = 77
_PROTOCOL = "anyquant-peer-fixture-1"
_PEERS_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _PEERS_DIR.parent.parent
_WORKER_ENV_DEFAULTS = {
    "TORCH_COMPILE_DISABLE": "1",
    "GPTQMODEL_CPU_WORKERS": "2",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class PeerUnavailable(RuntimeError):
    """The peer library cannot be imported in the worker process."""


# key -> reason, so a missing peer costs one worker start per test session, not one per test.
_UNAVAILABLE: dict[str, str] = {}


def cache_root() -> Path:
    """``$ANYQUANT_TEST_CACHE`` or ``<repo>/.cache/test-fixtures``."""
    env = os.environ.get("ANYQUANT_TEST_CACHE")
    return Path(env) if env else _REPO_ROOT / ".cache" / "test-fixtures"


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def fixture_key(worker: str, params: Mapping[str, Any], packages: Sequence[str]) -> str:
    """Hash of worker source + params + interpreter + peer package versions."""
    digest = hashlib.sha256(_PROTOCOL.encode())
    digest.update((_PEERS_DIR / f"{worker}.py").read_bytes())
    digest.update(json.dumps(params, sort_keys=True).encode())
    digest.update(sys.version.encode())
    for name in sorted(packages):
        digest.update(f"{name}={_package_version(name)}".encode())
    return digest.hexdigest()[:20]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _worker_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in _WORKER_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    env.setdefault("HF_HOME", str(home / "hf-home"))
    return env


def _run_worker(worker: str, params: Mapping[str, Any], tmp: Path, timeout: float, log: Path) -> None:
    tmp.mkdir(parents=True)
    params_file = tmp / "params.json"
    params_file.write_text(json.dumps(params, sort_keys=True, indent=1))
    command = [sys.executable, str(_PEERS_DIR / f"{worker}.py"), "--out", str(tmp), "--params", str(params_file)]
    started = time.monotonic()
    # cwd=tmp: GPTQModel writes a logs/ folder into the working directory.
    proc = subprocess.run(
        command, cwd=tmp, env=_worker_env(cache_root()), capture_output=True, text=True, timeout=timeout, check=False
    )
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode == UNAVAILABLE_EXIT:
        raise PeerUnavailable(_unavailable_reason(proc.stdout, worker))
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"peer worker {worker} failed (rc={proc.returncode}), log {log}; tail:\n{tail}")
    (tmp / "build_seconds.txt").write_text(f"{time.monotonic() - started:.1f}\n")


def _unavailable_reason(stdout: str, worker: str) -> str:
    for line in reversed(stdout.strip().splitlines()):
        try:
            return str(json.loads(line)["unavailable"])
        except (ValueError, KeyError, TypeError):
            continue
    return f"{worker}: peer library unavailable"


def build_peer_fixture(
    worker: str,
    params: Mapping[str, Any],
    *,
    packages: Sequence[str] = (),
    timeout: float = 1800.0,
) -> Path:
    """Return the cached fixture directory for (worker, params), building it if needed."""
    key = fixture_key(worker, params, packages)
    if key in _UNAVAILABLE:
        raise PeerUnavailable(_UNAVAILABLE[key])
    base = cache_root() / worker
    final = base / key
    with _locked(base / f"{key}.lock"):
        if (final / "manifest.json").is_file():
            return final
        tmp = base / f"{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _run_worker(worker, params, tmp, timeout, base / f"{key}.log")
            if not (tmp / "manifest.json").is_file():
                raise RuntimeError(f"peer worker {worker} wrote no manifest.json in {tmp}")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        except PeerUnavailable as exc:
            _UNAVAILABLE[key] = str(exc)
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def peer_fixture_or_skip(
    worker: str,
    params: Mapping[str, Any],
    *,
    packages: Sequence[str] = (),
    timeout: float = 1800.0,
) -> Path:
    """Like :func:`build_peer_fixture` but ``pytest.skip`` when the peer is unavailable."""
    import pytest

    try:
        return build_peer_fixture(worker, params, packages=packages, timeout=timeout)
    except PeerUnavailable as exc:
        pytest.skip(f"peer {worker} unavailable: {exc}")
