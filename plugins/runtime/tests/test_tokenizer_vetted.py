"""The tokenizer library reads files the probe does not list (added_tokens.json, additional_chat_templates/):
it is handed a vetted directory, so a link leaving the checkpoint never feeds it outside content."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from anyquant.probe import Probe
from anyquant_runtime.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symlinks")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from anyquant.testing.tiny import make_tiny_dense

    return make_tiny_dense(tmp_path_factory.mktemp("tiny") / "m")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_outside_added_tokens_and_templates_do_not_reach_the_tokenizer(tiny: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "added_tokens.json").write_text(json.dumps({"<outside-secret>": 100000}))
    (outside / "evil.jinja").write_text("OUTSIDE TEMPLATE {{ messages }}")
    model = _copy(tiny, tmp_path / "model")
    (model / "added_tokens.json").symlink_to(outside / "added_tokens.json")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "evil.jinja").symlink_to(outside / "evil.jinja")
    tok = load_tokenizer(Probe.open(model))
    assert "<outside-secret>" not in tok.get_vocab()
    templates = tok.chat_template if isinstance(tok.chat_template, dict) else {}
    assert "evil" not in templates
    assert tok.name_or_path == str(model.resolve())


def test_inside_links_and_extra_files_still_reach_it(tiny: Path, tmp_path: Path) -> None:
    """The same files, inside the directory (plain, or as links within it, as a hub snapshot's are): read."""
    model = _copy(tiny, tmp_path / "model")
    store = model / "store"
    store.mkdir()
    (store / "tpl.jinja").write_text("INSIDE {{ messages }}")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "inside.jinja").symlink_to(store / "tpl.jinja")
    (model / "tokenizer.json").rename(store / "tokenizer.json")
    (model / "tokenizer.json").symlink_to(Path("store") / "tokenizer.json")
    tok = load_tokenizer(Probe.open(model))
    assert isinstance(tok.chat_template, dict) and tok.chat_template.get("inside", "").startswith("INSIDE")
    assert tok("hello world")["input_ids"]


def test_allow_symlinks_follows_outside_tokenizer_files(tiny: Path, tmp_path: Path) -> None:
    """A shared tree: tokenizer.json linked from outside is refused by default, followed when asked."""
    from anyquant.errors import UnsafePathError

    shared = _copy(tiny, tmp_path / "shared")
    model = _copy(tiny, tmp_path / "model")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(shared / "tokenizer.json")
    with pytest.raises(UnsafePathError, match="allow_symlinks"):
        Probe.open(model, allow_symlinks=False)
    tok = load_tokenizer(Probe.open(model, allow_symlinks=True))
    assert tok("hello world")["input_ids"] == load_tokenizer(Probe.open(shared))("hello world")["input_ids"]
