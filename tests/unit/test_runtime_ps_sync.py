"""A sync step's sum reads each push from its request's own buffer while that request waits for
the step, and copies a push only when its request is answered before the step closes: the data
path reads the worker's next request into the same buffer once it has the reply."""

import threading

import numpy as np
import pytest
from support import lone_shard

from tfps.api.spec import TrainingSpec
from tfps.runtime import ps, wire
from tfps.runtime.models import load_model
from tfps.runtime.ps import Shard

ARGS = {"inputDim": 16, "hidden": [8], "samples": 64, "testSamples": 0}
LR = 0.5


def _shard(workers: int) -> Shard:
    training = TrainingSpec.model_validate(
        {
            "model": "mlp",
            "modelArgs": ARGS,
            "optimizer": {"name": "sgd", "learningRate": LR},
            "batchSize": 8,
            "steps": 100,
            "consistency": {"mode": "sync"},
            "checkpoint": {"everySteps": 10**6},
        }
    )
    return lone_shard(load_model("mlp", ARGS, 0).params, training, workers=workers)


def _gradients(shard: Shard, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(part.shape).astype(np.float32) for name, part in shard.parts.items()}


def _request(worker: int, grads: dict) -> np.ndarray:
    """The push as the data path holds it: in a buffer that it reuses for the worker's next request."""
    data = wire.encode({"worker": worker, "tag": 0, "batch": 8, "pull": True}, grads)
    buf = wire.aligned_empty(len(data))
    buf[:] = np.frombuffer(data, np.uint8)
    return buf


def _reply(out: list) -> wire.Message:
    return wire.decode(b"".join(bytes(memoryview(p).cast("B")) for p in out))


def _overwrite(buf: np.ndarray) -> None:
    """What the worker's next request would do to the buffer (NaN bytes: a stale view would show)."""
    buf[:] = 0xFF


@pytest.mark.parametrize("workers", [2, 3])
def test_a_step_closed_while_every_push_waits_applies_the_mean(workers):
    shard = _shard(workers)
    before = {name: var.copy() for name, var in shard.vars.items()}
    grads = [_gradients(shard, w) for w in range(workers)]
    bufs = [_request(w, grads[w]) for w in range(workers)]
    replies: list = [None] * workers

    def push(w: int) -> None:
        replies[w] = _reply(shard.step(memoryview(bufs[w]), encoding="pieces"))
        _overwrite(bufs[w])

    threads = [threading.Thread(target=push, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(r is not None and r.meta["version"] == 1 and not r.meta["pending"] for r in replies)
    for name, var in shard.vars.items():
        mean = sum(g[name] for g in grads) / np.float32(workers)
        np.testing.assert_allclose(var, before[name] - LR * mean, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(replies[0].tensors[name], var)


def test_a_push_answered_before_its_step_closes_is_kept_before_its_buffer_is_reused(monkeypatch):
    monkeypatch.setattr(ps, "POLL_SECONDS", 0.05)  # worker 0's request is answered "pending" soon
    shard = _shard(2)
    before = {name: var.copy() for name, var in shard.vars.items()}
    g0, g1 = _gradients(shard, 0), _gradients(shard, 1)
    first = _request(0, g0)
    reply = _reply(shard.step(memoryview(first), encoding="pieces"))
    assert reply.meta["pending"] and shard.version == 0
    _overwrite(first)  # its next request arrives in the same buffer
    reply = _reply(shard.step(memoryview(_request(1, g1)), encoding="pieces"))
    assert reply.meta["version"] == 1
    for name, var in shard.vars.items():
        assert np.isfinite(var).all(), name
        np.testing.assert_allclose(
            var, before[name] - LR * (g0[name] + g1[name]) / 2, rtol=1e-5, atol=1e-6, err_msg=name
        )
