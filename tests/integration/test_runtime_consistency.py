"""Consistency modes over real gRPC on loopback (PS shards and workers in one process).

- sync: N workers x batch B give the same parameters as 1 worker x batch N*B.
- async and bounded converge on digits-mlp.
"""

import numpy as np
import pytest
from support import wait_for

from tfps.api.spec import TrainingSpec
from tfps.runtime import wire
from tfps.runtime.inprocess import InProcessCluster

pytestmark = pytest.mark.integration


def _training(**kw) -> TrainingSpec:
    base = {
        "model": "digits-mlp",
        "seed": 0,
        "steps": 20,
        "batchSize": 16,
        "optimizer": {"name": "sgd", "learningRate": 0.1},
        "consistency": {"mode": "sync"},
    }
    base.update(kw)
    return TrainingSpec.model_validate(base)


def _final_params(training: TrainingSpec, num_ps: int, num_workers: int) -> dict:
    with InProcessCluster(training, num_ps=num_ps, num_workers=num_workers) as cluster:
        workers, result = cluster.train()
        assert result["steps"] == training.steps
        assert all(w.steps_done == training.steps for w in workers)
        return cluster.parameters()


LARGE = {
    "model": "mlp",
    "modelArgs": {"inputDim": 784, "hidden": [1200, 1200], "samples": 256, "testSamples": 32},
    "steps": 4,
}


@pytest.mark.parametrize(
    "optimizer, extra",
    [
        ({"name": "sgd", "learningRate": 0.1}, {}),
        ({"name": "adam", "learningRate": 0.01}, {}),
        ({"name": "momentum", "learningRate": 0.01}, LARGE),  # 9 MB a shard, streamed (below)
    ],
    ids=["sgd", "adam", "momentum-large"],
)
def test_sync_n_workers_equal_one_worker_with_n_times_the_batch(optimizer, extra, monkeypatch):
    if extra:  # the chunked streaming path, as for shards over wire.UNARY_MAX_BYTES
        monkeypatch.setattr(wire, "UNARY_MAX_BYTES", 1 << 20)
    n, batch = 3, 8
    many = _final_params(_training(batchSize=batch, optimizer=optimizer, **extra), num_ps=2, num_workers=n)
    one = _final_params(_training(batchSize=n * batch, optimizer=optimizer, **extra), num_ps=2, num_workers=1)
    start = {p.name: p.initial_value(0) for p in InProcessCluster(_training(**extra)).model().params}
    for name in one:
        assert not np.allclose(one[name], start[name]), f"{name} did not train"
        np.testing.assert_allclose(many[name], one[name], rtol=1e-4, atol=2e-5, err_msg=name)


def test_bfloat16_wire_tracks_float32_training():
    """wireDtype bfloat16 rounds what travels, not what the PS keeps: after K sync steps the
    parameters are float32 and differ from the float32 run's by a small fraction of how far
    training moved them."""
    base = {"steps": 30}
    full = _final_params(_training(**base), num_ps=2, num_workers=2)
    half = _final_params(_training(wireDtype="bfloat16", **base), num_ps=2, num_workers=2)
    start = {p.name: p.initial_value(0) for p in InProcessCluster(_training()).model().params}
    for name in full:
        assert half[name].dtype == np.float32
        assert not np.array_equal(half[name], full[name]), f"{name}: bfloat16 changed nothing, was it used?"
        moved = np.linalg.norm(full[name] - start[name])
        assert np.linalg.norm(half[name] - full[name]) < 0.05 * moved, name


@pytest.mark.parametrize("mode", ["async", "bounded"])
def test_async_modes_converge_on_digits(mode):
    """1200 steps: in a shorter run the final accuracy depends on how the two workers happen to
    interleave. SGD, not Adam: Adam's second moment shrinks with the gradients, and one stale
    gradient then moves every weight by a few learning rates, so async Adam can blow up late in
    a run that had converged; SGD at 0.1 clears the bound with room to spare on a loaded machine."""
    training = _training(
        steps=1200,
        batchSize=32,
        optimizer={"name": "sgd", "learningRate": 0.1},
        consistency={"mode": mode, "staleness": 2},
    )
    with InProcessCluster(training, num_ps=2, num_workers=2) as cluster:
        workers, result = cluster.train()
        assert result["accuracy"] >= 0.92
        assert cluster.shards[0].version == training.steps
        # every push was applied on arrival: both workers did part of the steps
        assert sum(w.steps_done for w in workers) >= training.steps and min(w.steps_done for w in workers) > 50


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_added_by_a_live_scale_up_joins_the_running_job(mode):
    """`kubectl scale tj/NAME --replicas=3` on a job of 2 workers: the PS was started with a
    TF_CONFIG of 2 workers, the new worker's says 3. The PS makes room for it, it trains
    alongside the others, and every worker cuts its batches in 3 from then on.
    Its accuracy after 240 async steps depends on how the three workers interleave, so the bound
    says it still learns (chance: 0.1), not how well."""
    import threading

    from tfps.runtime.metrics import Identity, WorkerMetrics
    from tfps.runtime.worker import Worker

    training = _training(
        steps=240, batchSize=16, optimizer={"name": "adam", "learningRate": 0.003}, consistency={"mode": mode}
    )
    with InProcessCluster(training, num_ps=2, num_workers=2) as cluster:

        def late_worker():
            wait_for("step 40", lambda: cluster.shards[0].version >= 40, timeout=120, interval=0.05)
            worker = Worker(
                cluster.model(),
                training,
                cluster.addresses,
                3,
                2,
                WorkerMetrics(Identity("inprocess", "default", "worker", 2)),
            )
            try:
                worker.run()
                joined.append(worker)
            finally:
                worker.close()

        joined: list = []
        thread = threading.Thread(target=late_worker, daemon=True)
        thread.start()
        workers, result = cluster.train()
        thread.join(timeout=120)
        assert joined and joined[0].steps_done > 0, "the added worker never trained"
        assert all(s.consistency.num_workers == 3 for s in cluster.shards)
        assert all(w.batches.num_workers == 3 for w in workers + joined)
        assert result["accuracy"] >= 0.3
        rejected = (
            cluster.shards[0].metrics.registry.get_sample_value(
                "tfps_ps_rejected_requests_total",
                {
                    "job": "inprocess",
                    "namespace": "default",
                    "replica_type": "ps",
                    "replica_index": "0",
                    "reason": "malformed",
                },
            )
            or 0
        )
        assert rejected == 0
