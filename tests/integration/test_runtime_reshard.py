"""A job restored with another number of PS re-shards its tables and their optimizer slots:
`tfps local` trains the wide-and-deep model with Adam on 2 PS processes and leaves their final
checkpoint; 3 PS shards then start from it, and every parameter and every Adam moment they hold,
put back together, equals what the 2 PS wrote. Training then goes on from that step on 3 PS."""

import numpy as np
import pytest
import yaml
from support import tfps_local

from tfps.api.spec import TrainingSpec, manifest_for
from tfps.runtime import checkpoint
from tfps.runtime.inprocess import InProcessCluster
from tfps.runtime.sharding import place

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 40
TRAINING = {
    "model": "wide-deep",
    "modelArgs": {
        "vocabSize": 20_000,
        "fields": 8,
        "embeddingDim": 8,
        "hidden": [16],
        "samples": 4096,
        "testSamples": 512,
    },
    "optimizer": {"name": "adam", "learningRate": 0.01},
    "batchSize": 64,
    "steps": STEPS,
    "consistency": {"mode": "async"},
}


def _whole(parts_of, tensors_of, model) -> dict[str, np.ndarray]:
    """Every parameter and slot, its parts put back together in row order."""
    out = {}
    for param in model.params:
        parts = sorted(parts_of(param.name), key=lambda p: p.start)
        for suffix in ("", ":slot:m", ":slot:v"):
            out[param.name + suffix] = (
                np.concatenate([tensors_of(p)[p.name + suffix] for p in parts])
                if param.shape
                else tensors_of(parts[0])[parts[0].name + suffix]
            )
    return out


def test_a_2_ps_checkpoint_restores_into_3_ps(tmp_path):
    root = tmp_path / "checkpoints"
    replicas = {"PS": {"replicas": 2, "restartPolicy": "Never"}, "Worker": {"replicas": 1, "restartPolicy": "Never"}}
    training = {**TRAINING, "checkpoint": {"path": str(root), "everySteps": 1000}}
    manifest = manifest_for(
        "reshard", {"replicaSpecs": replicas, "training": training, "runPolicy": {"backoffLimit": 0}}
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert tfps_local(path, timeout=240)["steps"] == STEPS

    training = TrainingSpec.model_validate({**TRAINING, "steps": STEPS + 20})
    with InProcessCluster(training, num_ps=3, num_workers=1, checkpoint_root=str(root)) as cluster:
        model = cluster.model()
        two, three = place(model.params, 2), place(model.params, 3)
        saved = {i: checkpoint.read(root / f"ps-{i}").tensors for i in range(2)}
        written = _whole(two.parts_of, lambda p: saved[p.ps], model)

        restored = _whole(three.parts_of, lambda p: _state(cluster.shards[p.ps]), model)
        assert sorted(restored) == sorted(written)
        for name, value in written.items():
            np.testing.assert_array_equal(restored[name], value, err_msg=name)
        assert all(s.version == STEPS for s in cluster.shards)
        assert not np.array_equal(written["embedding:slot:m"], 0)  # Adam's moments were trained, not fresh

        cluster.train()  # and the job goes on, on 3 PS
        assert all(s.version == STEPS + 20 for s in cluster.shards)


def _state(shard) -> dict[str, np.ndarray]:
    out = {}
    for name, var in shard.vars.items():
        out[name] = np.array(var)
        for slot, svar in shard.slots[name].items():
            out[f"{name}:slot:{slot}"] = np.array(svar)
    return out
