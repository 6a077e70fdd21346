"""Where the compiled kernel is required (``make test`` sets ``ANYQUANT_REQUIRE_KERNELS=1`` unless
``ANYQUANT_KERNELS=0``), its absence fails here, once, instead of every kernel test skipping itself and CI passing
with no kernel coverage (#41)."""

from __future__ import annotations

import os

import pytest

from anyquant_cpu import kernels


@pytest.mark.skipif(os.environ.get("ANYQUANT_REQUIRE_KERNELS") != "1", reason="the kernel is not required here")
def test_the_kernel_is_built_and_loads() -> None:
    assert kernels.library() is not None, "anyquant-cpu was installed without its compiled kernel"
    assert kernels.stale() is None, f"the compiled kernel does not match: {kernels.stale()}; {kernels.REBUILD}"
    assert kernels.available(), f"the compiled kernel at {kernels.library()} does not load"
    assert kernels.lut_available() and kernels.lut_isa() >= 0
