"""Anchor: the bytes-inclusive limit.

`python -m tfps.bench.limit --model mlp --model-args '{"hidden": [512, 512]}' --batch 128`
starts the same number of worker processes as the PS runs, each computing gradients the
way a tfps worker does (tfps's grad_fn on the same `ModelDef`, batches and parameters as
tensors, a batch's table ids numbered by its distinct ids with tfps's `batch_ids`), and
moving each step's bytes over a plain TCP socket to a process that only answers: the push
(every dense gradient, and the touched rows' gradients of each embedding table) out, the pull
(every dense parameter, and the rows the next batch touches) back.
No optimizer, no framing beyond a length; each tensor starts on wire.ALIGN (`aligned_offsets`),
as in a tfps message, so that TensorFlow uses the received bytes in place, as a tfps worker's.
Each worker sizes TensorFlow's thread pools as `tfps local` sizes a replica's (`--processes`).
Prints one JSON line: the aggregate examples/s and the bytes moved per step. The PS cannot do
better than this with the same bytes.

With `--update async` or `--update sync` (dense models), the answering process also does the
optimizer's update, with the PS's own kernel (runtime/optimizers.py), and what goes back is the
parameters it made: each push applied in turn (async), or one update with the mean of every
connected worker's push, every worker waiting for it (sync). With the async update the workers
run as tfps's async workers do: each reads the answer to its previous push only once it has
computed the next step's gradients, so the update runs while they compute. That is what a PS
with no cost of its own beyond the bytes and the update would reach.

A model with embedding tables takes `--update async` too, with `--optimizer` (sgd or adam): its
push then also carries the row ids, those of the rows its gradients are for and those of the
rows it asks back (`_RowsLayout`), and the answering process holds the whole tables and their
slots, updates only the touched rows with the PS's row kernels (lazily, as the PS does) and
sends back the rows asked for, taken from the tables.

With `--answerers N` the bytes go to N answering processes, split as tfps's placement splits a
model over N PS (runtime/sharding.py): each holds its parts and answers for them, and a worker
exchanges with all N each step, as a tfps worker with each PS. That is the topology of a job
with N PS, with nothing of a PS's own cost in it; `--answerers 1` (the default) is the limit
the goals compare with. A table's rows (or a dense variable) split over several answerers are
joined on the worker with one copy, where a tfps worker receives them in place.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from tfps.runtime.sharding import place, route_rows
from tfps.runtime.wire import ALIGN, aligned_array

from .procs import (
    LOOPBACK,
    add_processes_argument,
    child_env,
    child_or_orchestrator,
    flag_args,
    last_json_line,
    module_cmd,
    run_json,
    run_together,
    size_tf_threads,
    timed_window,
)

MODULE = "tfps.bench.limit"
STARTUP_S = 150.0  # allowance for starting the processes on a busy machine
_HEADER = struct.Struct("<QQ")  # push bytes that follow, pull bytes wanted back
UPDATES = ("none", "async", "sync")
# A sync step closes without a worker silent this long: one that finished its warm-up waits,
# without pushing, for the others to finish theirs (procs.timed_window).
SYNC_WAIT_SECONDS = 0.5
_ALIGN_FLOATS = ALIGN // 4


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of float32 tensors of `sizes` elements starts in a push or pull whose tensors each
    start on wire.ALIGN (in elements from its start), and the elements of the whole."""
    offsets, end = [], 0
    for size in sizes:
        end += -end % _ALIGN_FLOATS
        offsets.append(end)
        end += size
    return offsets, end


def padded(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """float32 `arrays` with zeros between them, each where `aligned_offsets` puts it."""
    out, end = [], 0
    for arr in arrays:
        if pad := -end % _ALIGN_FLOATS:
            out.append(np.zeros(pad, np.float32))
            end += pad
        out.append(arr)
        end += arr.size
    return out


class _RowsLayout:
    """A push with embedding tables when the answering process updates them (all little-endian):

        counts  = int64 [has gradients, rows pushed per table..., rows asked for per table...]
        ids     = int64, each table's pushed rows, then each table's rows asked for
        dense   = float32, every dense gradient in the model's order, `padded` (when it has gradients)
        rows    = float32, each table's pushed rows' gradients

    Its answer: the dense parameters (as pushed: `padded`), then each table's rows asked for
    (float32), each part where `aligned_offsets` puts it."""

    def __init__(self, dense_size: int, widths: list[int]):
        self.dense_size, self.widths = dense_size, widths

    def push(self, grads: list[np.ndarray], pushed: list[np.ndarray], wanted: list[np.ndarray]) -> list[np.ndarray]:
        """`grads`: the dense gradients then each table's (none: a pull alone); `pushed`, `wanted`: ids per table."""
        counts = np.array([1 if grads else 0, *(len(i) for i in pushed), *(len(i) for i in wanted)], np.int64)
        return [counts, *(np.asarray(i, np.int64) for i in [*pushed, *wanted]), *grads]

    def split(
        self, view: memoryview
    ) -> tuple[np.ndarray | None, list[tuple[np.ndarray, np.ndarray]], list[np.ndarray]]:
        """(the dense gradients as one array or None, each table's (ids, gradients), each table's ids asked for)."""
        tables = len(self.widths)
        counts = np.frombuffer(view, np.int64, 1 + 2 * tables)
        offset = counts.nbytes
        ids = []
        for n in counts[1:]:
            ids.append(np.frombuffer(view, np.int64, int(n), offset))
            offset += 8 * int(n)
        if not counts[0]:
            return None, [], ids[tables:]
        dense = np.frombuffer(view, np.float32, self.dense_size, offset)
        offset += dense.nbytes
        pushed = []
        for rows, width in zip(ids[:tables], self.widths, strict=True):
            grad = np.frombuffer(view, np.float32, len(rows) * width, offset).reshape(len(rows), width)
            pushed.append((rows, grad))
            offset += grad.nbytes
        return dense, pushed, ids[tables:]


class Answerer:
    """The process that only answers: reads each push whole and sends back as many bytes as
    asked for, until the peer closes. With an `update` ("async" or "sync"), pushes and pulls
    are one dense model's gradients and parameters (float32, in the same order), and the bytes
    sent back are the parameters after the update (`ShardOptimizer`, the PS's kernel). With
    `tables` (their shapes; async only), pushes follow `_RowsLayout` and the answering process
    holds the tables and their optimizer slots."""

    def __init__(
        self,
        update: str = "none",
        learning_rate: float = 0.01,
        optimizer: str = "sgd",
        dense_size: int = 0,
        tables: list[tuple[int, int]] | None = None,
    ):
        from tfps.api.spec import OptimizerSpec
        from tfps.runtime.optimizers import ShardOptimizer

        self.update = update
        self.optimizer = ShardOptimizer(
            OptimizerSpec.model_validate({"name": optimizer, "learningRate": learning_rate})
        )
        self.cond = threading.Condition()
        self.params: np.ndarray | None = None  # replaced by each update, never changed in place
        self.slots: dict[str, np.ndarray] = {}  # the dense parameters' optimizer slots, replaced alike
        self.version = 0
        self.live = 0  # connected workers: a sync step waits for a push from each
        self.pushes: list[np.ndarray] = []  # this sync step's so far
        self.rows: _RowsLayout | None = None
        self.cpu, self.requests = 0.0, 0  # of connections that ended (`cpu_used`)
        if tables and update != "none":
            if update != "async":
                raise ValueError("a model with embedding tables takes the async update only")
            from tfps.runtime._rows import take

            self._take = take
            self.rows = _RowsLayout(dense_size, [width for _, width in tables])
            self._reset(dense_size)
            # written whole now, as the PS's are: fresh zero pages faulted in at random rows would be timed
            self.tables = [
                (
                    np.full(shape, 0.01, np.float32),
                    {s: self.optimizer.initial_slot(s, shape) for s in self.optimizer.slot_names()},
                )
                for shape in tables
            ]

    def answer(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        inbox, outbox = bytearray(1 << 20), bytes(1 << 20)
        header = bytearray(_HEADER.size)
        cpu, requests = time.thread_time(), 0
        with self.cond:
            self.live += 1
        try:
            while _recv_exact(conn, memoryview(header)):
                requests += 1
                push, pull = _HEADER.unpack(header)
                if push > len(inbox):
                    inbox = bytearray(push)
                if pull > len(outbox):
                    outbox = bytes(pull)
                if not _recv_exact(conn, memoryview(inbox)[:push]):
                    return
                dense = not push % 4 and push in (0, pull)  # one dense model's float32 gradients, or a pull alone
                if self.rows is not None:
                    for piece in self._answer_rows(memoryview(inbox)[:push]):
                        conn.sendall(memoryview(piece).cast("B"))
                elif self.update == "none" or not dense:
                    conn.sendall(memoryview(outbox)[:pull])
                else:
                    conn.sendall(
                        memoryview(self._parameters(np.frombuffer(inbox, np.float32, push // 4), pull // 4)).cast("B")
                    )
        finally:
            with self.cond:
                self.live -= 1
                self.cpu += time.thread_time() - cpu
                self.requests += requests
                self.cond.notify_all()  # a sync step no longer waits for this worker

    def cpu_used(self, timeout: float = 10.0) -> tuple[float, int]:
        """The CPU seconds the answering threads used and the requests they answered, once every
        connection has ended (its worker exited)."""
        with self.cond:
            self.cond.wait_for(lambda: self.live == 0, timeout)
            return self.cpu, self.requests

    def _reset(self, size: int) -> None:
        self.params = np.zeros(size, np.float32)
        self.slots = {s: self.optimizer.initial_slot(s, (size,)) for s in self.optimizer.slot_names()}

    def _answer_rows(self, view: memoryview) -> list[np.ndarray]:
        """Apply a `_RowsLayout` push (its dense gradients, then its rows', only those rows) and
        answer the parameters and the rows asked for."""
        return padded(self.update_rows(*self.rows.split(view)))

    def update_rows(
        self, grad: np.ndarray | None, pushed: list[tuple[np.ndarray, np.ndarray]], wanted: list[np.ndarray]
    ) -> list[np.ndarray]:
        """A push taken apart (`_RowsLayout.split`) applied: the parameters, then the rows asked for."""
        with self.cond:
            if grad is not None:
                self._apply(grad)
                for (table, slots), (ids, values) in zip(self.tables, pushed, strict=True):
                    self.optimizer.apply_rows(table, slots, ids, values, self.version)
            out = [self.params]
            for (table, _), ids in zip(self.tables, wanted, strict=True):
                out.append(np.empty((len(ids), table.shape[1]), np.float32))
                self._take(table, ids, out[-1])
        return out

    def _parameters(self, grad: np.ndarray, size: int) -> np.ndarray:
        """The parameters after this push's update (an empty push: the parameters as they are)."""
        with self.cond:
            if self.params is None or len(self.params) != size:
                self._reset(size)
            if not len(grad):
                return self.params
            if self.update == "async":
                self._apply(grad)
                return self.params
            # sync: the push is a view of this connection's inbox, which it does not reuse until answered
            step, deadline = self.version, time.monotonic() + SYNC_WAIT_SECONDS
            self.pushes.append(grad)
            while self.version == step:
                if len(self.pushes) >= self.live or time.monotonic() >= deadline:
                    *others, last = self.pushes
                    self.pushes = []
                    # the kernel adds `plus` in its pass (as the PS's sync step does): no sum for two workers
                    plus = others[0] if len(others) == 1 else (np.sum(others, axis=0) if others else None)
                    self._apply(last, plus, 1 + len(others))
                    self.cond.notify_all()
                else:
                    self.cond.wait(deadline - time.monotonic())
            return self.params

    def _apply(self, grad: np.ndarray, plus: np.ndarray | None = None, count: int = 1) -> None:
        self.version += 1
        self.params, self.slots = self.optimizer.apply_dense(
            self.params, self.slots, grad, self.version, plus, 1.0 / count, check=False
        )


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def serve(listener: socket.socket, answerer: Answerer) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answerer.answer, args=(conn,), daemon=True).start()


class Exchange:
    """One worker's side: send the push's arrays, receive the pull into an aligned buffer
    (`send` then `receive`, one exchange at a time; a call does both)."""

    def __init__(self, port: int):
        self.conn = socket.create_connection((LOOPBACK, port))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.moved = 0

    def __call__(self, push: list, pull_bytes: int):
        self.send(push, pull_bytes)
        return self.receive(pull_bytes)

    def send(self, push: list, pull_bytes: int) -> None:
        views = [memoryview(a).cast("B") for a in push]
        nbytes = sum(len(v) for v in views)
        self.conn.sendall(_HEADER.pack(nbytes, pull_bytes))
        for view in views:
            self.conn.sendall(view)
        self.moved += nbytes

    def receive(self, pull_bytes: int):
        from tfps.runtime import wire

        buf = wire.aligned_empty(pull_bytes)
        if not _recv_exact(self.conn, memoryview(buf)):
            raise ConnectionError("the answering process went away")
        self.moved += pull_bytes
        return buf


class Shards:
    """A model's parameters over `n` answering processes as tfps's placement puts them on n PS
    (runtime/sharding.py's `place`): per answerer its dense parts and its table parts, each in
    the model's order (with one answerer: the model's parameters, in its order). Pure: it says
    what goes to and comes from each answerer."""

    def __init__(self, params: list, n: int):
        self.n, self.plan = n, place(params, n)
        order = {p.name: i for i, p in enumerate(params)}
        mine = [sorted(self.plan.for_ps(k), key=lambda q: (order[q.var], q.start)) for k in range(n)]
        self.dense = [[q for q in parts if not q.sparse] for parts in mine]
        self.tables = [[q for q in parts if q.sparse] for parts in mine]
        # parameters split over several answerers (their rows joined on arrival), and their row shape
        self.joined = {p.name: tuple(p.shape[1:]) for p in params if len(self.plan.parts_of(p.name)) > 1}

    def answerer(self, k: int) -> tuple[int, list[tuple[int, ...]]]:
        """Answerer `k`'s dense elements as pushed and pulled (`padded`) and its table parts' shapes."""
        return aligned_offsets([q.size for q in self.dense[k]])[1], [q.shape for q in self.tables[k]]

    def routes(self, table: str, ids: np.ndarray) -> dict:
        """Per part of `table`: where its rows are among a batch's sorted distinct `ids`, and its local rows."""
        if self.n == 1:
            return {table: (range(len(ids)), ids)}
        return {part.name: (positions, local) for part, positions, local in route_rows(self.plan.parts_of(table), ids)}

    def pushes(self, grads: dict[str, np.ndarray], routes: dict) -> list[list[np.ndarray]]:
        """Per answerer: its dense parts' gradients (`padded`), then its table parts' rows'.

        `routes` is `routes()`'s answer, per table.
        """
        out = []
        for k in range(self.n):
            dense = [grads[q.var][q.start : q.stop] if q.var in self.joined else grads[q.var] for q in self.dense[k]]
            out.append(padded(dense) + [grads[q.var][_span(routes, q)] for q in self.tables[k]])
        return out

    def ids(self, k: int, routes: dict | None) -> list:
        """Answerer `k`'s local rows of each of its table parts in `routes` (none without)."""
        return [_route(routes, q)[1] if routes is not None else [] for q in self.tables[k]]

    def pull(self, k: int, routes: dict) -> list[tuple[object, tuple[int, ...], int, int]]:
        """What answerer `k` sends back for a batch's `routes`: (part, shape, offset, elements) of
        each piece, and, last, the elements of the whole."""
        shapes = [q.shape for q in self.dense[k]] + [(len(_route(routes, q)[0]), *q.shape[1:]) for q in self.tables[k]]
        sizes = [math.prod(shape) for shape in shapes]
        offsets, size = aligned_offsets(sizes)
        return [*zip([*self.dense[k], *self.tables[k]], shapes, offsets, sizes, strict=True), size]

    def join(self, received: list[np.ndarray], pulls: list[list]) -> dict[str, np.ndarray]:
        """Every parameter (a table: the rows asked for) from each answerer's float32 reply."""
        params, split = {}, {}
        for buf, (*pieces, _) in zip(received, pulls, strict=True):
            for q, shape, a, n in pieces:
                if q.var not in self.joined:
                    params[q.var] = buf[a : a + n].reshape(shape)
                elif n:
                    split.setdefault(q.var, []).append((q.start, buf[a : a + n].reshape(shape)))
        for name, row in self.joined.items():
            parts = [arr for _, arr in sorted(split.get(name, ()), key=lambda item: item[0])]
            whole = aligned_array((sum(len(arr) for arr in parts), *row), np.float32)
            params[name] = np.concatenate(parts, out=whole) if parts else whole
        return params


def child(args: argparse.Namespace) -> None:
    from tfps.runtime.models import BatchSource, load_model
    from tfps.runtime.process import freeze_startup_objects
    from tfps.runtime.sharding import batch_ids
    from tfps.runtime.worker import make_grad_fn
    from tfps.runtime.zerocopy import as_tensor

    threads = size_tf_threads(args.processes)
    model = load_model(args.model, json.loads(args.model_args), args.seed)
    train, _ = model.data()
    batches = BatchSource(train, args.seed, args.batch, args.index, args.workers)
    grad_fn = make_grad_fn(model)
    shards = Shards(model.params, len(args.port.split(",")))
    tables = model.sparse_params
    layouts = (
        [_RowsLayout(shards.answerer(k)[0], [q.shape[1] for q in shards.tables[k]]) for k in range(shards.n)]
        if tables and args.update != "none"
        else None
    )
    exchanges = [Exchange(int(port)) for port in args.port.split(",")]
    state = {"step": 0}
    freeze_startup_objects()

    def unique_ids(step: int):
        x, y = batches(step)
        out = dict(x)
        uniq = {}
        for feature in {t.feature for t in tables}:
            uniq[feature], out[feature] = batch_ids(x[feature])  # as a tfps worker
        return out, y, {t.name: shards.routes(t.name, uniq[t.feature]) for t in tables}

    def request(push: list[list], routes: dict, pushed: dict | None = None):
        """Send each answerer its `push` (`pushed`: the routes of the rows whose gradients it
        holds), asking back its parameters and its rows of `routes`; returns the call that
        receives them, as tensors of the received bytes (joined where parts came from several)."""
        pulls = [shards.pull(k, routes) for k in range(shards.n)]
        for k, exchange in enumerate(exchanges):
            out = push[k]
            if layouts is not None:
                out = layouts[k].push(out, shards.ids(k, pushed if out else None), shards.ids(k, routes))
            exchange.send(out, 4 * pulls[k][-1])

        def receive() -> dict:
            received = [
                exchange.receive(4 * pull[-1]).view(np.float32) for exchange, pull in zip(exchanges, pulls, strict=True)
            ]
            return {name: as_tensor(arr) for name, arr in shards.join(received, pulls).items()}

        return receive

    def gradients(params: dict, x: dict, y, routes: dict) -> list[list]:
        _, grads = grad_fn(params, {k: as_tensor(v) for k, v in x.items()}, as_tensor(y))
        return shards.pushes({name: np.asarray(g) for name, g in grads.items()}, routes)

    # (x, y, routes) of the batches ahead, the one computed next first
    ahead = [unique_ids(0)]
    nothing = [[] for _ in exchanges]
    params = request(nothing, ahead[0][2])()
    in_flight = None

    def waiting_step() -> None:
        nonlocal params
        x, y, routes = ahead[0]
        push = gradients(params, x, y, routes)
        state["step"] += 1
        ahead[0] = unique_ids(state["step"])  # the rows the next batch needs ride along, as in tfps
        params = request(push, ahead[0][2], routes)()

    def pipelined_step() -> None:
        """As tfps's async workers: push k goes out once step k is computed and the reply to push
        k-1 is read (step k+1's parameters and rows), and asks for the rows of batch k+2."""
        nonlocal params, in_flight
        x, y, routes = ahead[0]
        push = gradients(params, x, y, routes)
        params = in_flight()
        state["step"] += 1
        ahead[:] = [ahead[1], unique_ids(state["step"] + 1)]
        in_flight = request(push, ahead[1][2], routes)

    step = waiting_step
    if args.update == "async":  # the first two batches' rows are pulled before
        ahead.append(unique_ids(1))
        in_flight, step = request(nothing, ahead[1][2]), pipelined_step

    moved_before = sum(e.moved for e in exchanges)
    steps, elapsed, cpu = timed_window(step, args.warmup_seconds, args.seconds)
    per_step = (sum(e.moved for e in exchanges) - moved_before) / max(1, state["step"])
    print(
        json.dumps(
            {
                "steps": steps,
                "seconds": elapsed,
                "cpu_seconds": cpu,
                "examples_per_second": steps * args.batch / elapsed,
                "bytes_per_step": per_step,
                "threads": threads,
            }
        ),
        flush=True,
    )


_NO_ROWS = (range(0), [])


def _route(routes: dict, part) -> tuple[range, object]:
    """A table part's (positions among a batch's ids, local rows) in `routes` (Shards.routes' per table)."""
    return routes[part.var].get(part.name, _NO_ROWS)


def _span(routes: dict, part) -> slice:
    positions = _route(routes, part)[0]
    return slice(positions.start, positions.stop)


def _answer_main(args: argparse.Namespace, shards: Shards, k: int) -> tuple[Answerer, socket.socket]:
    """Answering process `k`'s state and listener, serving."""
    dense_size, tables = shards.answerer(k)
    answerer = Answerer(args.update, args.learning_rate, args.optimizer, dense_size, tables)
    listener = socket.create_server((LOOPBACK, 0))
    threading.Thread(target=serve, args=(listener, answerer), daemon=True).start()
    return answerer, listener


def answer(args: argparse.Namespace) -> dict:
    """Answering process `args.answer` of several: says its port, answers until its stdin closes
    (the measurement is over), then reports the CPU its answering threads used."""
    from tfps.runtime.models import load_model
    from tfps.runtime.process import freeze_startup_objects

    model = load_model(args.model, json.loads(args.model_args), args.seed)
    answerer, listener = _answer_main(args, Shards(model.params, args.answerers), args.answer)
    freeze_startup_objects()
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    sys.stdin.read()
    cpu, requests = answerer.cpu_used()
    return {"cpu_seconds": cpu, "requests": requests}


def measure(args: argparse.Namespace) -> dict:
    from tfps.runtime.models import load_model
    from tfps.runtime.process import freeze_startup_objects

    model = load_model(args.model, json.loads(args.model_args), args.seed)
    tables = model.sparse_params
    if tables and args.update == "sync":
        raise SystemExit("--update sync takes a dense model: a model with embedding tables takes --update async")
    if args.update == "sync" and args.answerers > 1:
        raise SystemExit("--update sync takes one answering process")
    answerer, listener = _answer_main(args, Shards(model.params, args.answerers), 0)
    freeze_startup_objects()
    # the other answering processes, each its own process as each PS is
    model_flags = {"--model": args.model, "--model-args": args.model_args, "--seed": args.seed, "--update": args.update}
    common = flag_args(
        {
            **model_flags,
            "--optimizer": args.optimizer,
            "--learning-rate": args.learning_rate,
            "--answerers": args.answerers,
        }
    )
    others = [
        subprocess.Popen(
            module_cmd(MODULE, *common, "--answer", str(k)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            text=True,
        )
        for k in range(1, args.answerers)
    ]
    try:
        ports = [listener.getsockname()[1], *(json.loads(proc.stdout.readline())["port"] for proc in others)]
        options = {
            **model_flags,
            "--batch": args.batch,
            "--workers": args.workers,
            "--seconds": args.seconds,
            "--warmup-seconds": args.warmup_seconds,
            "--port": ",".join(map(str, ports)),
            "--processes": args.processes,
        }
        base = ["--child", *flag_args(options)]
        results = run_together(
            [module_cmd(MODULE, *base, "--index", str(i)) for i in range(args.workers)], args.seconds * 4 + 120
        )
        answering_cpu, requests = answerer.cpu_used()
        for proc in others:
            out = last_json_line(proc.communicate("", timeout=30)[0])
            answering_cpu += out["cpu_seconds"]
    finally:
        for proc in others:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    steps = sum(r["steps"] for r in results)
    system = "limit" if args.update == "none" else f"limit_update_{args.optimizer if tables else args.update}"
    return {
        "system": system if args.answerers == 1 else f"{system}_sharded",
        "examples_per_second": sum(r["examples_per_second"] for r in results),
        "per_worker": [r["examples_per_second"] for r in results],
        "bytes_per_step": sum(r["bytes_per_step"] for r in results) / len(results),
        "seconds": max(r["seconds"] for r in results),
        "workers": args.workers,
        "answerers": args.answerers,
        "threads": results[0]["threads"],
        "worker_cpu_ms_per_step": 1000.0 * sum(r["cpu_seconds"] for r in results) / steps if steps else None,
        # each worker step is one request to each answering process: per worker step, all of them together
        "ps_cpu_ms_per_step": 1000.0 * answering_cpu / requests if requests else None,
    }


def run(
    shape,
    cfg: dict,
    update: str = "none",
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    sharded: bool = False,
) -> dict:
    """Measure the limit for a benchmark shape (bench/mlp.py's or bench/embedding.py's); with
    `update`, the limit with the optimizer's update (`optimizer`'s: embedding shapes, async); with
    `sharded`, over as many answering processes as the shape has PS."""
    lr = cfg["learning_rate"] if learning_rate is None else learning_rate
    answerers = shape.ps if sharded else 1
    options = {
        "--model": shape.model,
        "--model-args": json.dumps(shape.model_args),
        "--batch": shape.batch,
        "--workers": shape.workers,
        "--seconds": cfg["seconds"],
        "--warmup-seconds": cfg["warmup_seconds"],
        "--processes": shape.workers + shape.ps,
        "--update": update,
        "--optimizer": optimizer,
        "--learning-rate": lr,
        "--answerers": answerers,
    }
    cmd = module_cmd(MODULE, *flag_args(options))
    what = "limit" if update == "none" else f"limit with the {update} {optimizer} update"
    if sharded:
        what += f" over {answerers} answering processes"
    return run_json(cmd, STARTUP_S + 4 * (cfg["seconds"] + cfg["warmup_seconds"]), f"{what} ({shape.name})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="a tfps built-in model")
    parser.add_argument("--model-args", default="{}", help="its spec.training.modelArgs, as JSON")
    parser.add_argument("--batch", type=int, default=128, help="per worker")
    parser.add_argument("--workers", type=int, default=2)
    add_processes_argument(parser)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--update",
        choices=UPDATES,
        default="none",
        help=(
            "the answering process also applies the optimizer's update to the parameters "
            "it sends back (sync: dense models)"
        ),
    )
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "adam"),
        default="sgd",
        help="of that update: sgd, or adam for a model with embedding tables (lazy on their rows, as the PS's)",
    )
    parser.add_argument("--learning-rate", type=float, default=0.01, help="of that update")
    parser.add_argument(
        "--answerers",
        type=int,
        default=1,
        help="answering processes, the model split over them as tfps splits it over that many PS (async or none)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", default="0", help=argparse.SUPPRESS)  # the answering processes', comma-separated
    parser.add_argument("--answer", type=int, default=None, help=argparse.SUPPRESS)  # this process answers as that one
    args = parser.parse_args(argv)
    if args.answerers < 1:
        parser.error("--answerers must be at least 1")
    return child_or_orchestrator(args, child, answer if args.answer is not None else measure)


if __name__ == "__main__":
    sys.exit(main())
