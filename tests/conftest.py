"""Fixtures shared by the test modules."""

import pytest


@pytest.fixture(scope="module", params=["decomposed", "tuned"])
def kernels(request) -> str:
    """Both halves of every op: the TE decomposition (floor) and the performance-path kernels."""
    return request.param
