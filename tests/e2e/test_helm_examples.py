"""The whole chain a user walks: `helm install` the chart, `kubectl apply` each example, the
operator (a container of the chart's image, authenticating with the chart's ServiceAccount token)
creates the PS and worker pods, real training runs in the project's images, and the job reaches
Succeeded.

Nothing is mocked: real kube-apiserver, etcd, controller-manager and scheduler, real helm and
kubectl, a real kubelet with containerd and runc, the images built from images/. The node has no
GPU: it advertises nvidia.com/gpu as an extended resource, so GPU workers are scheduled and their
TensorFlow runs on the CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tfps.api.spec import API_GROUP, API_VERSION, PLURAL, ReplicaType, load_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _get_job(cluster, namespace: str, name: str) -> dict:
    return client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
        API_GROUP, API_VERSION, namespace, PLURAL, name
    )


def _operator_pod(cluster, namespace: str) -> client.V1Pod:
    pods = (
        client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector="app.kubernetes.io/name=tfps").items
    )
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_trains_to_succeeded(cluster, namespace, release, example):
    operator = _operator_pod(cluster, namespace)
    assert operator.status.phase == "Running"
    assert operator.spec.service_account_name != "default", "the operator must run as the chart's ServiceAccount"

    job = load_manifest(example)
    cluster.kubectl("apply", "--namespace", namespace, "-f", str(example))
    steps = job.spec.training.steps
    seen_running = False
    deadline = time.monotonic() + 600
    obj: dict = {}
    while time.monotonic() < deadline:
        obj = _get_job(cluster, namespace, job.name)
        phase = (obj.get("status") or {}).get("phase")
        seen_running |= phase == "Running"
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    status = obj.get("status") or {}
    assert status.get("phase") == "Succeeded", json.dumps(status, indent=1)
    assert seen_running, "the job never showed phase Running on its way"
    assert status["progress"]["step"] >= steps
    if job.spec.training.model == "digits-mlp":  # a model with a test split: worker 0 reports accuracy
        assert status["progress"]["accuracy"] >= 0.9, status["progress"]
    if job.spec.training.model == "wide-deep":  # a binary model: its AUC is reported too
        assert status["progress"]["auc"] >= 0.80, status["progress"]
    assert status.get("completionTime") and status.get("startTime")
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in status["conditions"])

    # Steps went over each PS's data path (the chart's port 2223), not gRPC.
    log = cluster.kubectl("logs", f"{job.name}-worker-0", "--namespace", namespace).stdout
    data_paths = [json.loads(line) for line in log.splitlines() if '"event": "data-path"' in line]
    assert {e["ps"] for e in data_paths} == set(range(job.spec.replicas(ReplicaType.PS))), log[-2000:]
    assert all(e["port"] == 2223 for e in data_paths) and '"event": "grpc-steps"' not in log

    # cleanPodPolicy Running (the default): no PS pod outlives the finished job.
    core = client.CoreV1Api(cluster.api)

    def ps_left():
        pods = core.list_namespaced_pod(
            namespace, label_selector=f"tfps.io/job-name={job.name},tfps.io/replica-type=ps"
        ).items
        return [p.metadata.name for p in pods if p.status.phase in ("Pending", "Running")]

    deadline = time.monotonic() + 60
    while ps_left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ps_left() == []

    # `kubectl get tj` shows what a user would look at.
    table = cluster.kubectl("get", "tj", job.name, "--namespace", namespace).stdout
    assert "Succeeded" in table and str(steps) in table, table
    events = cluster.kubectl(
        "get", "events", "--namespace", namespace, "--field-selector", f"involvedObject.name={job.name}", "-o", "yaml"
    ).stdout
    reasons = {e["reason"] for e in yaml.safe_load(events)["items"]}
    assert reasons, "the operator recorded no Event for the job"
