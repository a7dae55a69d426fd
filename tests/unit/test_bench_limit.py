"""The bytes-inclusive limit's answering process (bench/limit.py), over real loopback sockets:
what it sends back with no update, with the async update and with the sync update, and with the
async update of a model's embedding tables (only the touched rows, the rows asked for back);
and the process settings every reference's processes run with."""

import math
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import MALLINFO_PRELUDE

from tfps.bench import limit

LR = 0.5


def _start(update: str, **tables) -> tuple[int, limit.Answerer]:
    answerer = limit.Answerer(update, LR, **tables)
    listener = socket.create_server((limit.LOOPBACK, 0))
    threading.Thread(target=limit.serve, args=(listener, answerer), daemon=True).start()
    return listener.getsockname()[1], answerer


def _params(exchange: limit.Exchange, grad: np.ndarray) -> np.ndarray:
    return exchange([grad] if len(grad) else [], 4 * 6).view(np.float32).copy()


def test_without_an_update_it_sends_back_as_many_bytes_as_asked_for():
    port, _ = _start("none")
    exchange = limit.Exchange(port)
    out = exchange([np.ones(10, np.float32)], 123)
    assert len(out) == 123
    assert exchange.moved == 40 + 123


def test_async_applies_each_push_in_turn_with_the_ps_kernel():
    port, answerer = _start("async")
    first, second = limit.Exchange(port), limit.Exchange(port)
    g1, g2 = np.arange(6, dtype=np.float32), np.full(6, 2.0, np.float32)
    assert _params(first, np.empty(0, np.float32)) == pytest.approx(
        np.zeros(6)
    )  # a pull alone: the parameters as they are
    assert _params(first, g1) == pytest.approx(-LR * g1)
    assert _params(second, g2) == pytest.approx(-LR * (g1 + g2))
    assert answerer.version == 2


def test_a_pipelined_worker_reads_the_answer_to_its_push_later():
    port, answerer = _start("async")
    worker = limit.Exchange(port)
    grad = np.arange(6, dtype=np.float32)
    worker.send([grad], 4 * 6)  # the worker computes its next step meanwhile: the update is made
    deadline = time.monotonic() + 5
    while answerer.version < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answerer.version == 1
    assert worker.receive(4 * 6).view(np.float32) == pytest.approx(-LR * grad)
    assert worker.moved == 2 * 4 * 6


def test_sync_waits_for_every_connected_worker_then_applies_their_mean():
    port, answerer = _start("sync")
    workers = [limit.Exchange(port), limit.Exchange(port)]
    grads = [np.arange(6, dtype=np.float32), np.full(6, 4.0, np.float32)]
    for w in workers:
        _params(w, np.empty(0, np.float32))
    out: list[np.ndarray] = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _params(workers[i], grads[i]))) for i in range(2)]
    threads[0].start()
    threads[0].join(0.2)
    assert threads[0].is_alive()  # the first push waits for the second worker's
    threads[1].start()
    for t in threads:
        t.join(5)
    expected = -LR * (grads[0] + grads[1]) / 2
    assert out[0] == pytest.approx(expected) and out[1] == pytest.approx(expected)
    assert answerer.version == 1


def test_sync_closes_a_step_without_a_worker_that_stays_silent(monkeypatch):
    monkeypatch.setattr(limit, "SYNC_WAIT_SECONDS", 0.2)
    port, answerer = _start("sync")
    active, silent = limit.Exchange(port), limit.Exchange(port)
    _params(silent, np.empty(0, np.float32))  # connected, then never pushes
    grad = np.ones(6, np.float32)
    assert _params(active, grad) == pytest.approx(-LR * grad)
    silent.conn.close()


def test_the_sync_update_is_refused_for_a_model_with_embedding_tables():
    with pytest.raises(SystemExit, match="dense model"):
        limit.main(["--model", "wide-deep", "--model-args", '{"vocabSize": 1000}', "--update", "sync"])


DENSE, ROWS, WIDTH = 3, 10, 2


def _rows_exchange(
    exchange: limit.Exchange, grads: list, pushed: list, wanted: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(the dense parameters, the rows asked for) sent back for one push.

    The push is of a 3-parameter dense part and a 10 x 2 table.
    """
    layout = limit._RowsLayout(DENSE, [WIDTH])
    (_, rows_at), size = limit.aligned_offsets([DENSE, len(wanted) * WIDTH])
    out = exchange(layout.push(grads, [pushed], [wanted]), 4 * size).view(np.float32)
    return out[:DENSE].copy(), out[rows_at:].reshape(len(wanted), WIDTH).copy()


def test_each_tensor_of_a_push_or_pull_starts_where_tensorflow_can_use_it_in_place():
    from tfps.runtime import wire
    from tfps.runtime.zerocopy import in_place

    arrays = [np.full(n, n, np.float32) for n in (3, 16, 1, 5)]
    offsets, size = limit.aligned_offsets([a.size for a in arrays])
    assert offsets == [0, 16, 32, 48] and size == 53
    received = wire.aligned_empty(4 * size).view(np.float32)  # as the worker receives it
    received[:] = np.concatenate(limit.padded(arrays))
    for arr, at in zip(arrays, offsets, strict=True):
        assert np.array_equal(received[at : at + arr.size], arr) and in_place(received[at : at + arr.size])


def test_tables_async_sgd_updates_only_the_pushed_rows_and_sends_back_the_rows_asked_for():
    port, answerer = _start("async", optimizer="sgd", dense_size=DENSE, tables=[(ROWS, WIDTH)])
    exchange = limit.Exchange(port)
    params, rows = _rows_exchange(exchange, [], [], np.array([2, 5]))  # a pull alone
    assert params == pytest.approx(np.zeros(DENSE)) and rows == pytest.approx(np.full((2, WIDTH), 0.01))
    dense, table_grad = np.array([1.0, 2.0, 3.0], np.float32), np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    params, rows = _rows_exchange(exchange, [dense, table_grad], [1, 5], np.array([5, 7]))
    assert params == pytest.approx(-LR * dense)
    assert rows[0] == pytest.approx(0.01 - LR * table_grad[1]) and rows[1] == pytest.approx([0.01, 0.01])
    table = answerer.tables[0][0]
    assert table[1] == pytest.approx(0.01 - LR * table_grad[0])
    assert np.all(table[[0, 2, 3, 4, 6, 7, 8, 9]] == np.float32(0.01))  # rows not pushed are not touched
    assert answerer.version == 1


def test_tables_async_adam_moves_only_the_pushed_rows_slots():
    port, answerer = _start("async", optimizer="adam", dense_size=DENSE, tables=[(ROWS, WIDTH)])
    exchange = limit.Exchange(port)
    grad = np.ones((1, WIDTH), np.float32)
    params, rows = _rows_exchange(exchange, [np.ones(DENSE, np.float32), grad], [4], np.array([4]))
    # Adam's first step moves each parameter by about its learning rate, against the gradient's sign
    assert params == pytest.approx(np.full(DENSE, -LR), rel=1e-3)
    assert rows[0] == pytest.approx(0.01 - LR, rel=1e-3)
    table, slots = answerer.tables[0]
    assert np.all(slots["m"][4] != 0) and not np.any(
        np.delete(slots["m"], 4, axis=0)
    )  # lazy: the other rows' moments stay
    assert np.all(np.delete(table, 4, axis=0) == np.float32(0.01))


def _wide_deep_params():
    from tfps.runtime.models import load_model

    return load_model(
        "wide-deep", {"vocabSize": 40, "fields": 2, "embeddingDim": 4, "denseDim": 3, "hidden": [5], "testSamples": 0}
    ).params


def test_one_answerer_takes_the_model_whole_in_its_order():
    params = _wide_deep_params()
    shards = limit.Shards(params, 1)
    assert [q.name for q in shards.dense[0]] == [p.name for p in params if not p.sparse]
    assert [q.name for q in shards.tables[0]] == [p.name for p in params if p.sparse]
    ids = np.array([3, 17, 39])
    assert shards.ids(0, {t.name: shards.routes(t.name, ids) for t in shards.tables[0]}) == [ids] * len(
        shards.tables[0]
    )


def test_sharded_pushes_and_pulls_split_the_model_as_the_ps_placement_does_and_join_it_back():
    from tfps.runtime.sharding import place

    params = _wide_deep_params()
    shards = limit.Shards(params, 2)
    assert sorted((q.name, q.ps) for k in (0, 1) for q in shards.dense[k] + shards.tables[k]) == sorted(
        (q.name, q.ps) for q in place(params, 2).parts
    )
    tables = [p for p in params if p.sparse]
    ids = np.array([1, 7, 22, 38])  # sorted distinct ids of a batch: rows 0..19 on answerer 0, 20..39 on answerer 1
    routes = {t.name: shards.routes(t.name, ids) for t in tables}
    assert [list(rows) for rows in shards.ids(0, routes)] == [[1, 7]] * len(tables)
    assert [list(rows) for rows in shards.ids(1, routes)] == [[2, 18]] * len(tables)  # local to the part

    grads = {
        p.name: np.arange(math.prod(p.shape[1:]) * (len(ids) if p.sparse else p.shape[0]), dtype=np.float32).reshape(
            (len(ids), *p.shape[1:]) if p.sparse else p.shape
        )
        for p in params
    }
    pushes = shards.pushes(grads, routes)
    for k in (0, 1):
        rows = pushes[k][-len(shards.tables[k]) :]
        assert all(
            np.array_equal(r, grads[q.var][2 * k : 2 * k + 2]) for r, q in zip(rows, shards.tables[k], strict=True)
        )

    # each answerer's reply (its dense parts, then its rows asked for) joins into every parameter
    pulls = [shards.pull(k, routes) for k in (0, 1)]
    received = []
    for k, (*pieces, size) in enumerate(pulls):
        buf = np.zeros(size, np.float32)
        for q, _, at, n in pieces:
            whole = grads[q.var]
            buf[at : at + n] = (whole[2 * k : 2 * k + 2] if q.sparse else whole).reshape(-1)
        received.append(buf)
    joined = shards.join(received, pulls)
    assert set(joined) == {p.name for p in params}
    for p in params:
        assert np.array_equal(joined[p.name], grads[p.name]), p.name


_SETTINGS = (
    MALLINFO_PRELUDE
    + r"""
import argparse, json, os, sys, threading
from tfps.bench.procs import child_or_orchestrator

def settings(args=None):
    block = bytearray(16 << 20)  # a step's message, dropped
    del block
    thread = threading.Thread(target=lambda: bytearray(8 << 20))  # what a request thread builds and drops
    thread.start()
    thread.join()
    print(json.dumps({"batch": os.sched_getscheduler(0) == os.SCHED_BATCH,
                      "kept": libc.mallinfo2().fordblks >= 16 << 20}), flush=True)
    libc.malloc_stats()  # one "Arena N:" section per arena, on stderr

role = sys.argv[1]
child_or_orchestrator(argparse.Namespace(child=role == "child"), settings, lambda args: settings() or {})
"""
)


@pytest.mark.parametrize("role, arenas", [("child", 2), ("orchestrator", 1)])
def test_the_references_processes_run_with_a_tfps_process_settings(role, arenas):
    """The limits and the ceiling stand for tfps's own processes, so they run as those do
    (runtime/process.py): under SCHED_BATCH, large buffers kept in the heap for the next step
    (glibc's own accounting, mallinfo2), and the answering process, as a PS, in one arena (its
    request thread allocates from the main heap); a child, as a worker, gives each thread its own."""
    env = {k: v for k, v in os.environ.items() if k != "TFPS_SCHED_BATCH"}
    other = lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # noqa: E731
    out = subprocess.run(
        [sys.executable, "-c", _SETTINGS, role],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        preexec_fn=other,
        timeout=120,
    )
    assert out.stdout.splitlines()[0] == '{"batch": true, "kept": true}'
    assert sum(line.startswith("Arena ") for line in out.stderr.splitlines()) == arenas
