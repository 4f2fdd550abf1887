"""Fixtures shared by the test modules."""

import pytest


@pytest.fixture(scope="module", params=["decomposed", "tuned", "cuda-emulated"])
def kernels(request) -> str:
    """Both halves of every op: the TE decomposition (floor) and the performance-path kernels,
    the CPU ones and the CUDA ones (their one-thread emulation on llvm: no GPU is needed)."""
    return request.param
