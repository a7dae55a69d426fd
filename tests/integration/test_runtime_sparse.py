"""The wide-and-deep model's embedding tables travel and update as rows: the PS byte
counters show only the touched rows moving, and untouched rows keep their values."""
import numpy as np
import pytest

from tfps.runtime.inprocess import InProcessCluster
from tfps.runtime.models import BatchSource
from tfps.api.spec import TrainingSpec

pytestmark = pytest.mark.integration


def _counter(shard, name):
    m = shard.metrics
    return m.registry.get_sample_value(name, {"job": "inprocess", "namespace": "default", "replica_type": "ps", "replica_index": str(shard.index)})


def test_only_touched_rows_move():
    steps, batch = 30, 32
    training = TrainingSpec.model_validate({
        "model": "wide-deep", "modelArgs": {"vocabSize": 200_000, "fields": 8, "embeddingDim": 16},
        "steps": steps, "batchSize": batch, "optimizer": {"name": "adagrad", "learningRate": 0.05},
        "consistency": {"mode": "sync"},
    })
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
