"""Issue #44 item 9: the README's "In ten lines" runs as written on a fresh checkout (the bundled model is
named from Python as ``anyquant.default_model()``, no ``./my-model`` that does not exist)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _first_python_block() -> str:
    m = re.search(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)
    assert m is not None, "README.md has no ```python block"
    return m.group(1)


def test_the_first_python_block_is_the_ten_lines_and_names_the_bundled_model() -> None:
    text = README.read_text(encoding="utf-8")
    block = _first_python_block()
    assert text.index("## In ten lines") < text.index(block)
    code = [line.split("#", 1)[0] for line in block.splitlines()]
    assert any("sdk.default_model()" in line for line in code)
    assert not any("./my-model" in line for line in code)  # a path only in the comments
    assert any('"org/' in line for line in block.splitlines() if line.lstrip().startswith("#"))  # Hub ids kept
    compile(block, "README.md", "exec")


@pytest.mark.model
def test_the_readme_ten_lines_run_as_written(tmp_path: Path) -> None:
    block = _first_python_block()
    lengths = [int(n) for n in re.findall(r"max_new_tokens=(\d+)", block)]
    assert lengths and max(lengths) <= 64  # bounded
    script = tmp_path / "ten_lines.py"
    script.write_text(block, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANYQUANT_")}
    env["HF_HUB_OFFLINE"] = "1"  # nothing may be fetched: the block runs from what a checkout installs
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Detection(format='gguf'")  # detect's answer
    assert lines[1].split()[0] == "gguf"  # model.format, model.backend
    assert len(lines) >= 3 and "".join(lines[2:]).strip()  # the generated text, then the streamed reply
