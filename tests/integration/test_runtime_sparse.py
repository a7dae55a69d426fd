"""The wide-and-deep model's embedding tables travel and update as rows: the PS byte
counters show only the touched rows moving, and untouched rows keep their values."""

import numpy as np
import pytest

from tfps.api.spec import TrainingSpec
from tfps.runtime.inprocess import InProcessCluster
from tfps.runtime.models import BatchSource

pytestmark = pytest.mark.integration


def _counter(shard, name):
    m = shard.metrics
    return m.registry.get_sample_value(
        name, {"job": "inprocess", "namespace": "default", "replica_type": "ps", "replica_index": str(shard.index)}
    )


def test_only_touched_rows_move():
    steps, batch = 30, 32
    training = TrainingSpec.model_validate(
        {
            "model": "wide-deep",
            "modelArgs": {"vocabSize": 200_000, "fields": 8, "embeddingDim": 16},
            "steps": steps,
            "batchSize": batch,
            "optimizer": {"name": "adagrad", "learningRate": 0.05},
            "consistency": {"mode": "sync"},
        }
    )
    with InProcessCluster(training, num_ps=2, num_workers=1) as cluster:
        model = cluster.model()
        start = {p.name: p.initial_value(0) for p in model.params}
        cluster.train()
        table_bytes = sum(p.size * 4 for p in model.params if p.sparse)
        dense_bytes = sum(p.size * 4 for p in model.params if not p.sparse)
        received = sum(_counter(s, "tfps_ps_received_bytes_total") for s in cluster.shards)
        sent = sum(_counter(s, "tfps_ps_sent_bytes_total") for s in cluster.shards)
        # at most batch*fields rows of (16 + 1) floats plus an int64 index each, per step
        row_bytes = batch * 8 * ((16 + 1) * 4 + 2 * 8)
        assert received < steps * (dense_bytes + row_bytes) + 200_000
        assert received < table_bytes  # 30 steps moved less than one copy of the tables
        # training pulled rows only; worker 0's evaluation at the end pulls the whole model once
        assert sent - (table_bytes + dense_bytes) < (steps + 3) * (dense_bytes + 2 * row_bytes) + 200_000

        final = cluster.parameters()
        train, _ = model.data()
        src = BatchSource(train, 0, batch)
        touched = np.unique(np.concatenate([train.x["ids"][src.indices(s)].reshape(-1) for s in range(steps)]))
        untouched = np.setdiff1d(np.arange(start["embedding"].shape[0]), touched)
        np.testing.assert_array_equal(final["embedding"][untouched], start["embedding"][untouched])
        assert not np.allclose(final["embedding"][touched], start["embedding"][touched])
        assert len(touched) < 0.05 * start["embedding"].shape[0]


def test_a_tables_rows_from_two_ps_reach_the_worker_in_one_array():
    """Both tables are split by rows over 2 PS. The rows of the next batch, asked of both with a
    push, are received straight into one array per table (no concatenation after), each PS's
    rows where its ids fall, and equal the rows the PS hold."""
    training = TrainingSpec.model_validate(
        {
            "model": "wide-deep",
            "modelArgs": {"vocabSize": 20_000, "fields": 8, "embeddingDim": 16},
            "steps": 50,
            "batchSize": 64,
            "optimizer": {"name": "sgd", "learningRate": 0.05},
            "consistency": {"mode": "async"},
        }
    )
    with InProcessCluster(training, num_ps=2, num_workers=1) as cluster:
        worker = cluster.worker(0)
        try:
            worker.pull()
            for _ in range(3):
                worker.train_step()
            _, _, _, routes = worker._batch_plan(worker._data_step())
            assert worker.sparse.keys() == routes.keys() and len(routes) == 2
            for name, table_routes in routes.items():
                assert [part.ps for part, _, _ in table_routes] == [0, 1]  # the batch's ids fall on both PS
                held = np.concatenate(
                    [cluster.shards[part.ps].vars[part.name][local] for part, _, local in table_routes]
                )
                np.testing.assert_array_equal(worker.rows[name], held)
                assert worker.rows[name] is worker._joined._arrays[name]
        finally:
            worker.close()
