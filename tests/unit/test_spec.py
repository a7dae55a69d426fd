"""The spec types and TF_CONFIG: what the operator, `tfps local` and the pods all rely on."""

import json

import pytest
from pydantic import ValidationError

from tfps.api.naming import pod_name
from tfps.api.spec import ReplicaType, TrainingJob, TrainingJobSpec
from tfps.api.tfconfig import ClusterConfig, tf_config


def _spec(**training):
    return TrainingJobSpec.model_validate(
        {
            "replicaSpecs": {"PS": {"replicas": 2}, "Worker": {"replicas": 3}, "Evaluator": {"replicas": 1}},
            "training": {"model": "digits-mlp", **training},
        }
    )


def test_defaults_follow_design():
    spec = _spec()
    assert spec.run_policy.clean_pod_policy.value == "Running"
    assert spec.run_policy.backoff_limit == 3
    assert spec.training.consistency.mode.value == "sync"
    assert spec.replica_specs[ReplicaType.WORKER].restart_policy.value == "OnFailure"


def test_training_needs_ps_and_worker():
    with pytest.raises(ValidationError, match="replicaSpecs.PS"):
        TrainingJobSpec.model_validate({"replicaSpecs": {"Worker": {"replicas": 1}}, "training": {}})


def test_unknown_field_is_rejected_with_its_name():
    with pytest.raises(ValidationError, match="batchsize"):
        _spec(batchsize=3)


def test_tf_config_has_every_training_replica_and_dns_names():
    cfg = tf_config("digits", "ml", _spec(), ReplicaType.WORKER, 2)
    assert cfg["task"] == {"type": "worker", "index": 2}
    assert cfg["cluster"]["ps"] == ["digits-ps-0.digits.ml.svc:2222", "digits-ps-1.digits.ml.svc:2222"]
    assert len(cfg["cluster"]["worker"]) == 3
    assert "evaluator" not in cfg["cluster"]
    back = ClusterConfig.from_env({"TF_CONFIG": json.dumps(cfg)})
    assert back.task_type == "worker" and back.task_index == 2 and back.ps == cfg["cluster"]["ps"]


def test_manifest_round_trip():
    job = TrainingJob.model_validate(
        {
            "apiVersion": "tfps.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "a"},
            "spec": _spec().to_manifest(),
        }
    )
    assert job.name == "a" and job.namespace == "default"
    assert pod_name(job.name, ReplicaType.PS, 1) == "a-ps-1"
