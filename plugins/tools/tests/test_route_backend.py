"""route_backend: the option routing the AWQ and EXL3 quantizers share (an option only some quantizers
read picks one that reads it, or is an error; never dropped)."""

from __future__ import annotations

import pytest

from anyquant.errors import QuantizeError
from anyquant_tools.quantize import route_backend

READERS = {"ours": frozenset({"grid", "clip"}), "peer": frozenset(), "old": frozenset({"clip", "legacy"})}


def test_auto_runs_the_default_unless_an_option_needs_another() -> None:
    asked: list[int] = []

    def default() -> str:
        asked.append(1)
        return "peer"

    assert route_backend({}, READERS, default) == "peer"
    assert route_backend({"batch_size": 2}, READERS, default) == "peer"  # read by all: no part in the choice
    assert len(asked) == 2
    assert route_backend({"grid": 5}, READERS, default) == "ours"  # only one reads it: default not asked
    assert len(asked) == 2
    assert route_backend({"clip": False}, READERS, "old") == "old"  # the default reads it
    assert route_backend({"clip": False}, READERS, "peer") == "ours"  # first reader in order
    assert route_backend({"clip": False}, READERS, "peer", auto_picks=("old", "peer")) == "old"
    with pytest.raises(
        QuantizeError,
        match=r"read only by quantizer_backend 'old', which 'auto' does not pick: name it \(quantizer_backend='old'\)",
    ):  # only a quantizer auto never picks reads it
        route_backend({"legacy": 1}, READERS, "peer", auto_picks=("ours", "peer"))


def test_refusals_name_who_reads_what() -> None:
    with pytest.raises(QuantizeError, match=r"quantizer_backend='x' is not one of \('auto', 'ours', 'peer', 'old'\)"):
        route_backend({"quantizer_backend": "x"}, READERS, "peer")
    with pytest.raises(
        QuantizeError, match=r"'peer' does not read \['clip'\] \(quantizer_backend 'ours' or 'old' does\)"
    ):
        route_backend({"quantizer_backend": "peer", "clip": 1}, READERS, "peer")
    with pytest.raises(QuantizeError, match=r"'peer' does not read \['grid', 'legacy'\] \(no single quantizer"):
        route_backend({"quantizer_backend": "peer", "grid": 1, "legacy": 1}, READERS, "peer")
    with pytest.raises(
        QuantizeError,
        match=r"\['grid', 'legacy'\] are not all read by one quantizer \('grid' by 'ours'; 'legacy' by 'old'\)",
    ):
        route_backend({"grid": 1, "legacy": 1}, READERS, "peer")
    assert route_backend({"quantizer_backend": "old", "clip": 1, "legacy": 2}, READERS, "peer") == "old"
