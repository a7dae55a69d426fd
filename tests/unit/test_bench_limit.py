"""The bytes-inclusive limit's answering process (bench/limit.py), over real loopback sockets:
what it sends back with no update, with the async update and with the sync update."""
import socket
import threading

import numpy as np
import pytest

from tfps.bench import limit

LR = 0.5


def _start(update: str) -> tuple[int, limit.Answerer]:
    answerer = limit.Answerer(update, LR)
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
    assert _params(first, np.empty(0, np.float32)) == pytest.approx(np.zeros(6))  # a pull alone: the parameters as they are
    assert _params(first, g1) == pytest.approx(-LR * g1)
    assert _params(second, g2) == pytest.approx(-LR * (g1 + g2))
    assert answerer.version == 2


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


def test_update_is_refused_for_a_model_with_embedding_tables():
    with pytest.raises(SystemExit, match="dense model"):
        limit.main(["--model", "wide-deep", "--model-args", '{"vocabSize": 1000}', "--update", "async"])
