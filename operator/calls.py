"""The threads that make the operator's API calls: creations first, then oldest job first.

When many jobs arrive at once, a plain FIFO pool interleaves them: every job's reads, then
every job's Secret, then every job's pods, so each job waits for nearly all of the others.
Here, whenever calls are queued, creations of children go before any other call (status
reads and writes, deletions), and among equals the job created first (creationTimestamp,
then name) goes first: jobs get their pods in the order they were created, and a burst of
jobs gets all its pods before the status work that only reports on them. (Not age first, a
job's creations before its own other calls: that reports one job Running sooner but creates
every job's pods later, and pods are what a burst waits for.) When nothing is queued the
order changes nothing.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

T = TypeVar("T")
Key = tuple  # compared as a tuple: the smaller goes first
CREATE, OTHER = 0, 1  # classes of calls: creating a job's children, anything else


def job_key(created: str | None, namespace: str, name: str) -> Key:
    """A job's age (RFC 3339 timestamps in UTC sort as strings), then its name."""
    return (created or "", namespace, name)


class PriorityPool:
    """A fixed set of daemon threads running blocking calls, the smallest key first and
    in submission order among equal keys."""

    def __init__(self, workers: int, name: str):
        self._queue: list[tuple[Key, int, Future, Callable[..., Any], tuple]] = []
        self._ready = threading.Condition()
        self._order = itertools.count()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(self, key: Key, fn: Callable[..., T], *args: Any) -> Future:
        future: Future = Future()
        with self._ready:
            heapq.heappush(self._queue, (key, next(self._order), future, fn, args))
            self._ready.notify()
        return future

    def map(self, key: Key, fn: Callable[..., T], items: Iterable[Any]) -> list[T]:
        """fn over items in parallel; the results in order (the first error is raised once all ran)."""
        futures = [self.submit(key, fn, item) for item in items]
        wait(futures)
        return [f.result() for f in futures]

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                _, _, future, fn, args = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # handed to whoever waits on the future
                future.set_exception(err)
