"""Helpers shared by the test modules."""

from __future__ import annotations

import os

import pytest

# Set on a machine without a C++ compiler: the tests of our kernels then skip where the
# kernels did not build, and the run's summary says so (conftest.py). Unset, they fail.
WITHOUT_KERNELS = os.environ.get("GAPLESS_TEST_WITHOUT_KERNELS") == "1"


def require_our_kernels(works: bool, what: str) -> None:
    """Fails the test where `what` (one of our C++ kernels) did not build or disagrees with
    torch here, so that a green suite means the fast path ran; skips it instead under
    GAPLESS_TEST_WITHOUT_KERNELS=1."""
    if works:
        return
    if WITHOUT_KERNELS:
        pytest.skip(f"{what} did not build here (GAPLESS_TEST_WITHOUT_KERNELS=1)")
    pytest.fail(
        f"{what} did not build, or disagrees with torch, on this machine (see the log for"
        " 'kernels:'); on a machine without a C++ compiler, GAPLESS_TEST_WITHOUT_KERNELS=1"
        " skips this",
        pytrace=False,
    )
