"""The CPU of one PS request, in one process: tfps's PS against the reference's answering process.

`python -m tfps.bench.ps_request --shape 2M --optimizer adam`

A large-embedding job's examples/s on a machine its processes share follows the CPU each worker
step costs all processes together, and a full run's figures drift within minutes. This
measures one part of that cost without sockets, other processes or drift: for each PS of the
shape, the same pushes (the ids of real batches of the shape's data, the rows the next batch
asks for back, random gradients) go as tfps's Step requests to a `Shard` (runtime/ps.py, as the
PS's data path hands them over) and as the sharded reference's pushes to an answering process
(bench/limit.py's `Answerer`, the limit + update over as many answering processes as the shape
has PS). Both apply the same updates with the same C kernels; what differs is what each does
around them (decoding and checking a request, bookkeeping, metrics, the reply). A third side,
the kernels, makes the reference's kernel calls alone on its pushes taken apart beforehand: the
floor of a request path with no Python in it. The three take turns in blocks of `--requests`,
`--repeats` times, each request first copied into the side's receive buffer as its server's
receive copies it. It prints, per PS, each side's median CPU microseconds a request and tfps's
over the reference's, and checks that tfps and the reference, given each push once before the
timed blocks, ended with the same parameters and slots. What was made before the timed blocks
is out of the garbage collector's sight, as in the PS and the reference's processes
(runtime/process.py's `freeze_startup_objects`): else each full collection would scan the
model's and the pushes' objects again, charged to the side that allocates most (tfps).

With nothing else running between requests, a request's code and rows stay warmer in the
caches than in a real job, whose workers compute between a PS's requests: the figures are a
floor of what a request costs live. `--evict-mib N` writes N MiB between requests (untimed),
which leaves a request nothing of its own in the caches: a ceiling of what the caches add. Live
lies between the two.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np

from tfps.runtime import wire
from tfps.runtime.sharding import batch_ids

from .embedding import ADAM_LEARNING_RATE, OPTIMIZERS, QUICK_SHAPE, SHAPES, EmbeddingShape, load
from .limit import Answerer, Shards, _RowsLayout, padded

MODULE = "tfps.bench.ps_request"
GRADIENT_SCALE = 1e-3  # small enough that no update takes a parameter anywhere unusual
DISTINCT_STEPS = 64  # distinct pushes cycled through
SIDES = ("tfps", "reference", "kernels")
SGD_LEARNING_RATE = 0.01  # `tfps bench`'s default


class Pushes:
    """The same pushes for one PS, as tfps's Step requests and as the reference's bytes.

    Step `s` is worker `s % workers`' batch `s // workers`: its gradients (every dense
    variable's, and one row per distinct id of each table) and the rows of the worker's next
    batch asked for back, split by tfps's placement as a tfps worker splits them
    (runtime/worker.py) and as the reference's workers do (bench/limit.py's `Shards`)."""

    def __init__(self, shape: EmbeddingShape, ps: int, steps: int = DISTINCT_STEPS, seed: int = 0):
        from tfps.runtime.models import BatchSource

        self.model = load(shape, seed)
        self.shards = Shards(self.model.params, shape.ps)
        self.ps = ps
        dense_size, tables = self.shards.answerer(ps)
        self.layout = _RowsLayout(dense_size, [width for _, width in tables])
        train, _ = self.model.data()
        sources = [BatchSource(train, seed, shape.batch, w, shape.workers) for w in range(shape.workers)]
        rng = np.random.default_rng(seed)
        self.tfps: list[memoryview] = []
        self.reference: list[memoryview] = []
        for step in range(steps):
            worker, batch = step % shape.workers, step // shape.workers
            ids, ahead = (self._distinct(sources[worker](b)[0]) for b in (batch, batch + 1))
            grads = {
                p.name: (
                    rng.standard_normal((len(ids[p.name]), *p.shape[1:]) if p.sparse else p.shape) * GRADIENT_SCALE
                ).astype(np.float32)
                for p in self.model.params
            }
            # no sequence number: the pushes are cycled through, and a PS applies a numbered push once
            meta = {
                "worker": worker,
                "workers": shape.workers,
                "tag": step,
                "pull": True,
                "batch": shape.batch,
                "loss": 0.5,
            }
            routes, routes_ahead = ({t: self.shards.routes(t, rows) for t, rows in d.items()} for d in (ids, ahead))
            self.tfps.append(memoryview(wire.encode(meta, self._step_tensors(grads, routes, routes_ahead))))
            push = self.layout.push(
                self.shards.pushes(grads, routes)[ps], self.shards.ids(ps, routes), self.shards.ids(ps, routes_ahead)
            )
            self.reference.append(memoryview(b"".join(np.ascontiguousarray(a).tobytes() for a in push)))
        # the reference's pushes with what they hold already taken apart: the kernels' side
        self.kernels = [(push, self.layout.split(push)) for push in self.reference]

    def _distinct(self, x: dict) -> dict[str, np.ndarray]:
        """Per table, the batch's distinct ids (tfps's `batch_ids`, as both sides' workers number them)."""
        return {p.name: batch_ids(x[p.feature])[0] for p in self.model.sparse_params}

    def _step_tensors(self, grads: dict, routes: dict, ahead: dict) -> dict[str, np.ndarray]:
        """This PS's tensors of a worker's Step, as a worker makes them (runtime/sharding.py's
        `split_push`, then `rows_asked`); `routes`, `ahead`: per table, `Shards.routes`."""
        plan = self.shards.plan
        dense = [p.name for p in self.model.params if not p.sparse]

        def routed(table_routes: dict) -> dict:  # Shards.routes' per table as route_rows' output
            return {
                t: [(q, *by_part[q.name]) for q in plan.parts_of(t) if q.name in by_part]
                for t, by_part in table_routes.items()
            }

        return {**plan.split_push(dense, grads, routed(routes))[self.ps], **plan.rows_asked(routed(ahead))[self.ps]}


def _receive(inbox: np.ndarray, request: memoryview) -> memoryview:
    """`request` copied into `inbox`, as a server's receive copies it from the socket: the bytes
    a request is read from are in the caches as they are after a receive, no more, no less."""
    view = memoryview(inbox)[: len(request)]
    view[:] = request
    return view


class Sides:
    """PS `pushes.ps` twice, from the same initial parameters: tfps's `Shard` and the reference's
    `Answerer` (bench/limit.py, its dense parts as one padded vector, its tables whole), whose
    kernels are also called alone (`kernels`). Each side is a call taking one of its requests."""

    def __init__(self, shape: EmbeddingShape, pushes: Pushes, optimizer: str, learning_rate: float):
        from tfps.api.spec import TrainingSpec
        from tfps.runtime.metrics import Identity, PSMetrics
        from tfps.runtime.ps import Shard

        training = TrainingSpec.model_validate(
            {
                "model": shape.model,
                "modelArgs": shape.model_args,
                "optimizer": {"name": optimizer, "learningRate": learning_rate},
                "batchSize": shape.batch,
                "steps": 1 << 40,
                "consistency": {"mode": "async"},
            }
        )
        params, k = pushes.model.params, pushes.ps
        self.shards, self.k = pushes.shards, k
        self.shard = Shard(
            list(self.shards.plan.for_ps(k)),
            {p.name: p for p in params},
            training,
            shape.workers,
            k,
            PSMetrics(Identity("ps-request", "bench", "ps", k)),
            num_ps=shape.ps,
        )
        # each side's receive buffer, reused request after request as each side's server reuses its own
        self._inbox, self._reference_inbox = (
            wire.aligned_empty(max(map(len, requests))) for requests in (pushes.tfps, pushes.reference)
        )
        dense_size, tables = self.shards.answerer(k)
        self.answerer = Answerer("async", learning_rate, optimizer, dense_size, tables)
        self.answerer.params = self._reference_dense(self.shard.vars)
        for (table, slots), part in zip(self.answerer.tables, self.shards.tables[k], strict=True):
            table[...] = self.shard.vars[part.name]
            for name, slot in slots.items():
                slot[...] = self.shard.slots[part.name][name]

    def _reference_dense(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """This PS's dense parts (`arrays`, by part name) as the reference holds them: one padded vector."""
        return np.concatenate(
            padded([np.asarray(arrays[q.name], np.float32).reshape(-1) for q in self.shards.dense[self.k]])
        )

    def tfps(self, request: memoryview) -> None:
        self.shard.step(_receive(self._inbox, request), encoding="pieces")

    def reference(self, request: memoryview) -> None:
        self.answerer._answer_rows(_receive(self._reference_inbox, request))

    def kernels(self, request: tuple) -> None:
        """The reference's request with nothing around its kernels (its push received, taken apart
        beforehand): its update and gather alone (`Answerer.update_rows`), with no framing of the
        reply. The floor of a request path with no Python in it, but for these few calls."""
        push, parts = request
        _receive(self._reference_inbox, push)
        self.answerer.update_rows(*parts)

    def differences(self) -> list[str]:
        """The parameters and slots that differ between the two sides (none: both applied the same updates alike)."""
        out = [] if np.array_equal(self._reference_dense(self.shard.vars), self.answerer.params) else ["dense"]
        for name, slot in self.answerer.slots.items():
            if not np.array_equal(
                self._reference_dense({q.name: self.shard.slots[q.name][name] for q in self.shards.dense[self.k]}), slot
            ):
                out.append(f"dense:{name}")
        for (table, slots), part in zip(self.answerer.tables, self.shards.tables[self.k], strict=True):
            if not np.array_equal(table, self.shard.vars[part.name]):
                out.append(part.name)
            out += [
                f"{part.name}:{name}"
                for name, slot in slots.items()
                if not np.array_equal(slot, self.shard.slots[part.name][name])
            ]
        return out


def cpu_per_request(side, requests: list[memoryview], count: int, evict: np.ndarray | None = None) -> float:
    """CPU microseconds a request of `side`, over `count` requests cycling through `requests`;
    with `evict`, every byte of it written before each request (not timed)."""
    if evict is None:
        start = time.thread_time()
        for i in range(count):
            side(requests[i % len(requests)])
        return (time.thread_time() - start) / count * 1e6
    spent = 0.0
    for i in range(count):
        np.add(evict, 1, out=evict)
        start = time.thread_time()
        side(requests[i % len(requests)])
        spent += time.thread_time() - start
    return spent / count * 1e6


def measure(
    shape: EmbeddingShape, optimizer: str, ps: int, count: int, repeats: int, seed: int = 0, evict_mib: int = 0
) -> dict:
    from tfps.runtime.process import freeze_startup_objects

    learning_rate = ADAM_LEARNING_RATE if optimizer == "adam" else SGD_LEARNING_RATE
    pushes = Pushes(shape, ps, seed=seed)
    sides = Sides(shape, pushes, optimizer, learning_rate)
    for request, push in zip(
        pushes.tfps, pushes.reference, strict=True
    ):  # the same pushes, one each, in the same order
        sides.tfps(request)
        sides.reference(push)
    differ = sides.differences()
    evict = np.zeros(evict_mib << 20, np.uint8) if evict_mib else None
    figures: dict[str, list[float]] = {name: [] for name in SIDES}
    freeze_startup_objects()
    try:
        for repeat in range(repeats):  # each goes first in turn
            for name in SIDES[repeat % len(SIDES) :] + SIDES[: repeat % len(SIDES)]:
                figures[name].append(cpu_per_request(getattr(sides, name), getattr(pushes, name), count, evict))
    finally:
        gc.unfreeze()  # a caller that goes on (a test) has its collector back whole
    medians = {name: statistics.median(figures[name]) for name in SIDES}
    return {
        "shape": shape.name,
        "optimizer": optimizer,
        "ps": ps,
        "requests": count,
        "evict_mib": evict_mib,
        **{f"{name}_us": medians[name] for name in SIDES},
        "ratio": medians["tfps"] / medians["reference"],
        **{f"{name}_repeats": figures[name] for name in SIDES},
        "request_bytes": len(pushes.tfps[0]),
        "reference_bytes": len(pushes.reference[0]),
        "differences": differ,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, QUICK_SHAPE.name], default="2M")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    parser.add_argument("--ps", type=int, nargs="*", help="which PS (default: each)")
    parser.add_argument("--requests", type=int, default=2000, help="requests a side takes in turn")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--evict-mib",
        type=int,
        default=0,
        help="MiB written between requests, untimed (0: none; more than the last-level cache: a cold request)",
    )
    args = parser.parse_args(argv)
    shape = SHAPES.get(args.shape, QUICK_SHAPE)
    which = args.ps if args.ps else list(range(shape.ps))
    if args.evict_mib < 0:
        parser.error("--evict-mib: a count of MiB, 0 or more")
    if any(not 0 <= ps < shape.ps for ps in which):
        parser.error(f"--ps: the {shape.name} shape has PS 0..{shape.ps - 1}")
    failed = False
    for ps in which:
        result = measure(shape, args.optimizer, ps, args.requests, args.repeats, evict_mib=args.evict_mib)
        print(json.dumps(result), flush=True)
        if result["differences"]:
            failed = True
            print(
                f"PS {ps}: tfps and the reference ended with different {', '.join(result['differences'])}",
                file=sys.stderr,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
