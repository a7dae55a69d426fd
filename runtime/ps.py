"""The parameter server: one shard of the model's variables and its optimizer.

`Shard` holds the state and the consistency logic (no gRPC in it, so tests can drive it
in-process); `serve()` wraps it in a grpcio server with generic handlers on raw bytes and
the standard health service.

One RPC does push and pull together (`Step`): a request carries this worker's gradients
for the version it computed on (`tag`) and asks for the parameters back, so a step costs
one round trip per shard. Messages over wire.UNARY_MAX_BYTES use the streaming twin
(`StepStream`).

Consistency (spec.training.consistency.mode):
- sync: gradients tagged with the current version are summed; the step closes when every
  live worker has pushed; the mean is applied once and the version bumped. A push for an
  older version is dropped (`stale`), the worker pulls and recomputes.
- async: each push is applied on arrival, once: a push carries `seq`, the number of this
  worker's pushes the shard had applied when the worker last heard from it, so a retried
  push whose reply was lost is recognised and not applied again.
- bounded: async, and a worker more than `staleness` steps ahead of the slowest live
  worker (stale synchronous parallel clocks) waits before it gets parameters back.
A worker is live when it made a call within `worker_timeout` seconds; a worker never
seen counts as live for `startup_grace` seconds after this PS started. Workers added by a
live scale-up have a TF_CONFIG larger than this PS's: their requests say so (`workers`)
and the PS makes room for them; replies tell workers how many slices to cut each global
batch into (up to the highest live worker).
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
import tensorflow as tf
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tfps.api.spec import ConsistencyMode, TrainingSpec

from . import checkpoint, wire
from .auth import ServerSecurity
from .datapath import DataServer, split_host
from .metrics import PSMetrics
from .models import Param
from .optimizers import ShardOptimizer
from .sharding import Part, initial_part
from .wire import GRPC_OPTIONS, POLL_SECONDS, SERVICE

log = logging.getLogger("tfps.ps")

BFLOAT16 = np.dtype(wire.DTYPES["bfloat16"])
_BF16_EXPONENT = np.uint16(0x7F80)
DENSE_WIRE_DTYPES = (np.dtype(np.float32), BFLOAT16)  # dense gradients may come as either
MAX_WORKERS = 100_000  # bounds the worker slots a request can make a PS allocate
# How a Step reply is encoded, per transport (Shard.step's `encoding`).
ENCODERS = {"bytes": wire.encode, "chunks": wire.encode_chunks, "pieces": wire.pieces}


class Rejected(wire.WireError):
    pass


@dataclass
class _Request:
    worker: int
    tag: int
    pull: bool
    min_version: int
    batch: int
    loss: float | None
    want_dense: bool = True
    seq: int | None = None  # async/bounded: this worker's pushes this shard had applied when it sent this one
    dense: dict[str, np.ndarray] = field(default_factory=dict)
    sparse: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def has_grads(self) -> bool:
        return bool(self.dense or self.sparse)


class Shard:
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
    ):
        self.index, self.training, self.metrics = index, training, metrics
        self.num_workers = num_workers
        self.mode = training.consistency.mode
        self.bound = training.consistency.staleness
        self.steps = training.steps
        self.parts = {p.name: p for p in parts}
        self.worker_timeout, self.startup_grace = worker_timeout, startup_grace
        self.max_request_bytes = wire.MAX_MESSAGE_BYTES  # streamed requests too (unary: gRPC's limit)
        self.optimizer = ShardOptimizer(training.optimizer)
        self._wire_dtype = tf.as_dtype(training.wire_dtype.value)  # of the dense parameters it sends
        self.incarnation = secrets.token_hex(4)
        self.cond = threading.Condition()
        self.started = time.monotonic()
        self.version = 0
        self.clocks = [0] * num_workers
        self.last_seen: list[float | None] = [None] * num_workers
        self.examples = 0
        self.loss: float | None = None
        self.checkpoint_dir = checkpoint.shard_dir(checkpoint_root, index) if checkpoint_root else None
        self.checkpoint_step = -1
        self._ckpt_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt")
        self._warm: tuple[float, int] | None = None  # (time, examples) once past warm-up
        self._last_rate = 0.0
        self._shared_reply: tuple = (-1, False, b"")
        self.vars: dict[str, tf.Variable] = {}
        self.slots: dict[str, dict[str, tf.Variable]] = {}
        for part in parts:
            value = initial_part(part, params[part.var], training.seed)
            self.vars[part.name] = tf.Variable(value, name=part.name.replace("/", "_"))
            self.slots[part.name] = {
                s: tf.Variable(self.optimizer.initial_slot(s, value.shape), name=f"{part.name.replace('/', '_')}_{s}")
                for s in self.optimizer.slot_names()
            }
        dense_vars = {n: v for n, v in self.vars.items() if not self.parts[n].sparse}
        self._apply_dense = self.optimizer.dense_applier(dense_vars, self.slots)
        self._reset_accumulators()
        self._restore()
        self._publish()

    # ---- state helpers (callers hold self.cond) ----
    def _reset_accumulators(self) -> None:
        self._pushed: set[int] = set()
        self._acc: dict[str, np.ndarray] = {}
        self._sparse_acc: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._acc_loss: list[float] = []
        self._acc_examples = 0
        self._acc_tags: list[int] = []

    @property
    def done(self) -> bool:
        return self.version >= self.steps

    def _seen(self, worker: int) -> None:
        self._grow(worker + 1)
        self.last_seen[worker] = time.monotonic()

    def _grow(self, num_workers: int) -> None:
        """Make room for workers added by a live scale-up (their TF_CONFIG is newer than ours)."""
        extra = num_workers - self.num_workers
        if extra > 0:
            self.clocks += [0] * extra
            self.last_seen += [None] * extra
            self.num_workers = num_workers

    def split_size(self) -> int:
        """How many slices the workers cut each global batch into: up to the highest live
        worker (so a scale-down stops leaving slices unread once the removed workers are gone)."""
        live = self.live_workers()
        return max(live) + 1 if live else self.num_workers

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

    def _publish(self) -> None:
        m = self.metrics
        m.version.set(self.version)
        m.global_step.set(self.version)
        if self.loss is not None:
            m.loss.set(self.loss)

    # ---- validation: nothing is touched until the whole request is known good ----
    def _parse(self, msg: wire.Message) -> _Request:
        meta = msg.meta
        try:
            worker = int(meta.get("worker", -1))
            tag = int(meta.get("tag", -1))
            pull = bool(meta.get("pull", True))
            min_version = int(meta.get("min_version", 0))
            batch = int(meta.get("batch", 0))
            loss = meta.get("loss")
            loss = None if loss is None else float(loss)
            seq = None if meta.get("seq") is None else int(meta["seq"])
            # the cluster size in the worker's TF_CONFIG: larger than this PS's after a scale-up
            claimed = min(int(meta.get("workers", self.num_workers)), MAX_WORKERS)
        except (TypeError, ValueError) as err:
            raise Rejected("malformed", f"bad request fields: {err}") from None
        if not 0 <= worker < max(self.num_workers, claimed):
            raise Rejected("malformed", f"worker {worker} is not in the cluster (0..{max(self.num_workers, claimed) - 1})")
        if batch < 0 or (loss is not None and not math.isfinite(loss)):
            raise Rejected("non_finite" if loss is not None and not math.isfinite(loss) else "malformed", "batch must be >= 0 and loss finite")
        req = _Request(worker, tag, pull, min_version, batch, loss, bool(meta.get("dense", True)), seq)
        for name, arr in msg.tensors.items():
            base, _, kind = name.partition(":")
            part = self.parts.get(base)
            if part is None:
                raise Rejected("unknown_variable", f"variable {base!r} is not on PS {self.index}")
            if kind == "":
                self._check_values(name, arr, part.shape, DENSE_WIRE_DTYPES)
                if part.sparse:
                    raise Rejected("wrong_shape", f"{name!r} is an embedding table: push rows (indices, values)")
                req.dense[name] = arr
            elif kind in ("indices", "rows"):
                if not part.sparse:
                    raise Rejected("unknown_variable", f"{base!r} is dense: it has no rows")
                if arr.dtype != np.int64 or arr.ndim != 1:
                    raise Rejected("wrong_dtype", f"{name!r}: row indices must be 1-D int64, got {arr.dtype} {list(arr.shape)}")
                if arr.size and (arr.min() < 0 or arr.max() >= part.shape[0]):
                    raise Rejected("out_of_range", f"{name!r}: row index outside 0..{part.shape[0] - 1}")
                if kind == "rows":
                    req.rows[base] = arr
            elif kind == "values":
                idx = msg.tensors.get(f"{base}:indices")
                if idx is None:
                    raise Rejected("malformed", f"{name!r} without {base}:indices")
                self._check_values(name, arr, (len(idx), *part.shape[1:]))
                req.sparse[base] = (idx, arr)
            else:
                raise Rejected("malformed", f"tensor {name!r}: unknown kind {kind!r}")
        for name in msg.tensors:
            base, _, kind = name.partition(":")
            if kind == "indices" and base not in req.sparse:
                raise Rejected("malformed", f"{name!r} without {base}:values")
        return req

    @staticmethod
    def _check_values(name: str, arr: np.ndarray, shape: tuple, dtypes: tuple = (np.float32,)) -> None:
        if arr.dtype not in dtypes:
            raise Rejected("wrong_dtype", f"{name!r}: expected {' or '.join(np.dtype(d).name for d in dtypes)}, got {arr.dtype}")
        if tuple(arr.shape) != tuple(shape):
            raise Rejected("wrong_shape", f"{name!r}: expected shape {list(shape)}, got {list(arr.shape)}")
        if arr.size and not _finite(arr):
            raise Rejected("non_finite", f"{name!r}: gradient contains NaN or Inf")

    # ---- the update ----
    def _apply(self, dense: dict[str, np.ndarray], sparse: dict[str, tuple[np.ndarray, np.ndarray]], examples: int, loss: float | None, staleness: int) -> None:
        t0 = time.perf_counter()
        t = self.version + 1
        if dense:
            self._apply_dense(dense, t)
        for name, (rows, values) in sparse.items():
            self.optimizer.apply_sparse(self.vars[name], self.slots[name], rows, values, t)
        self.version = t
        self.examples += examples
        if loss is not None:
            self.loss = loss
        m = self.metrics
        m.apply_seconds.observe(time.perf_counter() - t0)
        m.updates.inc()
        m.staleness.observe(max(0, staleness))
        m.examples.inc(examples)
        self._publish()
        self._track_rate()
        if self.checkpoint_dir and (t % self.training.checkpoint.every_steps == 0 or t == self.steps):
            self._checkpoint_async()
        self.cond.notify_all()

    def _track_rate(self) -> None:
        warm_step = max(2, self.steps // 10)
        now = time.monotonic()
        if self._warm is None:
            if self.version >= warm_step:
                self._warm = (now, self.examples)
        elif now > self._warm[0]:
            self._last_rate = (self.examples - self._warm[1]) / (now - self._warm[0])

    def _push_sync(self, req: _Request) -> bool:
        """Returns False when the push was stale (computed on another version)."""
        if req.tag != self.version:
            return False
        if req.worker in self._pushed:
            return True  # a retried push of this step; counted once
        for name, grad in req.dense.items():
            acc = self._acc.get(name)
            if acc is None:
                acc = self._acc[name] = wire.aligned_empty(grad.size * 4).view(np.float32).reshape(grad.shape)
                acc[...] = grad
            else:
                np.add(acc, grad, out=acc)
        for name, (idx, values) in req.sparse.items():
            self._sparse_acc.setdefault(name, []).append((idx.copy(), values.copy()))
        self._pushed.add(req.worker)
        self._acc_examples += req.batch
        if req.loss is not None:
            self._acc_loss.append(req.loss)
        self._maybe_close()
        return True

    def _maybe_close(self) -> None:
        if not self._pushed or self.done:
            return
        if not set(self.live_workers()) <= self._pushed:
            return
        n = len(self._pushed)
        scale = np.float32(1.0 / n)
        dense = {k: np.multiply(v, scale, out=v) for k, v in self._acc.items()}
        sparse = {}
        for name, pieces in self._sparse_acc.items():
            sparse[name] = (np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces]) * scale)
        loss = float(np.mean(self._acc_loss)) if self._acc_loss else None
        examples = self._acc_examples
        self._reset_accumulators()
        self._apply(dense, sparse, examples, loss, 0)

    def _push_async(self, req: _Request) -> None:
        if req.seq is not None and req.seq < self.clocks[req.worker]:
            # A retry of a push applied before whose reply was lost: apply it once only.
            self.metrics.duplicates.inc()
            return
        staleness = self.version - req.tag if req.tag >= 0 else 0
        self.clocks[req.worker] += 1
        self._apply(req.dense, req.sparse, req.batch, req.loss, staleness)

    def _ready(self, req: _Request, target: int) -> bool:
        if self.done:
            return True
        if self.mode is ConsistencyMode.SYNC:
            return self.version >= target
        if self.mode is ConsistencyMode.BOUNDED:
            live = self.live_workers() or [req.worker]
            return self.clocks[req.worker] - min(self.clocks[w] for w in live) <= self.bound
        return True

    def step(self, data: bytes | memoryview, encoding: str = "bytes") -> bytes | list:
        """Handle one Step request (push and/or pull); raises Rejected on bad input.
        The reply is encoded for its transport (ENCODERS): one message for a unary call,
        its chunks for the streaming call, its uncopied pieces for the data path."""
        try:
            req = self._parse(wire.decode(data))
        except wire.WireError as err:
            raise Rejected(err.reason, str(err)) from None
        self.metrics.bytes_in.inc(len(data))
        stale = False
        with self.cond:
            self._seen(req.worker)
            target = req.min_version
            if req.has_grads and not self.done:
                if self.mode is ConsistencyMode.SYNC:
                    stale = not self._push_sync(req)
                    if not stale:
                        target = max(target, req.tag + 1)
                else:
                    self._push_async(req)
            elif (self.mode is ConsistencyMode.SYNC and req.pull and target > self.version
                  and req.worker not in self._pushed and not self.done):
                # It waits for a step its push never reached or that this PS lost by restarting
                # (accumulated pushes are not checkpointed): stale, so it recomputes and pushes again.
                stale = True
            pending = False
            if req.pull and not stale:
                deadline = time.monotonic() + POLL_SECONDS
                while not self._ready(req, target):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        pending = True
                        break
                    self.cond.wait(min(left, 0.25))
                    self._seen(req.worker)
                    if self.mode is ConsistencyMode.SYNC:
                        self._maybe_close()
            self.metrics.workers_live.set(len(self.live_workers()))
            # In sync mode every worker gets the same reply for a version: encode it once.
            shared = self.mode is ConsistencyMode.SYNC and req.pull and req.want_dense and not (stale or pending or req.rows)
            if shared and self._shared_reply[:2] == (self.version, encoding):
                out = self._shared_reply[2]
                self.metrics.bytes_out.inc(_size(out))
                return out
            meta = {
                "version": self.version,
                "done": self.done,
                "workers": self.split_size(),
                "clock": 0 if shared else self.clocks[req.worker],
                "incarnation": self.incarnation,
                "stale": stale,
                "pending": pending,
            }
            tensors = {}
            if req.pull and not pending:
                for name, var in self.vars.items():
                    if req.want_dense and not self.parts[name].sparse:
                        tensors[name] = var.read_value() if self._wire_dtype == tf.float32 else tf.cast(var, self._wire_dtype)
                for name, idx in req.rows.items():
                    tensors[f"{name}:rows"] = tf.raw_ops.ResourceGather(resource=self.vars[name].handle, indices=idx, dtype=tf.float32)
        # Serialise outside the lock: the tensors read above are snapshots (TF copies a
        # variable's buffer on the next update while a reader still holds it).
        arrays = {k: np.asarray(v) for k, v in tensors.items()}
        out = ENCODERS[encoding](meta, arrays)
        if shared:
            self._shared_reply = (meta["version"], encoding, out)
        self.metrics.bytes_out.inc(_size(out))
        return out

    def pull_full(self) -> list[bytes]:
        """Every part whole, embedding tables included (for export and evaluation), as chunks."""
        with self.cond:
            tensors = {name: var.read_value() for name, var in self.vars.items()}
            meta = {"version": self.version, "done": self.done, "incarnation": self.incarnation}
        out = wire.encode_chunks(meta, {k: np.asarray(v) for k, v in tensors.items()})
        self.metrics.bytes_out.inc(_size(out))
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
            }

    # ---- checkpoints ----
    def _snapshot(self) -> tuple[dict, dict]:
        tensors = {}
        for name, var in self.vars.items():
            tensors[name] = var.read_value()
            for slot, svar in self.slots[name].items():
                tensors[f"{name}:slot:{slot}"] = svar.read_value()
        meta = {
            "version": self.version,
            "clocks": list(self.clocks),
            "examples": self.examples,
            "loss": self.loss,
            "optimizer": self.optimizer.name.value,
            "parts": {n: list(p.shape) for n, p in self.parts.items()},
        }
        return meta, tensors

    def _write(self, meta: dict, tensors: dict) -> None:
        try:
            checkpoint.write(self.checkpoint_dir, meta, {k: np.asarray(v) for k, v in tensors.items()})
        except OSError:
            log.exception("checkpoint of PS %d at step %d failed", self.index, meta["version"])
            return
        self.checkpoint_step = max(self.checkpoint_step, meta["version"])
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_step.set(self.checkpoint_step)
        log.info(json.dumps({"event": "checkpoint", "ps": self.index, "step": meta["version"], "path": str(self.checkpoint_dir)}))

    def _checkpoint_async(self) -> None:
        meta, tensors = self._snapshot()
        self._ckpt_pool.submit(self._write, meta, tensors)

    def checkpoint_now(self) -> int:
        """Write a checkpoint of the current state and wait for it; returns its step."""
        if not self.checkpoint_dir:
            return -1
        with self.cond:
            meta, tensors = self._snapshot()
        if meta["version"] > self.checkpoint_step:
            self._ckpt_pool.submit(self._write, meta, tensors).result()
        return self.checkpoint_step

    def _restore(self) -> None:
        if not self.checkpoint_dir:
            return
        msg = checkpoint.read(self.checkpoint_dir)
        if msg is None:
            return
        meta = msg.meta
        expected = {n: list(p.shape) for n, p in self.parts.items()}
        if meta.get("parts") != expected or meta.get("optimizer") != self.optimizer.name.value:
            raise RuntimeError(
                f"checkpoint in {self.checkpoint_dir} was written for another model, placement or optimizer; "
                "move it away or point spec.training.checkpoint.path elsewhere"
            )
        for name, var in self.vars.items():
            var.assign(msg.tensors[name])
            for slot, svar in self.slots[name].items():
                svar.assign(msg.tensors[f"{name}:slot:{slot}"])
        self.version = int(meta["version"])
        clocks = [int(c) for c in meta.get("clocks", [])]
        self._grow(len(clocks))
        self.clocks[: len(clocks)] = clocks
        self.examples = int(meta.get("examples", 0))
        self.loss = meta.get("loss")
        self.checkpoint_step = self.version
        self.metrics.restored.inc()
        self.metrics.checkpoint_step.set(self.version)
        log.info(json.dumps({"event": "restored", "ps": self.index, "step": self.version, "path": str(self.checkpoint_dir)}))

    def close(self) -> None:
        self._ckpt_pool.shutdown(wait=True)


def _finite(arr: np.ndarray) -> bool:
    """No NaN or Inf in `arr` (float32 or bfloat16)."""
    if arr.dtype == BFLOAT16:
        # NaN and Inf are the values whose 8 exponent bits are all set
        return not np.any((arr.view(np.uint16) & _BF16_EXPONENT) == _BF16_EXPONENT)
    # A sum is NaN/Inf when any element is (or when it overflows, itself a sign of a broken
    # gradient), at a fraction of the cost of an elementwise check.
    return math.isfinite(float(arr.sum()))


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

    implementations = {"Step": step, "StepStream": step_stream, "PullFull": pull_full, "Status": status, "Finish": finish}
    return grpc.method_handlers_generic_handler(SERVICE, {
        name: getattr(grpc, f"{shape}_rpc_method_handler")(implementations[name]) for name, shape in wire.METHODS.items()})


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


def serve(shard: Shard, address: str, max_workers: int = 16, security: ServerSecurity | None = None,
          data_port: int | None = 0) -> tuple[PSServer, int]:
    """Start the gRPC server for `shard` on `address` (host:port), and its data path on
    `data_port` of the same host (0: any free port; None: no data path, Steps over gRPC
    only); returns them and the bound gRPC port. Without `security` both are open and
    plaintext (tests on loopback)."""
    security = security or ServerSecurity(None)
    refused, data = _refuser(shard), None
    if data_port is not None:
        data = DataServer(shard, split_host(address), data_port, security.material, refused)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ps-rpc"), options=GRPC_OPTIONS,
                         interceptors=security.interceptors(shard.metrics, shard.index))
    server.add_generic_rpc_handlers((_handlers(shard, data.port if data else None, refused),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = security.add_port(server, address)
    if port == 0:
        if data is not None:
            data.close()
        raise OSError(f"cannot bind the PS gRPC server on {address}")
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return PSServer(server, data), port
