"""Fixtures of the end-to-end tests: the chart installed by helm, its operator serving only the
test's namespace (`release`, per test; `install_chart` for other scopes)."""

from __future__ import annotations

import pytest
from jobrun import install_chart


@pytest.fixture
def release(cluster, namespace):
    """The chart installed by helm, its operator serving only this test's namespace."""
    with install_chart(cluster, namespace) as name:
        yield name
