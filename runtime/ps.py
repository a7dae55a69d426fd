"""The parameter server: one shard of the model's variables and its optimizer.

- `Shard` serves: it parses and checks each request, applies updates to its variables with
  its optimizer and encodes replies (no gRPC in it, so tests can drive it in-process);
- runtime/consistency.py decides (sync, async, bounded: which workers are live, when a sync
  step closes, when a worker may have parameters back);
- runtime/checkpoint.py's `ShardCheckpoints` writes and restores the shard;
- `serve()` wraps a Shard in a grpcio server (the methods of wire.METHODS, raw bytes) with
  the standard health service, and its data path (runtime/datapath.py).

One RPC does push and pull together (`Step`): a request carries this worker's gradients
for the version it computed on (`tag`) and asks for the parameters back, so a step costs
one round trip per shard. Messages over wire.UNARY_MAX_BYTES use the streaming twin
(`StepStream`). Workers added by a live scale-up have a TF_CONFIG larger than this PS's:
their requests say so (`workers`) and the PS makes room for them; replies tell workers how
many slices to cut each global batch into (up to the highest live worker).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np

from tfps.api.spec import ConsistencyMode, TrainingSpec

from . import _rows, health, wire
from .auth import ServerSecurity
from .bfloat16 import narrowed
from .checkpoint import RowSnapshot, ShardCheckpoints, load_rows
from .consistency import Consistency, Push, Update
from .datapath import DataServer, split_host
from .metrics import WARM_UP_ONE_IN, PSMetrics
from .models import Param
from .optimizers import NonFiniteGradient, ShardOptimizer, sum_duplicates
from .sharding import Part, initial_part, place
from .wire import GRPC_OPTIONS, POLL_SECONDS, SERVICE

log = logging.getLogger("tfps.ps")

_BF16_EXPONENT = np.uint16(0x7F80)
DENSE_WIRE_DTYPES = ("float32", "bfloat16")  # dense gradients may come as either
MAX_WORKERS = 100_000  # bounds the worker slots a request can make a PS allocate
# How a Step reply is encoded, per transport (Shard.step's `encoding`).
ENCODERS = {"bytes": wire.encode, "chunks": wire.encode_chunks, "pieces": wire.pieces}


class Rejected(wire.WireError):
    pass


@dataclass
class _Request:
    push: Push
    pull: bool
    min_version: int
    want_dense: bool = True
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    parsed_in_c: bool = False  # taken by _rows.parse_request: rows strictly increasing, every gradient float32

    @property
    def worker(self) -> int:
        return self.push.worker

    @property
    def has_grads(self) -> bool:
        return bool(self.push.dense or self.push.sparse)


@dataclass(frozen=True)
class SharedReply:
    """A sync step's reply, the same for every worker at its version: encoded once per transport."""

    version: int
    encoding: str
    encoded: bytes | list


class Shard:
    """Serving one shard: parses and checks each request, lets `Consistency` decide, applies
    updates to the shard's variables with its optimizer, replies, and checkpoints through
    `ShardCheckpoints`. No gRPC in it, so tests can drive it in-process."""

    def __init__(
        self,
        parts: list[Part],
        params: dict[str, Param],
        training: TrainingSpec,
        num_workers: int,
        index: int,
        metrics: PSMetrics,
        checkpoint_root: str | None = None,
        worker_timeout: float = 10.0,
        startup_grace: float = 120.0,
        num_ps: int | None = None,  # the job's PS count: with it, a checkpoint of another count is re-sharded
    ):
        self.index, self.training, self.metrics = index, training, metrics
        self.mode = training.consistency.mode
        self.steps = training.steps
        self.parts = {p.name: p for p in parts}
        self.num_ps = num_ps
        self._params = list(params.values())
        self.consistency = Consistency(
            self.mode, training.consistency.staleness, num_workers, worker_timeout, startup_grace
        )
        self.max_request_bytes = wire.MAX_MESSAGE_BYTES  # streamed requests too (unary: gRPC's limit)
        self.optimizer = ShardOptimizer(training.optimizer)
        self._wire_dtype = wire.dtype(training.wire_dtype.value)  # of the dense parameters it sends
        self.incarnation = secrets.token_hex(4)
        self.cond = threading.Condition()
        self.version = 0
        self.examples = 0
        self.loss: float | None = None
        self.checkpoints = (
            ShardCheckpoints(checkpoint_root, index, metrics, training.checkpoint, self.steps)
            if checkpoint_root
            else None
        )
        self._warm: tuple[float, int] | None = None  # (time, examples) once past warm-up
        self._last_rate = 0.0
        self._shared_reply: SharedReply | None = None
        self.wire_bytes, self._count_lock = 0, threading.Lock()
        # Dense arrays are replaced by each update, never changed in place (a reader holding
        # one keeps a consistent copy); sparse tables and their slots change in place, by rows,
        # and a checkpoint or a PullFull reads them through RowSnapshots (`_row_snapshots`).
        self.vars: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self._row_snapshots: dict[str, list[RowSnapshot]] = {}
        for part in parts:
            self.vars[part.name] = np.asarray(initial_part(part, params[part.var], training.seed), np.float32)
            self.slots[part.name] = {s: self.optimizer.initial_slot(s, part.shape) for s in self.optimizer.slot_names()}
        # what a request's common shape holds, for _rows.parse_request (`_decode`)
        self._layout: dict[str, tuple] = {}
        for part in parts:
            if not part.sparse:
                self._layout[part.name] = (0, part.name, tuple(part.shape))
            elif len(part.shape) == 2:
                for kind, suffix in enumerate((":indices", ":values", ":rows"), start=1):
                    self._layout[part.name + suffix] = (kind, part.name, tuple(part.shape))
        # An async push of the usual shape is applied and answered by one C call (`_apply_async_in_c`)
        self._async_in_c = (
            self.mode is ConsistencyMode.ASYNC
            and self._wire_dtype == np.float32
            and all(part.sparse or (len(part.shape) and math.prod(part.shape)) for part in parts)
        )
        self._dense_names = tuple(part.name for part in parts if not part.sparse)
        self._restore()
        self._publish()

    @property
    def done(self) -> bool:
        return self.version >= self.steps

    @property
    def clocks(self) -> list[int]:
        return self.consistency.clocks

    @property
    def checkpoint_step(self) -> int:
        return self.checkpoints.step if self.checkpoints else -1

    def live_workers(self) -> list[int]:
        return self.consistency.live_workers()

    def _publish(self) -> None:
        """The gauges of the shard's state, read when Prometheus scrapes (not set on every request)."""
        m = self.metrics
        m.version.set_function(lambda: self.version)
        m.global_step.set_function(lambda: self.version)
        m.loss.set_function(lambda: 0.0 if self.loss is None else self.loss)
        m.workers_live.set_function(self._live_count)

    def _live_count(self) -> int:
        with self.cond:
            return len(self.live_workers())

    # ---- validation: nothing is touched until the whole request is known good ----
    def _decode(self, data: bytes | memoryview) -> _Request:
        """The request in `data`. The shape a worker sends every step is decoded and checked in one
        pass in C (_rows.parse_request); any other (a malformed one too) goes through `_parse`,
        whose checks say what is wrong."""
        fast = _rows.parse_request(data, self._layout, self.mode is ConsistencyMode.SYNC)
        if fast is None:
            return self._parse(wire.decode(data))
        meta, dense, sparse, rows = fast
        req = self._parse_fields(meta)
        req.push.dense, req.push.sparse, req.rows, req.parsed_in_c = dense, sparse, rows, True
        return req

    def _parse(self, msg: wire.Message) -> _Request:
        req = self._parse_fields(msg.meta)
        for name, arr in msg.tensors.items():
            self._parse_tensor(req, name, arr, msg.tensors)
        for name in msg.tensors:
            base, _, kind = name.partition(":")
            if kind == "indices" and base not in req.push.sparse:
                raise Rejected("malformed", f"{name!r} without {base}:values")
        return req

    def _parse_fields(self, meta: dict) -> _Request:
        try:
            worker = int(meta.get("worker", -1))
            loss = meta.get("loss")
            loss = None if loss is None else float(loss)
            push = Push(
                worker,
                int(meta.get("tag", -1)),
                int(meta.get("batch", 0)),
                loss,
                None if meta.get("seq") is None else int(meta["seq"]),
            )
            req = _Request(
                push, bool(meta.get("pull", True)), int(meta.get("min_version", 0)), bool(meta.get("dense", True))
            )
            # the cluster size in the worker's TF_CONFIG: larger than this PS's after a scale-up
            claimed = min(int(meta.get("workers", self.consistency.num_workers)), MAX_WORKERS)
        except (TypeError, ValueError, OverflowError) as err:
            raise Rejected("malformed", f"bad request fields: {wire.brief(err, 200)}") from None
        cluster = max(self.consistency.num_workers, claimed)
        if not 0 <= worker < cluster:
            raise Rejected("malformed", f"worker {worker} is not in the cluster (0..{cluster - 1})")
        if loss is not None and not math.isfinite(loss):
            raise Rejected("non_finite", "batch must be >= 0 and loss finite")
        if push.batch < 0:
            raise Rejected("malformed", "batch must be >= 0 and loss finite")
        return req

    def _parse_tensor(self, req: _Request, name: str, arr: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        base, sep, kind = name.partition(":")
        part = self.parts.get(base)
        if part is None:
            raise Rejected("unknown_variable", f"variable {wire.brief(base)} is not on PS {self.index}")
        if sep and not kind:
            raise Rejected("malformed", f"tensor {name!r}: a name that ends in ':' names no kind")
        if kind == "":
            # async and bounded: the update's own pass finds a NaN or an Inf (`_dense_updates`)
            self._check_values(name, arr, part.shape, DENSE_WIRE_DTYPES, finite=self.mode is ConsistencyMode.SYNC)
            if part.sparse:
                raise Rejected("wrong_shape", f"{name!r} is an embedding table: push rows (indices, values)")
            req.push.dense[name] = arr
        elif kind in ("indices", "rows"):
            self._check_rows(name, arr, part)
            if kind == "rows":
                req.rows[base] = arr
        elif kind == "values":
            idx = tensors.get(f"{base}:indices")
            if idx is None:
                raise Rejected("malformed", f"{name!r} without {base}:indices")
            self._check_values(name, arr, (len(idx), *part.shape[1:]))
            req.push.sparse[base] = (idx, arr)
        else:
            raise Rejected("malformed", f"tensor {name!r}: unknown kind {wire.brief(kind)}")

    @staticmethod
    def _check_rows(name: str, arr: np.ndarray, part: Part) -> None:
        if not part.sparse:
            raise Rejected("unknown_variable", f"{part.name!r} is dense: it has no rows")
        if arr.dtype != np.int64 or arr.ndim != 1:
            raise Rejected("wrong_dtype", f"{name!r}: row indices must be 1-D int64, got {arr.dtype} {list(arr.shape)}")
        try:
            _rows.check_rows(arr, part.shape[0])
        except ValueError:
            raise Rejected("out_of_range", f"{name!r}: row index outside 0..{part.shape[0] - 1}") from None

    @staticmethod
    def _check_values(
        name: str, arr: np.ndarray, shape: tuple, dtypes: tuple = ("float32",), finite: bool = True
    ) -> None:
        if wire.dtype_name(arr.dtype) not in dtypes:
            raise Rejected("wrong_dtype", f"{name!r}: expected {' or '.join(dtypes)}, got {arr.dtype}")
        if tuple(arr.shape) != tuple(shape):
            raise Rejected("wrong_shape", f"{name!r}: expected shape {list(shape)}, got {list(arr.shape)}")
        if finite and arr.size and not _finite(arr):
            raise Rejected("non_finite", f"{name!r}: gradient contains NaN or Inf")

    # ---- the update (callers hold self.cond) ----
    def _dense_updates(self, grads: dict[str, np.ndarray]) -> dict[str, tuple]:
        """The new arrays (variable, slots) of an async push's dense gradients, none kept yet;
        Rejected when one holds a NaN or an Inf (found by the update's own pass)."""
        t, out = self.version + 1, {}
        for name, grad in grads.items():
            try:
                out[name] = self.optimizer.apply_dense(self.vars[name], self.slots[name], grad, t)
            except NonFiniteGradient:
                raise Rejected("non_finite", f"{name!r}: gradient contains NaN or Inf") from None
        return out

    def _apply(self, update: Update, dense: dict[str, tuple] | None = None) -> None:
        """Apply `update`; `dense`: its dense part's new arrays, made before (`_dense_updates`)."""
        t0 = time.perf_counter()
        t = self.version + 1
        if dense is None:  # a sync step: each gradient was checked on arrival
            dense = {
                name: self.optimizer.apply_dense(
                    self.vars[name], self.slots[name], grad, t, update.plus.get(name), update.scale, check=False
                )
                for name, grad in update.dense.items()
            }
        for name, (var, slots) in dense.items():
            self.vars[name] = var
            self.slots[name].update(slots)
        for name, (rows, values) in update.sparse.items():
            rows, values = sum_duplicates(rows, values)
            for snap in self._reading(name):
                snap.before_update(rows)
            self.optimizer.apply_rows(self.vars[name], self.slots[name], rows, values, t)
        self._applied(update, t0)

    def _reading(self, name: str) -> list[RowSnapshot]:
        """The checkpoints still reading table `name` (the caller holds self.cond): an update of
        its rows must let each keep their old values first."""
        snapshots = self._row_snapshots.get(name)
        if snapshots:
            snapshots[:] = [s for s in snapshots if not s.done]
        return snapshots or []

    def _applied(self, update: Update, t0: float) -> None:
        """What follows an update applied since `t0`: the version, the counts, a checkpoint when due."""
        t = self.version = self.version + 1
        self.examples += update.examples
        if update.loss is not None:
            self.loss = update.loss
        m = self.metrics
        m.apply_seconds.observe(time.perf_counter() - t0)
        m.updates.inc()
        m.staleness.observe(update.staleness)
        m.examples.inc(update.examples)
        self._track_rate()
        if self.checkpoints and self.checkpoints.due(t):
            self.checkpoints.save(*self._snapshot())
        self.cond.notify_all()

    def _track_rate(self) -> None:
        warm_step = max(2, self.steps // WARM_UP_ONE_IN)
        now = time.monotonic()
        if self._warm is None:
            if self.version >= warm_step:
                self._warm = (now, self.examples)
        elif now > self._warm[0]:
            self._last_rate = (self.examples - self._warm[1]) / (now - self._warm[0])

    def _close_sync_step(self) -> None:
        if self.done:
            return
        update = self.consistency.close_sync()
        if update is not None:
            self._apply(update)

    def _accept(self, req: _Request) -> tuple[int, bool]:
        """Take a request's push, if any: (the version its reply waits for, stale?)."""
        target = req.min_version
        if req.has_grads and not self.done:
            if self.mode is not ConsistencyMode.SYNC:
                if self.consistency.applied(req.push):  # a retry of a push applied before whose reply was lost
                    self.metrics.duplicates.inc()
                else:
                    dense = self._dense_updates(req.push.dense)  # refuses a NaN or an Inf: nothing changed yet
                    self._apply(self.consistency.push_async(req.push, self.version), dense)
                return target, False
            if not self.consistency.push_sync(req.push, self.version):
                return target, True
            self._close_sync_step()
            return max(target, req.push.tag + 1), False
        # A sync worker waiting for a step its push never reached, or that this PS lost by
        # restarting (accumulated pushes are not checkpointed): stale, so it recomputes.
        stale = (
            self.mode is ConsistencyMode.SYNC
            and req.pull
            and target > self.version
            and req.worker not in self.consistency.pushed
            and not self.done
        )
        return target, stale

    def _wait(self, req: _Request, target: int) -> bool:
        """Wait until the worker may have parameters back; True when it must ask again (pending)."""
        deadline = time.monotonic() + POLL_SECONDS
        while not (self.done or self.consistency.ready(req.worker, self.version, target)):
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            self.cond.wait(min(left, 0.25))
            self.consistency.seen(req.worker)
            if self.mode is ConsistencyMode.SYNC:
                self._close_sync_step()
        return False

    def _seen(self, worker: int) -> tuple[int, float | None]:
        """Count `worker` as live (and as one of the cluster's, after a scale-up) for a request it
        sent; what `_unseen` needs to take that back."""
        c = self.consistency
        before = (c.num_workers, c.last_seen[worker] if worker < len(c.last_seen) else None)
        c.seen(worker)
        return before

    def _unseen(self, worker: int, before: tuple[int, float | None]) -> None:
        """Undo `_seen` for a request refused after all: a refused request leaves the workers the
        shard counts (and so the slices it tells workers to cut a batch into) as they were."""
        c = self.consistency
        num_workers, c.last_seen[worker] = before
        if c.num_workers > num_workers:
            del c.clocks[num_workers:], c.last_seen[num_workers:]
            c.num_workers = num_workers

    def _reply_meta(self, version: int, clock: int, stale: bool = False, pending: bool = False) -> dict:
        """A Step reply's meta, at `version` of this shard and the worker's `clock`."""
        return {
            "version": version,
            "done": version >= self.steps,
            "workers": self.consistency.split_size(),
            "clock": clock,
            "incarnation": self.incarnation,
            "stale": stale,
            "pending": pending,
        }

    def _takes_async_in_c(self, req: _Request, encoding: str) -> bool:
        """Whether `_apply_async_in_c` takes this request: an async push of the usual shape, asking
        for the dense parameters back, with no checkpoint reading the tables (its RowSnapshots keep
        the rows an update changes) and not a retry of one applied before."""
        return (
            self._async_in_c
            and encoding == "pieces"
            and req.parsed_in_c
            and req.has_grads
            and req.pull
            and req.want_dense
            and not self.done
            and not self.consistency.applied(req.push)
            and not any(self._reading(name) for name in req.push.sparse)
        )

    def _apply_async_in_c(self, req: _Request) -> tuple[list, int]:
        """An async push applied and its reply encoded in one C call (_rows.apply_async): the
        same updates and the same bytes as `_accept`, `_read` and wire.pieces make, in less CPU.
        The reply's pieces and its size. Its apply time (tfps_ps_apply_seconds) counts the
        reply's rows read back and its header too: they are made in the same call."""
        push, t = req.push, self.version + 1
        meta = self._reply_meta(t, self.clocks[push.worker] + 1)  # as they will be once the push is applied
        t0 = time.perf_counter()
        opt, hyper = self.optimizer.kernel_args(t)
        out = _rows.apply_async(
            opt,
            hyper,
            self.optimizer.slot_names(),
            self.vars,
            self.slots,
            push.dense,
            push.sparse,
            req.rows,
            self._dense_names,
            wire.json_dumps(meta),
        )
        if isinstance(out, str):
            raise Rejected("non_finite", f"{out!r}: gradient contains NaN or Inf")
        self._applied(self.consistency.push_async(push, self.version), t0)
        return out

    def step(self, data: bytes | memoryview, encoding: str = "bytes") -> bytes | list:
        """Handle one Step request (push and/or pull); raises Rejected on bad input.
        The reply is encoded for its transport (ENCODERS): one message for a unary call,
        its chunks for the streaming call, its uncopied pieces for the data path."""
        try:
            req = self._decode(data)
        except wire.WireError as err:
            raise Rejected(err.reason, str(err)) from None
        self._count(self.metrics.bytes_in, len(data))
        with self.cond:
            seen_before = self._seen(req.worker)
            try:
                if self._takes_async_in_c(req, encoding):
                    out, nbytes = self._apply_async_in_c(req)
                    self._count(self.metrics.bytes_out, nbytes)
                    return out
                try:
                    target, stale = self._accept(req)
                    pending = req.pull and not stale and self._wait(req, target)
                finally:  # a sync push the step has not taken outlives its request's buffer
                    self.consistency.keep(req.worker)
            except Rejected:  # a NaN or an Inf found by the update's own pass: nothing changed, the worker neither
                self._unseen(req.worker, seen_before)
                raise
            # In sync mode every worker gets the same reply for a version: encode it once.
            shared = (
                self.mode is ConsistencyMode.SYNC and req.pull and req.want_dense and not (stale or pending or req.rows)
            )
            reuse = self._shared_reply
            if shared and reuse is not None and (reuse.version, reuse.encoding) == (self.version, encoding):
                out = reuse.encoded
                self._count(self.metrics.bytes_out, _size(out))
                return out
            meta = self._reply_meta(self.version, 0 if shared else self.clocks[req.worker], stale, pending)
            tensors = self._read(req) if req.pull and not pending else {}
        # Serialise outside the lock: the tensors read above are copies (rows) or dense
        # arrays that updates replace rather than change.
        out = ENCODERS[encoding](meta, tensors)
        if shared:
            self._shared_reply = SharedReply(meta["version"], encoding, out)
        self._count(self.metrics.bytes_out, _size(out))
        return out

    def _count(self, counter, nbytes: int) -> None:
        """Bytes of Step and PullFull messages, either way (also in status(): `wire_bytes`)."""
        counter.inc(nbytes)
        with self._count_lock:
            self.wire_bytes += nbytes

    def _read(self, req: _Request) -> dict:
        tensors = {}
        for name, var in self.vars.items():
            if req.want_dense and not self.parts[name].sparse:
                tensors[name] = narrowed(var, self._wire_dtype)
        for name, idx in req.rows.items():
            table = self.vars[name]
            tensors[f"{name}:rows"] = out = np.empty((len(idx), *table.shape[1:]), table.dtype)
            _rows.take(table, idx, out)
        return tensors

    def pull_full(self) -> list[bytes]:
        """Every part whole, embedding tables included (for export and evaluation), as chunks."""
        with self.cond:
            tensors = {name: self._read_whole(name, var) for name, var in self.vars.items()}
            meta = {"version": self.version, "done": self.done, "incarnation": self.incarnation}
        out = wire.encode_chunks(meta, tensors)
        self._count(self.metrics.bytes_out, _size(out))
        return out

    def status(self) -> dict:
        with self.cond:
            return {
                "ps": self.index,
                "version": self.version,
                "global_step": self.version,
                "steps": self.steps,
                "done": self.done,
                "loss": self.loss,
                "examples": self.examples,
                "examples_per_second": self._last_rate,
                "workers_live": len(self.live_workers()),
                "incarnation": self.incarnation,
                "checkpoint_step": self.checkpoint_step,
                "wire_bytes": self.wire_bytes,
            }

    # ---- checkpoints ----
    def _expected_parts(self) -> dict[str, list[int]]:
        return {n: list(p.shape) for n, p in self.parts.items()}

    def _read_whole(self, name: str, array: np.ndarray) -> np.ndarray | RowSnapshot:
        """`array` (part `name`'s variable or slot) as it is now, to be read outside the lock
        without a copy of a table (the caller holds the lock)."""
        if not self.parts[name].sparse:
            return array
        snap = RowSnapshot(array, self.cond)
        self._row_snapshots.setdefault(name, []).append(snap)
        return snap

    def _snapshot(self) -> tuple[dict, dict]:
        tensors = {}
        for name, var in self.vars.items():
            tensors[name] = self._read_whole(name, var)
            for slot, svar in self.slots[name].items():
                tensors[f"{name}:slot:{slot}"] = self._read_whole(name, svar)
        meta = {
            "version": self.version,
            "clocks": list(self.clocks),
            "examples": self.examples,
            "loss": self.loss,
            "optimizer": self.optimizer.name.value,
            "parts": self._expected_parts(),
            "num_ps": self.num_ps,
        }
        return meta, tensors

    def checkpoint_now(self) -> int:
        """Write a checkpoint of the current state and wait for it; returns its step."""
        if not self.checkpoints:
            return -1
        with self.cond:
            if self.version <= self.checkpoints.step:
                return self.checkpoints.step
            meta, tensors = self._snapshot()
        self.checkpoints.save(meta, tensors, wait=True)
        return self.checkpoints.step

    def _restore(self) -> None:
        if not self.checkpoints:
            return
        msg = self.checkpoints.load(
            list(self.parts.values()), self.optimizer.name.value, self.num_ps, lambda n: place(self._params, n)
        )
        if msg is None:
            return
        for name, var in self.vars.items():
            load_rows(var, msg.tensors[name])
            for slot, svar in self.slots[name].items():
                load_rows(svar, msg.tensors[f"{name}:slot:{slot}"])
        meta = msg.meta
        self.version = int(meta["version"])
        clocks = [int(c) for c in meta.get("clocks", [])]
        self.consistency.grow(len(clocks))
        self.clocks[: len(clocks)] = clocks
        self.examples = int(meta.get("examples", 0))
        self.loss = meta.get("loss")

    def close(self) -> None:
        if self.checkpoints:
            self.checkpoints.close()


def _finite(arr: np.ndarray) -> bool:
    """No NaN or Inf in `arr` (float32 or bfloat16)."""
    if wire.dtype_name(arr.dtype) == "bfloat16":
        # NaN and Inf are the values whose 8 exponent bits are all set
        return not np.any((arr.view(np.uint16) & _BF16_EXPONENT) == _BF16_EXPONENT)
    return _rows.finite(arr)


def _size(out: bytes | list) -> int:
    return len(out) if isinstance(out, bytes) else sum(len(c) for c in out)


def _refuser(shard: Shard):
    """Counts and logs a refused request (either transport)."""

    def refused(reason: str, detail: str) -> None:
        shard.metrics.rejected.labels(reason=reason).inc()
        log.warning(json.dumps({"event": "rejected", "ps": shard.index, "reason": reason, "detail": detail}))

    return refused


def _handlers(shard: Shard, data_port: int | None, refused) -> grpc.GenericRpcHandler:
    def guarded(fn, data: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return fn(data)
        except Rejected as err:
            refused(err.reason, str(err))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err.reason}: {err}")
        except Exception:  # a bug of the PS's, not of the request: said as such, counted, and the PS goes on
            log.exception("a Step request met an unexpected error")
            refused(wire.INTERNAL_REASON, "unexpected error (see the PS's log)")
            context.abort(grpc.StatusCode.INTERNAL, f"{wire.INTERNAL_REASON}: unexpected error in the PS")

    def step(request: bytes, context) -> bytes:
        return guarded(shard.step, request, context)

    def step_stream(request_iterator, context):
        def joined_step(chunks) -> list[bytes]:
            try:
                data = wire.join(chunks, limit=shard.max_request_bytes)
            except wire.WireError as err:
                raise Rejected(err.reason, str(err)) from None
            return shard.step(data, encoding="chunks")

        return iter(guarded(joined_step, request_iterator, context))

    def pull_full(request: bytes, context):
        return iter(shard.pull_full())

    def status(request: bytes, context) -> bytes:
        return json.dumps({**shard.status(), "data_port": data_port}).encode()

    def finish(request: bytes, context) -> bytes:
        step = shard.checkpoint_now()
        return json.dumps({"checkpoint_step": step, **shard.status()}).encode()

    implementations = {
        "Step": step,
        "StepStream": step_stream,
        "PullFull": pull_full,
        "Status": status,
        "Finish": finish,
    }
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            name: getattr(grpc, f"{shape}_rpc_method_handler")(implementations[name])
            for name, shape in wire.METHODS.items()
        },
    )


class PSServer:
    """The PS's gRPC server and its data path (runtime/datapath.py), stopped together."""

    def __init__(self, grpc_server: grpc.Server, data: DataServer | None):
        self.grpc, self.data = grpc_server, data

    @property
    def data_port(self) -> int | None:
        return self.data.port if self.data is not None else None

    def stop(self, grace: float | None):
        if self.data is not None:
            self.data.close()
        return self.grpc.stop(grace)


def serve(
    shard: Shard, address: str, max_workers: int = 16, security: ServerSecurity | None = None, data_port: int | None = 0
) -> tuple[PSServer, int]:
    """Start the gRPC server for `shard` on `address` (host:port), and its data path on
    `data_port` of the same host (0: any free port; None: no data path, Steps over gRPC
    only); returns them and the bound gRPC port. Without `security` both are open and
    plaintext (tests on loopback)."""
    security = security or ServerSecurity(None)
    refused, data = _refuser(shard), None
    if data_port is not None:
        data = DataServer(shard, split_host(address), data_port, security.material, refused)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ps-rpc"),
        options=GRPC_OPTIONS,
        interceptors=security.interceptors(shard.metrics, shard.index),
    )
    server.add_generic_rpc_handlers(
        (_handlers(shard, data.port if data else None, refused), health.handler(("", SERVICE)))
    )
    port = security.add_port(server, address)
    if port == 0:
        if data is not None:
            data.close()
        raise OSError(f"cannot bind the PS gRPC server on {address}")
    server.start()
    return PSServer(server, data), port
