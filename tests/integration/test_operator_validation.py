"""Invalid TrainingJobs are rejected by the API server itself (the CRD's schema and CEL
rules), with a message naming the field, before any operator sees them."""

from __future__ import annotations

import copy
import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VALID = {
    "apiVersion": "tfps.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "ok"},
    "spec": {"replicaSpecs": {"PS": {"replicas": 2}, "Worker": {"replicas": 2}}, "training": {"steps": 10}},
}


def _with(path: str, value, name: str = "bad") -> dict:
    body = copy.deepcopy(VALID)
    body["metadata"]["name"] = name
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return body


_DELETE = object()

# (id, manifest, text the error must contain: the field's path)
INVALID = [
    ("no-replica-specs", _with("spec.replicaSpecs", _DELETE), "spec.replicaSpecs"),
    ("empty-replica-specs", _with("spec.replicaSpecs", {}), "spec.replicaSpecs"),
    ("unknown-replica-type", _with("spec.replicaSpecs.Workers", {"replicas": 1}), "spec.replicaSpecs.Workers"),
    ("negative-replicas", _with("spec.replicaSpecs.Worker.replicas", -1), "spec.replicaSpecs.Worker.replicas"),
    ("too-many-replicas", _with("spec.replicaSpecs.Worker.replicas", 5000), "spec.replicaSpecs.Worker.replicas"),
    ("replicas-not-a-number", _with("spec.replicaSpecs.Worker.replicas", "two"), "spec.replicaSpecs.Worker.replicas"),
    (
        "bad-restart-policy",
        _with("spec.replicaSpecs.Worker.restartPolicy", "Sometimes"),
        "spec.replicaSpecs.Worker.restartPolicy",
    ),
    ("training-without-ps", _with("spec.replicaSpecs.PS", _DELETE), "spec.replicaSpecs.PS"),
    ("training-with-zero-workers", _with("spec.replicaSpecs.Worker.replicas", 0), "spec.replicaSpecs.Worker"),
    ("two-chiefs", _with("spec.replicaSpecs.Chief", {"replicas": 2}), "spec.replicaSpecs.Chief.replicas"),
    ("name-too-long", _with("spec.replicaSpecs.Worker.replicas", 1, name="n" * 50), "metadata.name"),
    ("name-not-a-dns-label", _with("spec.replicaSpecs.Worker.replicas", 1, name="a.b"), "metadata.name"),
    ("unknown-optimizer", _with("spec.training.optimizer", {"name": "rmsprop"}), "spec.training.optimizer.name"),
    (
        "zero-learning-rate",
        _with("spec.training.optimizer", {"learningRate": 0}),
        "spec.training.optimizer.learningRate",
    ),
    (
        "momentum-of-one",
        _with("spec.training.optimizer", {"name": "momentum", "momentum": 1.0}),
        "spec.training.optimizer.momentum",
    ),
    ("zero-batch-size", _with("spec.training.batchSize", 0), "spec.training.batchSize"),
    ("zero-steps", _with("spec.training.steps", 0), "spec.training.steps"),
    ("unknown-consistency", _with("spec.training.consistency", {"mode": "eventual"}), "spec.training.consistency.mode"),
    ("misspelled-training-field", _with("spec.training.batchsize", 32), "spec.training.batchsize"),
    ("unknown-model", _with("spec.training.model", "resnet9000"), "digits-mlp, mlp, wide-deep"),
    (
        "zero-checkpoint-interval",
        _with("spec.training.checkpoint", {"everySteps": 0}),
        "spec.training.checkpoint.everySteps",
    ),
    ("bad-clean-pod-policy", _with("spec.runPolicy", {"cleanPodPolicy": "Sometimes"}), "spec.runPolicy.cleanPodPolicy"),
    ("negative-backoff", _with("spec.runPolicy", {"backoffLimit": -1}), "spec.runPolicy.backoffLimit"),
    ("zero-deadline", _with("spec.runPolicy", {"activeDeadlineSeconds": 0}), "spec.runPolicy.activeDeadlineSeconds"),
    (
        "negative-ttl",
        _with("spec.runPolicy", {"ttlSecondsAfterFinished": -5}),
        "spec.runPolicy.ttlSecondsAfterFinished",
    ),
    ("suspend-not-a-bool", _with("spec.runPolicy", {"suspend": "yes"}), "spec.runPolicy.suspend"),
    ("bad-success-policy", _with("spec.successPolicy", "AnyWorker"), "spec.successPolicy"),
    (
        "all-workers-without-workers",
        {
            **_with("spec.successPolicy", "AllWorkers"),
            "spec": {"replicaSpecs": {"Chief": {"replicas": 1}}, "successPolicy": "AllWorkers"},
        },
        "spec.successPolicy",
    ),
]


def test_at_least_15_kinds_of_invalid_input():
    assert len(INVALID) >= 15


@pytest.mark.parametrize("manifest,field", [pytest.param(m, f, id=i) for i, m, f in INVALID])
def test_invalid_manifest_is_rejected_naming_the_field(crds, namespace, manifest, field):
    proc = crds.kubectl(
        "apply", "--validate=strict", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False
    )
    assert proc.returncode != 0, f"accepted: {proc.stdout}"
    assert field in proc.stderr, proc.stderr
    assert not crds.kubectl("get", "tj", "-n", namespace, "-o", "name").stdout.strip()


def test_valid_manifest_gets_the_defaults(crds, namespace):
    crds.kubectl("apply", "--validate=strict", "-n", namespace, "-f", "-", input=json.dumps(VALID))
    job = json.loads(crds.kubectl("get", "tj", "ok", "-n", namespace, "-o", "json").stdout)
    spec = job["spec"]
    assert spec["runPolicy"] == {"backoffLimit": 3, "cleanPodPolicy": "Running", "suspend": False}
    assert spec["replicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    assert spec["training"]["optimizer"]["name"] == "adam" and spec["training"]["consistency"]["mode"] == "sync"
    # no operator runs here: nothing holds a finalizer, the namespace goes away cleanly


def test_ps_replicas_and_training_are_immutable(crds, namespace):
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(VALID))
    for patch, field in (
        ('{"spec":{"replicaSpecs":{"PS":{"replicas":3}}}}', "spec.replicaSpecs.PS"),
        ('{"spec":{"training":{"steps":20}}}', "spec.training"),
    ):
        proc = crds.kubectl("patch", "tj", "ok", "-n", namespace, "--type=merge", "-p", patch, check=False)
        assert proc.returncode != 0 and field in proc.stderr and "immutable" in proc.stderr, proc.stderr
