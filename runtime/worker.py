"""The worker loop: pull parameters, compute gradients with TensorFlow, push to every shard.

Each step is one `Step` call per PS shard, all shards in parallel: the call pushes this
step's gradients and returns the parameters for the next step (and the embedding rows the
next batch needs), so communication costs one round trip per step. Workers never talk to
each other. Worker 0 evaluates the test split at the end, exports the model when
spec.training.exportPath is set, and asks every PS to write its final checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent import futures
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tfps.api.settings import ProcessSettings
from tfps.api.spec import ConsistencyMode, TrainingSpec, WireDtype

from . import wire
from .client import SentSteps, ShardClient
from .datapath import ReplyBuffers
from .filedata import FileBatches, eval_batches, train_batches
from .metrics import WARM_UP_ONE_IN, WorkerMetrics
from .models import BatchSource, Dataset, ModelDef
from .sharding import Placement, batch_ids, place, route_rows
from .zerocopy import as_tensor

try:
    from ._rows import segment_sum
except ImportError:  # the package built without its C kernels (runtime/_rows.c): TensorFlow sums the rows
    segment_sum = None

log = logging.getLogger("tfps.worker")


def use_gpu_memory_growth() -> list:
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    return gpus


def loss_fn(kind: str, logits, y):
    if kind == "softmax":
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return tf.reduce_mean(
        tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.reshape(tf.cast(y, logits.dtype), tf.shape(logits)), logits=logits
        )
    )


def make_grad_fn(model: ModelDef, wire_dtype: WireDtype = WireDtype.FLOAT32):
    """`grad_fn(params, x, y) -> (loss, grads)`. Computes in float32 whatever precision
    the parameters came in; dense gradients leave in `wire_dtype` (embedding rows in float32).

    The rows of an embedding table and the batch change size every step. A `tf.function` with
    `reduce_retracing` serves them with a relaxed trace, but first looks each new shape up among
    every trace it holds, a lookup that grows with the traces until it outweighs the gradient.
    So each set of input dtypes gets one concrete function, traced once with those dimensions
    left open, and is called directly. A ConcreteFunction called with nested arguments binds and
    casts each tensor against its signature in Python, a large share of the worker's
    main-thread CPU, though the inputs are known to fit: the traced function gets them
    flattened instead (`flat_call`).

    A table's gradient comes out of the tape as one row per id looked up (IndexedSlices);
    the push carries one row per row of the batch's table, each the sum of its ids' rows.
    TensorFlow's CPU sum (UnsortedSegmentSum) goes a row at a time, and runtime/_rows.c's
    `segment_sum` gives the same result bit for bit for less of the step's CPU, so on a CPU the
    trace returns the rows as they come and they are summed after it. Table gradients may leave
    as NumPy arrays, the rest as tensors."""
    out_dtype = tf.as_dtype(wire_dtype.value)
    sparse = {p.name for p in model.sparse_params}
    # On a GPU TensorFlow's sum is fast, and the rows it sums would cross to the host unsummed.
    sum_on_host = segment_sum is not None and not tf.config.list_logical_devices("GPU")

    def table_gradient(g):
        if sum_on_host and isinstance(g, tf.IndexedSlices):
            return g.values, tf.cast(g.indices, tf.int64)
        return tf.convert_to_tensor(g)

    @tf.function
    def traced(params, x, y):
        params = {k: tf.cast(v, tf.float32) for k, v in params.items()}
        with tf.GradientTape() as tape:
            tape.watch(params)
            outputs = model.forward(params, x)
            loss = model.objective(y, outputs) if model.objective else loss_fn(model.loss, outputs, y)
        # A dense variable read by a lookup (a Keras Embedding) has its gradient as IndexedSlices,
        # and one the loss does not reach has none: both leave as whole arrays.
        grads = tape.gradient(loss, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return loss, {
            k: table_gradient(g) if k in sparse else tf.cast(tf.convert_to_tensor(g), out_dtype)
            for k, g in grads.items()
        }

    def spec(tensor, fixed: bool) -> tf.TensorSpec:
        shape = tensor.shape if fixed or not tensor.shape.rank else [None, *tensor.shape[1:]]
        return tf.TensorSpec(shape, tensor.dtype)

    concrete: dict = {}

    def grad_fn(params, x, y):
        key = (
            tuple((k, v.dtype) for k, v in params.items()),
            tuple((k, v.dtype, v.shape.rank) for k, v in x.items()),
            y.dtype,
            y.shape.rank,
        )
        fn = concrete.get(key)
        if fn is None:
            fn = concrete[key] = flat_call(
                traced.get_concrete_function(
                    {k: spec(v, k not in sparse) for k, v in params.items()},
                    {k: spec(v, False) for k, v in x.items()},
                    spec(y, False),
                )
            )
        loss, grads = fn(params, x, y)
        for k, g in grads.items():
            if type(g) is tuple:  # (values, indices): `table_gradient`
                values, indices = (np.asarray(t) for t in g)
                grads[k] = out = wire.aligned_array((params[k].shape[0], *values.shape[1:]), np.float32)
                width = math.prod(values.shape[1:])
                segment_sum(values.reshape(len(values), width), indices, out.reshape(len(out), width))
        return loss, grads

    return grad_fn


def flat_call(fn):
    """`fn(*args)` for a ConcreteFunction `fn` and arguments that match its signature, without
    the per-call binding: the tensors flattened in the order the trace took them (tf.nest's,
    dicts by sorted key) go straight to its graph. Falls back to the plain call where this
    TensorFlow lacks the flat entry point."""
    call_flat = getattr(fn, "_call_flat", None)
    if call_flat is None:  # pragma: no cover - TensorFlow's private API moved
        return fn
    captured = fn.captured_inputs
    return lambda *args: call_flat(tf.nest.flatten(args), captured)


def evaluate(model: ModelDef, params: dict, data, batch: int = 4096) -> dict[str, float]:
    """Test-split figures of the given parameters: accuracy, and for a binary (sigmoid) model the
    area under the ROC curve, which a click model is judged by (its classes are far from even)."""
    from sklearn.metrics import roc_auc_score

    tensors = {k: tf.convert_to_tensor(v) for k, v in params.items()}
    logits, labels = [], []
    for x, y in _eval_batches(data, batch):
        logits.append(model.predict(tensors, {k: tf.convert_to_tensor(v) for k, v in x.items()}).numpy())
        labels.append(y)
    if not labels or model.loss not in ("softmax", "sigmoid"):
        return {}
    scores, y = np.concatenate(logits), np.concatenate(labels)
    if model.loss == "softmax":
        return {"accuracy": float((np.argmax(scores, axis=1) == y.reshape(-1)).mean())}
    scores, y = scores.reshape(-1), y.reshape(-1)
    threshold = 0.5 if model.outputs == "probabilities" else 0.0
    figures = {"accuracy": float(((scores > threshold).astype(y.dtype) == y).mean())}
    if len(np.unique(y)) == 2:
        figures["auc"] = float(roc_auc_score(y, scores))
    return figures


def _eval_batches(data, batch: int):
    """(features, labels) batches of a test split: a Dataset in memory, or an iterable of
    batches (files read by runtime/filedata.py)."""
    if isinstance(data, Dataset):
        for start in range(0, len(data), batch):
            yield data.take(np.arange(start, min(start + batch, len(data))))
    else:
        yield from data


def export_saved_model(model: ModelDef, params: dict, example_x: dict, path: str) -> None:
    """A SavedModel whose serving signature maps the features to probabilities."""
    if "keras" in model.extra:
        from .keras_model import export_keras

        export_keras(model, params, path)
        return

    class Exported(tf.Module):
        def __init__(self):
            super().__init__(name="tfps_model")
            self.params = {k: tf.Variable(v, trainable=False, name=k.replace("/", "_")) for k, v in params.items()}

    module = Exported()
    spec = {k: tf.TensorSpec([None, *v.shape[1:]], tf.as_dtype(v.dtype), name=k) for k, v in example_x.items()}

    @tf.function(input_signature=[spec])
    def serve(features):
        logits = model.predict(dict(module.params), features)
        probs = tf.nn.softmax(logits) if model.loss == "softmax" else tf.sigmoid(logits)
        return {"probabilities": probs}

    module.serve = serve
    tf.saved_model.save(module, path, signatures={"serving_default": serve})


PLANS_KEPT = 3  # batch plans kept around the current data step (a pipelined worker plans two ahead)


def _aligned_concat(pieces: list[np.ndarray]) -> np.ndarray:
    """np.concatenate into an aligned buffer, which TensorFlow then uses in place (zerocopy.as_tensor)."""
    return np.concatenate(
        pieces, out=wire.aligned_array((sum(len(p) for p in pieces), *pieces[0].shape[1:]), pieces[0].dtype)
    )


class _JoinedParams:
    """What an exchange brings from several PS, each part received straight into one array: a
    part's bytes go from the socket to its rows (DataConnection.receive's `place`), with no
    concatenation after. Dense variables split over several PS (most of a large model's bytes,
    every step) go into arrays reused once TensorFlow is done with them (ReplyBuffers); a
    table's rows asked of several PS go into a new array of the batch's rows, each PS's where
    its ids are."""

    def __init__(self, plan: Placement, names: list[str]):
        split = [name for name in names if len(plan.parts_of(name)) > 1]
        self._parts = {part.name: (name, part) for name in split for part in plan.parts_of(name)}
        self._rows = {name: plan.parts_of(name)[-1].stop for name in split}
        self._pools = {name: ReplyBuffers() for name in split}
        self._arrays: dict[str, np.ndarray] = {}  # per variable or table, its array in the exchange under way
        self._slices: dict[str, np.ndarray] = {}  # per part, the rows of it handed out
        self._row_places: dict[
            str, tuple[str, int, int, int]
        ] = {}  # "<part>:rows" -> (table, start, stop, rows in all)

    def place(self, routes: dict | None = None):
        """A `place` for the replies of a new exchange (the arrays of the one before are let go);
        `routes`: per table, the routes of the rows it brings (Worker._sparse_plan)."""
        self._arrays, self._slices = {}, {}
        self._row_places = {}
        for table, table_routes in (routes or {}).items():
            if len(table_routes) > 1:
                total = int(table_routes[-1][1][-1]) + 1
                for part, positions, _ in table_routes:
                    self._row_places[f"{part.name}:rows"] = (table, int(positions[0]), int(positions[-1]) + 1, total)
        return self._place if self._parts or self._row_places else None

    def _place(self, name: str, dtype: np.dtype, shape: tuple) -> np.ndarray | None:
        rows = self._row_places.get(name)
        if rows is not None:
            return self._place_rows(name, dtype, shape, *rows)
        found = self._parts.get(name)
        if found is None or tuple(shape) != found[1].shape:
            return None
        var, part = found
        arr = self._arrays.get(var)
        if arr is None or arr.dtype != dtype:
            whole = (self._rows[var], *shape[1:])
            buf = self._pools[var].take(math.prod(whole) * dtype.itemsize)
            # a view of a memoryview of `buf` itself, so that while it lives it refers to `buf`
            arr = self._arrays[var] = np.frombuffer(memoryview(buf), dtype).reshape(whole)
        self._slices[name] = rows = arr[part.start : part.stop]
        return rows

    def _place_rows(
        self, name: str, dtype: np.dtype, shape: tuple, table: str, start: int, stop: int, total: int
    ) -> np.ndarray | None:
        if len(shape) != 2 or shape[0] != stop - start:
            return None
        arr = self._arrays.get(table)
        if arr is None or arr.dtype != dtype or arr.shape[1] != shape[1]:
            arr = self._arrays[table] = wire.aligned_array((total, shape[1]), dtype)
        self._slices[name] = rows = arr[start:stop]
        return rows

    def joined(self, var: str, names: list[str], pieces: list[np.ndarray]) -> np.ndarray | None:
        """The array of `var` (a dense variable or a table's rows), when every one of its parts
        (`names`; `pieces`, from the replies) came straight into it."""
        if all(piece is self._slices.get(name) for name, piece in zip(names, pieces, strict=True)):
            return self._arrays[var]
        return None


@dataclass
class _InFlight:
    """A Step sent to every shard, its replies still to be read (`Worker._finish`)."""

    started: float
    tags: list[int]
    metas: list[dict]
    tensors: list[dict]
    row_requests: list[dict]
    routes: dict  # of the rows the replies bring (Worker._sparse_plan)
    sent: SentSteps


@dataclass
class _Reply:
    version: int
    done: bool
    clock: int
    stale: bool
    pending: bool
    msg: wire.Message
    workers: int  # the PS's count of slices per global batch


class Worker:
    def __init__(
        self,
        model: ModelDef,
        training: TrainingSpec,
        ps_addresses: list[str],
        num_workers: int,
        index: int,
        metrics: WorkerMetrics,
        retry_seconds: float = 300.0,
        pipeline: bool | None = None,
        security=None,  # auth.ClientSecurity: the job's token (and TLS) for every PS call
    ):
        self.model, self.training, self.index = model, training, index
        self.num_workers, self.metrics = num_workers, metrics
        self.mode = training.consistency.mode
        self.plan: Placement = place(model.params, len(ps_addresses))
        self.clients = [
            ShardClient(a, k, retry_seconds, on_retry=metrics.retries.inc, security=security)
            for k, a in enumerate(ps_addresses)
        ]
        self.pool = (
            futures.ThreadPoolExecutor(len(self.clients) - 1, thread_name_prefix="push")
            if len(self.clients) > 1
            else None
        )
        self.batches: BatchSource | FileBatches
        if training.data is not None:  # examples streamed from files, in place of the model's data()
            self.train, self.test = None, eval_batches(training.data, model.inputs, metrics=metrics)
            self.batches = train_batches(
                training.data, model.inputs, training.batch_size, training.seed, index, num_workers, metrics
            )
        else:
            self.train, self.test = model.data()
            self.batches = BatchSource(self.train, training.seed, training.batch_size, index, num_workers)
        self.data_ended = False  # training.data's epochs used up on this worker
        self.grad_fn = make_grad_fn(model, training.wire_dtype)
        self.sparse = {p.name: p for p in model.sparse_params}
        # Tables over one feature whose parts split the rows alike (wide-deep's two) route a
        # batch's ids alike: `_sparse_plan` routes them once.
        self._splits = {
            name: (p.feature, tuple((q.start, q.stop) for q in self.plan.parts_of(name)))
            for name, p in self.sparse.items()
        }
        self.dense_vars = [p.name for p in model.params if not p.sparse]
        self._joined = _JoinedParams(self.plan, self.dense_vars)
        self._large = [
            sum(p.size for p in self.plan.for_ps(k) if not p.sparse) * 4 > wire.UNARY_MAX_BYTES
            for k in range(len(self.clients))
        ]
        self.versions = [0] * len(self.clients)
        self.params: dict[str, tf.Tensor] = {}
        self.rows: dict[str, np.ndarray] = {}
        self._rows_step = None  # data step the cached rows were pulled for
        self._plans: dict[int, tuple] = {}  # data step -> (its BatchSource, _batch_plan's answer)
        self.done = False
        self.clock = 0
        self.shard_clocks = [0] * len(self.clients)  # per shard: its count of this worker's pushes
        self.last_loss = math.nan
        self.steps_done = 0
        self.step_times: list[float] = []
        if pipeline is None:
            pipeline = ProcessSettings.from_env().pipeline
        self.pipeline = pipeline and self.mode is not ConsistencyMode.SYNC

    # ---- calls to all shards in parallel ----
    def _map(self, fn, items):
        """fn over items, one per shard, in parallel: the first in this thread, the others in the pool."""
        if self.pool is None or len(items) <= 1:
            return [fn(*a) for a in items]
        rest = [self.pool.submit(fn, *a) for a in items[1:]]
        try:
            first = fn(*items[0])
        except BaseException:
            futures.wait(rest)  # no call outlives the step
            raise
        return [first, *(f.result() for f in rest)]

    def _call(self, k: int, meta: dict, tensors: dict) -> _Reply:
        return self._reply(
            self.clients[k].step({"worker": self.index, "workers": self.num_workers, **meta}, tensors, self._large[k])
        )

    def _call_all(self, metas: list[dict], tensors: list[dict]) -> list[_Reply]:
        """One Step to every shard: over their data connections at once, the rest in parallel."""
        metas, sent = self._send_all(metas, tensors)
        return self._complete(sent.replies(self._joined.place()), metas, tensors)

    def _send_all(self, metas: list[dict], tensors: list[dict]) -> tuple[list[dict], SentSteps]:
        """One Step to every shard over its data connection, its reply not read yet: the metas sent, and the steps."""
        metas = [{"worker": self.index, "workers": self.num_workers, **meta} for meta in metas]
        return metas, SentSteps(self.clients, list(zip(metas, tensors, strict=True)))

    def _complete(self, msgs: list[wire.Message | None], metas: list[dict], tensors: list[dict]) -> list[_Reply]:
        """The replies of a Step to every shard: those the data paths did not bring, asked for again
        through each shard's client (gRPC, retries), in parallel."""
        missing = [k for k, msg in enumerate(msgs) if msg is None]
        for k, msg in zip(
            missing,
            self._map(lambda k: self.clients[k].step(metas[k], tensors[k], self._large[k]), [(k,) for k in missing]),
            strict=True,
        ):
            msgs[k] = msg
        return [self._reply(msg) for msg in msgs]

    def _reply(self, msg: wire.Message) -> _Reply:
        m = msg.meta
        return _Reply(
            int(m["version"]),
            bool(m["done"]),
            int(m.get("clock", 0)),
            bool(m.get("stale")),
            bool(m.get("pending")),
            msg,
            int(m.get("workers", self.num_workers)),
        )

    # ---- the batch's sparse rows ----
    def _sparse_plan(self, x: dict) -> tuple[dict, list[dict], dict]:
        """Remap id features onto the batch's unique ids. Returns the remapped features,
        per shard the rows to ask for, and per table its routes (part, positions, rows)."""
        local_x, routes, uniq, by_split = dict(x), {}, {}, {}
        for name, param in self.sparse.items():
            feature = param.feature
            if feature not in uniq:
                uniq[feature], local_x[feature] = batch_ids(x[feature])
            parts, split = self.plan.parts_of(name), self._splits[name]
            alike = by_split.get(split)
            if alike is None:
                routes[name] = by_split[split] = route_rows(parts, uniq[feature])
            else:  # the same routes as an earlier table's, through this table's own parts
                at = {part.start: part for part in parts}
                routes[name] = [(at[part.start], positions, local) for part, positions, local in alike]
        return local_x, self.plan.rows_asked(routes), routes

    def _rows_from(self, replies: list, routes: dict) -> dict[str, np.ndarray]:
        rows = {}
        for name, table_routes in routes.items():
            names = [f"{part.name}:rows" for part, _, _ in table_routes]
            pieces = [replies[part.ps].msg.tensors[key] for (part, _, _), key in zip(table_routes, names, strict=True)]
            if len(pieces) == 1:
                rows[name] = pieces[0]
            else:  # received straight into one array, or else joined now
                whole = self._joined.joined(name, names, pieces)
                rows[name] = whole if whole is not None else _aligned_concat(pieces)
        return rows

    def _take_params(self, replies: list[_Reply]) -> None:
        for name in self.dense_vars:
            parts = self.plan.parts_of(name)
            pieces = [replies[p.ps].msg.tensors[p.name] for p in parts]
            if len(pieces) > 1:  # received straight into one array, or else joined now
                whole = self._joined.joined(name, [p.name for p in parts], pieces)
                pieces = [whole if whole is not None else _aligned_concat(pieces)]
            self.params[name] = as_tensor(pieces[0])

    def _absorb(self, replies: list[_Reply], sent_tags: list[int] | None, row_requests: list[dict]) -> list[_Reply]:
        """Re-ask shards that answered `pending` until every shard has parameters."""
        out = list(replies)
        while True:
            waiting = [k for k, r in enumerate(out) if r.pending]
            if not waiting:
                return out
            t0 = time.perf_counter()
            for k in waiting:
                min_version = (
                    sent_tags[k] + 1 if sent_tags and self.mode is ConsistencyMode.SYNC and not out[k].stale else 0
                )
                out[k] = self._call(k, {"tag": -1, "pull": True, "min_version": min_version}, row_requests[k])
            self.metrics.pull_seconds.observe(time.perf_counter() - t0)

    def _update_state(self, replies: list[_Reply]) -> None:
        self.versions = [r.version for r in replies]
        self.done = replies[0].done
        self.clock = replies[0].clock
        self.shard_clocks = [r.clock for r in replies]
        split = replies[0].workers
        # Files stay sharded as they were when the job started.
        if (
            isinstance(self.batches, BatchSource) and split != self.batches.num_workers and self.index < split
        ):  # workers were scaled: cut batches anew
            self.batches = BatchSource(self.train, self.training.seed, self.training.batch_size, self.index, split)
            log.info(json.dumps({"event": "resplit", "worker": self.index, "workers": split}))
        self._take_params(replies)

    def _data_step(self) -> int:
        return self.versions[0] if self.mode is ConsistencyMode.SYNC else self.clock

    def pull(self) -> None:
        """Pull-only: the parameters from every shard."""
        t0 = time.perf_counter()
        none = [dict() for _ in self.clients]
        replies = self._call_all([{"tag": -1, "pull": True} for _ in self.clients], [{} for _ in self.clients])
        self._update_state(self._absorb(replies, None, none))
        self.metrics.pull_seconds.observe(time.perf_counter() - t0)

    def _pull_rows(self, row_requests: list[dict]) -> list:
        t0 = time.perf_counter()
        replies = {
            k: self._call(k, {"tag": -1, "pull": True, "dense": False}, req)
            for k, req in enumerate(row_requests)
            if req
        }
        self.metrics.pull_seconds.observe(time.perf_counter() - t0)
        return [replies.get(k) for k in range(len(self.clients))]

    def _batch_plan(self, step: int) -> tuple[dict, np.ndarray, list[dict], dict]:
        """Data step `step`'s batch, its id features remapped onto its unique ids, per shard the
        rows to ask for, and per table its routes. The plan made for the next batch (whose rows
        ride along with a push) serves that batch's compute too."""
        cached = self._plans.get(step)
        if cached is not None and cached[0] is self.batches:
            return cached[1]
        x, y = self.batches(step)
        if self.model.derive is not None:  # the ids the tables' rows are pulled for, computed from the batch
            x = self.model.derive(x)
        requests, routes = [dict() for _ in self.clients], {}
        if self.sparse:
            x, requests, routes = self._sparse_plan(x)
        self._plans = {k: v for k, v in self._plans.items() if step - PLANS_KEPT < k < step + PLANS_KEPT}
        self._plans[step] = (self.batches, (x, y, requests, routes))
        return self._plans[step][1]

    def _compute(self, step: int):
        """Gradients of data step `step` on the current parameters."""
        x, y, row_requests, routes = self._batch_plan(step)
        if self.sparse and self._rows_step != step:
            self.rows = self._rows_from(self._pull_rows(row_requests), routes)
        t0 = time.perf_counter()
        params = {**self.params, **{k: as_tensor(v) for k, v in self.rows.items()}}
        loss, grads = self.grad_fn(params, {k: as_tensor(v) for k, v in x.items()}, as_tensor(y))
        loss = float(loss)
        grads = {k: np.asarray(v) for k, v in grads.items()}  # no copy: the tensors are ours
        self.metrics.compute_seconds.observe(time.perf_counter() - t0)
        return loss, grads, routes, len(y)

    def _send(
        self, tags: list[int], shard_tensors: list[dict], meta: dict, row_requests: list[dict], routes: dict
    ) -> _InFlight:
        """Push to every shard; the replies (`_finish`) carry the next parameters. In async and
        bounded mode each push carries its sequence number, so that a retry whose first try was
        applied is not applied twice."""
        t0 = time.perf_counter()
        seqs = None if self.mode is ConsistencyMode.SYNC else list(self.shard_clocks)
        tensors = [{**shard_tensors[k], **row_requests[k]} for k in range(len(self.clients))]
        metas, sent = self._send_all(
            [{**meta, "tag": tags[k], **({"seq": seqs[k]} if seqs else {})} for k in range(len(self.clients))], tensors
        )
        return _InFlight(t0, tags, metas, tensors, row_requests, routes, sent)

    def _finish(self, inflight: _InFlight) -> list[_Reply]:
        replies = self._complete(
            inflight.sent.replies(self._joined.place(inflight.routes)), inflight.metas, inflight.tensors
        )
        replies = self._absorb(replies, inflight.tags, inflight.row_requests)
        self.metrics.push_seconds.observe(time.perf_counter() - inflight.started)
        return replies

    def _count(self, loss: float, batch: int, t_step: float) -> None:
        self.last_loss = loss
        self.steps_done += 1
        m = self.metrics
        m.loss.set(loss)
        m.steps.inc()
        m.examples.inc(batch)
        m.step_seconds.observe(time.perf_counter() - t_step)
        self.step_times.append(time.perf_counter() - t_step)

    def _has_data(self, step: int) -> bool:
        """Whether data step `step` has a batch (False once training.data's epochs are used up)."""
        if isinstance(self.batches, BatchSource) or self.batches.has(step):
            return True
        self.data_ended = True
        return False

    def train_step(self) -> None:
        t_step = time.perf_counter()
        step = self._data_step()
        if not self._has_data(step):
            return
        loss, grads, routes, batch = self._compute(step)
        # The rows of the next batch ride along with this push.
        next_requests, next_routes = [dict() for _ in self.clients], {}
        if self.sparse and self._has_data(step + 1):
            _, _, next_requests, next_routes = self._batch_plan(step + 1)
        inflight = self._send(
            list(self.versions),
            self.plan.split_push(self.dense_vars, grads, routes),
            {"pull": True, "batch": batch, "loss": loss},
            next_requests,
            next_routes,
        )
        if not self.sparse and self._has_data(step + 1):
            # the next batch is made while the PS closes the step (with tables it was made before, for its rows)
            self._batch_plan(step + 1)
        replies = self._finish(inflight)
        self._update_state(replies)
        if self.sparse and next_routes:
            self.rows = self._rows_from(replies, next_routes)
            self._rows_step = step + 1 if self._data_step() == step + 1 else None
        self._count(loss, batch, t_step)

    def _run_pipelined(self) -> None:
        """Async and bounded modes: step k's gradients go to the PS, then step k+1's are computed
        on the parameters at hand while the PS work, then step k's replies are read (one step
        more staleness, communication hidden behind compute). With embedding tables, push k asks
        for the rows of batch k+2, the first one computed after its reply is in; the rows of the
        first two batches are pulled before."""
        inflight = None  # (the exchange sent, the data step whose rows it brings)
        step = self.clock
        ahead: dict[int, dict[str, np.ndarray]] = {}
        if self.sparse:
            for data_step in (step, step + 1):
                if self._has_data(data_step):
                    _, _, requests, routes = self._batch_plan(data_step)
                    ahead[data_step] = self._rows_from(self._pull_rows(requests), routes)
        while not self.done:
            t_step = time.perf_counter()
            if not self._has_data(step):
                if inflight is not None:
                    self._update_state(self._finish(inflight[0]))
                return
            tags = list(self.versions)
            if self.sparse:
                self.rows, self._rows_step = ahead.pop(step), step
            loss, grads, routes, batch = self._compute(step)
            if inflight is not None:
                sent, rows_step = inflight
                replies = self._finish(sent)
                self._update_state(replies)
                if self.sparse and sent.routes:
                    ahead[rows_step] = self._rows_from(replies, sent.routes)
                if self.done:
                    break
            requests, routes_ahead = [dict() for _ in self.clients], {}
            if self.sparse and self._has_data(step + 2):
                _, _, requests, routes_ahead = self._batch_plan(step + 2)
            inflight = (
                self._send(
                    tags,
                    self.plan.split_push(self.dense_vars, grads, routes),
                    {"pull": True, "batch": batch, "loss": loss},
                    requests,
                    routes_ahead,
                ),
                step + 2,
            )
            step += 1
            self._count(loss, batch, t_step)

    def run(self) -> None:
        """Train until the PS reports the job's step count reached."""
        self.pull()
        log.info(
            json.dumps({"event": "joined", "worker": self.index, "step": self.versions[0], "mode": self.mode.value})
        )
        if self.pipeline:
            self._run_pipelined()
        while not self.done and not self.data_ended:
            self.train_step()
        if self.data_ended:
            log.info(json.dumps({"event": "data-ended", "worker": self.index, "step": self.versions[0]}))

    # ---- the end ----
    def full_params(self) -> dict[str, np.ndarray]:
        replies = self._map(lambda k: self.clients[k].pull_full(), [(k,) for k in range(len(self.clients))])
        out = {}
        for p in self.model.params:
            pieces = [
                replies[part.ps].tensors[part.name]
                for part in sorted(self.plan.parts_of(p.name), key=lambda q: q.start)
            ]
            out[p.name] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return out

    def step_summary(self) -> dict | None:
        """This worker's step times after the first tenth of its steps (start-up, tracing)."""
        times = self.step_times[max(2, len(self.step_times) // WARM_UP_ONE_IN) :]
        if not times:
            return None
        return {
            "steps": len(times),
            "median": float(np.median(times)),
            "p99": float(np.percentile(times, 99)),
            "max": float(np.max(times)),
        }

    def finish(self, export_path: str | None = None) -> dict:
        evaluate_now = self.test is not None and (not isinstance(self.test, Dataset) or len(self.test) > 0)
        # the whole model (embedding tables too) comes over only when something needs it
        params = self.full_params() if evaluate_now or export_path else {}
        result = {
            "worker": self.index,
            "steps": self.versions[0],
            "loss": self.last_loss,
            "accuracy": None,
            "step_seconds": self.step_summary(),
        }
        if evaluate_now:
            result.update(evaluate(self.model, params, self.test))
            if result["accuracy"] is not None:
                self.metrics.eval_accuracy.set(result["accuracy"])
            if "auc" in result:
                self.metrics.eval_auc.set(result["auc"])
        if export_path:
            example = self.train.take(np.arange(1))[0] if self.train is not None else self.batches.first[0]
            export_saved_model(self.model, params, example, export_path)
            result["export_path"] = export_path
        for client in self.clients:
            client.finish()
        return result

    def close(self) -> None:
        for source in (self.batches, self.test):
            if isinstance(source, FileBatches):
                source.close()
        if self.pool:
            self.pool.shutdown()
        for c in self.clients:
            c.close()
