"""A PS shard's consistency bookkeeping (spec.training.consistency.mode), without TensorFlow
or gRPC: which workers are live, each worker's clock, the sync step's accumulators, and when a
worker may get parameters back. runtime/ps.py applies what this decides.

- sync: gradients tagged with the current version are summed; the step closes when every
  live worker has pushed, and the mean is applied once. A push for another version is stale.
  The push that closes the step is not added to the sum: the optimizer adds it and divides
  in its own pass over the variable (two passes fewer while every worker waits).
- async: each push is applied on arrival, once (`seq` recognises a retried push).
- bounded: async, and a worker more than `staleness` pushes ahead of the slowest live
  worker waits before it gets parameters back.
A worker is live when it made a call within `worker_timeout` seconds; a worker never seen
counts as live for `startup_grace` seconds after the PS started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tfps.api.spec import ConsistencyMode

from . import wire
from .bfloat16 import as_float32

Sparse = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class Update:
    """What to apply as one optimizer step: each dense gradient is (dense + plus) * scale."""

    dense: dict[str, np.ndarray]
    sparse: Sparse
    examples: int
    loss: float | None
    staleness: int = 0
    plus: dict[str, np.ndarray] = field(default_factory=dict)
    scale: float = 1.0


@dataclass
class Push:
    worker: int
    tag: int  # the version the gradients were computed on
    batch: int
    loss: float | None
    seq: int | None = None  # async/bounded: this worker's pushes the shard had applied when it sent this one
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    sparse: Sparse = field(default_factory=dict)


class Consistency:
    def __init__(
        self,
        mode: ConsistencyMode,
        staleness: int,
        num_workers: int,
        worker_timeout: float = 10.0,
        startup_grace: float = 120.0,
    ):
        self.mode, self.bound = mode, staleness
        self.num_workers = num_workers
        self.worker_timeout, self.startup_grace = worker_timeout, startup_grace
        self.started = time.monotonic()
        self.clocks = [0] * num_workers
        self.last_seen: list[float | None] = [None] * num_workers
        self.reset()

    def reset(self) -> None:
        """Empty the sync step's accumulators."""
        self.pushed: set[int] = set()
        self._acc: dict[str, np.ndarray] = {}
        # Per worker, in push order, the dense gradients of a push whose request is still being
        # answered: views of that request, not copied (`keep`).
        self._held: dict[int, dict[str, np.ndarray]] = {}
        self._sparse_acc: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._acc_loss: list[float] = []
        self._acc_examples = 0

    # ---- workers ----
    def seen(self, worker: int) -> None:
        self.grow(worker + 1)
        self.last_seen[worker] = time.monotonic()

    def grow(self, num_workers: int) -> None:
        """Make room for workers added by a live scale-up (their TF_CONFIG is newer than ours)."""
        extra = num_workers - self.num_workers
        if extra > 0:
            self.clocks += [0] * extra
            self.last_seen += [None] * extra
            self.num_workers = num_workers

    def live_workers(self) -> list[int]:
        now = time.monotonic()
        live = []
        for w, seen in enumerate(self.last_seen):
            if seen is None:
                if now - self.started < self.startup_grace:
                    live.append(w)
            elif now - seen < self.worker_timeout:
                live.append(w)
        return live

    def split_size(self) -> int:
        """How many slices the workers cut each global batch into: up to the highest live
        worker (so a scale-down stops leaving slices unread once the removed workers are gone)."""
        live = self.live_workers()
        return max(live) + 1 if live else self.num_workers

    # ---- pushes ----
    def push_sync(self, push: Push, version: int) -> bool:
        """Accumulate a sync push; False when it is stale (computed on another version)."""
        if push.tag != version:
            return False
        if push.worker in self.pushed:
            return True  # a retried push of this step; counted once
        self._held[push.worker] = dict(push.dense)
        for name, (idx, values) in push.sparse.items():
            self._sparse_acc.setdefault(name, []).append((idx.copy(), values.copy()))
        self.pushed.add(push.worker)
        self._acc_examples += push.batch
        if push.loss is not None:
            self._acc_loss.append(push.loss)
        return True

    def keep(self, worker: int) -> None:
        """Add `worker`'s push to the step's sum if the step has not taken it yet. Its gradients
        are views of its request, whose buffer the PS reads the next request into once this one
        is answered: call this before it is. A step that closes while every pusher still waits
        (the usual sync step) copies none of them."""
        grads = self._held.pop(worker, None)
        for name, grad in (grads or {}).items():
            self._add(name, grad)

    def _add(self, name: str, grad: np.ndarray) -> None:
        grad = as_float32(grad)  # bfloat16 off the wire, widened in one pass
        acc = self._acc.get(name)
        if acc is None:
            acc = self._acc[name] = wire.aligned_array(grad.shape, np.float32)
            acc[...] = grad
        else:
            np.add(acc, grad, out=acc)

    def close_sync(self) -> Update | None:
        """The sync step's mean, once every live worker has pushed; None before. Its dense part
        is each gradient's sum as (grad + plus), to be scaled by 1/n in the update's own pass: the
        sum kept so far and the held pushes, the last held one as `plus` (with two workers whose
        requests both wait: the first push and the second, neither copied)."""
        if not self.pushed or not set(self.live_workers()) <= self.pushed:
            return None
        scale = np.float32(1.0 / len(self.pushed))
        held = list(self._held.values())
        dense, plus = {}, {}
        for name in dict.fromkeys(n for grads in (self._acc, *held) for n in grads):
            pushes = [grads[name] for grads in held if name in grads]
            if len(pushes) + (name in self._acc) > 2:  # more than two terms: all but the last push summed here
                for grad in pushes[:-1]:
                    self._add(name, grad)
                pushes = pushes[-1:]
            terms = [*([self._acc[name]] if name in self._acc else []), *pushes]
            dense[name] = terms[0]
            if len(terms) == 2:
                plus[name] = terms[1]
        sparse = {
            name: (np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces]) * scale)
            for name, pieces in self._sparse_acc.items()
        }
        update = Update(
            dense,
            sparse,
            self._acc_examples,
            float(np.mean(self._acc_loss)) if self._acc_loss else None,
            plus=plus,
            scale=float(scale),
        )
        self.reset()
        return update

    def applied(self, push: Push) -> bool:
        """Whether an async push is a retry of one applied before (whose reply was lost)."""
        return push.seq is not None and push.seq < self.clocks[push.worker]

    def push_async(self, push: Push, version: int) -> Update:
        """The update an async push makes (one not `applied` before)."""
        self.clocks[push.worker] += 1
        staleness = version - push.tag if push.tag >= 0 else 0
        return Update(push.dense, push.sparse, push.batch, push.loss, max(0, staleness))

    def ready(self, worker: int, version: int, target: int) -> bool:
        """Whether `worker` may get parameters back now (it asked for `target` or later)."""
        if self.mode is ConsistencyMode.SYNC:
            return version >= target
        if self.mode is ConsistencyMode.BOUNDED:
            live = self.live_workers() or [worker]
            return self.clocks[worker] - min(self.clocks[w] for w in live) <= self.bound
        return True
