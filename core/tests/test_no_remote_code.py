"""A checkpoint's own Python code (``auto_map`` in config.json and tokenizer_config.json, with the module it
names beside the weights) is never imported by default: the model and its tokenizer are transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import anyquant
from anyquant.testing.tiny import make_tiny_dense

#: the checkpoint's module: leaves a mark at an absolute path (transformers runs a copy from its module cache)
EVIL = """
from pathlib import Path
Path({mark!r}).write_text("the checkpoint's code ran")
raise SystemExit("remote code ran")
"""


@pytest.mark.parametrize("runtime", ["native", "transformers"])
def test_auto_map_code_is_not_run(tmp_path: Path, runtime: str) -> None:
    root = make_tiny_dense(tmp_path / "m")
    mark = tmp_path / "RAN"
    (root / "evil.py").write_text(EVIL.format(mark=str(mark)))
    cfg = json.loads((root / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (root / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((root / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (root / "tokenizer_config.json").write_text(json.dumps(tok))
    with anyquant.load(root, runtime=runtime) as model:
        assert model.tokenizer is not None and type(model.tokenizer).__module__.startswith("transformers")
        assert isinstance(model.generate("Hi", max_new_tokens=2), str)
    assert not mark.exists()
