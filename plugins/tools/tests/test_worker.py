"""run_worker: a subprocess with progress lines and a result, from a relative scratch folder too."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from anyquant_tools.quantize import WorkerError, run_worker

WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from anyquant_tools.quantize import emit_progress, emit_result
    job = json.loads(Path(sys.argv[1]).read_text())
    emit_progress("halfway", 0.5)
    if job.get("fail"):
        print("something broke", file=sys.stderr)
        sys.exit(1)
    emit_result({"echo": job["x"], "cwd": str(Path.cwd())})
    """
)


@pytest.fixture()
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "tiny_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    monkeypatch.chdir(tmp_path)
    return "tiny_worker"


def test_relative_scratch(worker: str, tmp_path: Path) -> None:
    seen: list[tuple[str, float]] = []
    result = run_worker(worker, {"x": 7}, scratch=Path("out/.scratch"), progress=lambda s, f: seen.append((s, f)))
    assert result == {"echo": 7, "cwd": str((tmp_path / "out" / ".scratch").resolve())}
    assert seen == [("halfway", 0.5)]


def test_failure_is_a_typed_error_with_the_log(worker: str) -> None:
    with pytest.raises(WorkerError, match="something broke"):
        run_worker(worker, {"x": 1, "fail": True}, scratch=Path("s"))
