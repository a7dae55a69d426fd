"""The operator's API-call pool: creations first, then the oldest job, FIFO among equals."""

from __future__ import annotations

import threading

import pytest

from tfps.operator.calls import CREATE, OTHER, PriorityPool, job_key


def test_queued_calls_run_creations_first_then_oldest_job_first():
    pool = PriorityPool(1, "test")
    gate, ran = threading.Event(), []
    blocker = pool.submit((CREATE, *job_key("", "ns", "a")), gate.wait)  # holds the only thread
    old, new = job_key("2026-01-01T00:00:00Z", "ns", "old"), job_key("2026-01-01T00:00:05Z", "ns", "new")
    futures = [
        pool.submit((OTHER, *new), ran.append, "new status"),
        pool.submit((OTHER, *old), ran.append, "old status"),
        pool.submit((CREATE, *new), ran.append, "new pod 1"),
        pool.submit((CREATE, *old), ran.append, "old pod"),
        pool.submit((CREATE, *new), ran.append, "new pod 2"),
    ]
    gate.set()
    for f in [blocker, *futures]:
        f.result(timeout=5)
    assert ran == ["old pod", "new pod 1", "new pod 2", "old status", "new status"]


def test_map_returns_results_in_order_and_raises_after_every_call_ran():
    pool = PriorityPool(4, "test")
    assert pool.map((OTHER,), lambda x: x * 2, [3, 1, 2]) == [6, 2, 4]

    done = []

    def call(x: int) -> int:
        if x == 0:
            raise ValueError("refused")
        done.append(x)
        return x

    with pytest.raises(ValueError, match="refused"):
        pool.map((OTHER,), call, [0, 1, 2, 3])
    assert sorted(done) == [1, 2, 3]
