"""The operator on the real control plane: the children it creates, the status it writes,
a real run on the node (containers), and deletion."""

from __future__ import annotations

import pytest
from conftest import job_manifest, tf_config
from support import sample, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_creates_service_and_pods_with_exact_tf_config(tfps_operator):
    op, ns = tfps_operator, tfps_operator.namespace
    job = op.create(job_manifest("digits", ps=2, workers=4))
    names = {f"digits-ps-{i}" for i in range(2)} | {f"digits-worker-{i}" for i in range(4)}
    pods = op.wait_pods("digits", names)

    cluster = {
        "ps": [f"digits-ps-{i}.digits.{ns}.svc:2222" for i in range(2)],
        "worker": [f"digits-worker-{i}.digits.{ns}.svc:2222" for i in range(4)],
    }
    for name, pod in pods.items():
        rtype, index = name.split("-")[1], int(name.split("-")[2])
        assert tf_config(pod) == {"cluster": cluster, "task": {"type": rtype, "index": index}, "environment": "cloud"}
        assert (pod.spec.hostname, pod.spec.subdomain) == (name, "digits")
        assert pod.metadata.labels["tfps.io/replica-type"] == rtype
        assert pod.metadata.labels["tfps.io/replica-index"] == str(index)
        (owner,) = pod.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "TrainingJob",
            "digits",
            job["metadata"]["uid"],
            True,
        )
        (c,) = pod.spec.containers
        assert c.name == "tensorflow" and c.args == [rtype if rtype == "ps" else "worker"]
        assert c.image == ("tfps/ps:0.1.0" if rtype == "ps" else "tfps/worker:0.1.0")
        env = {e.name: e for e in c.env}
        assert "TFPS_BIND_ADDRESS" not in env
        if rtype == "ps":  # the data path too
            assert {p.container_port for p in c.ports} == {2222, 2223, 9090} and env["TFPS_DATA_PORT"].value == "2223"
        else:
            assert {p.container_port for p in c.ports} == {2222, 9090} and "TFPS_DATA_PORT" not in env
    svc = op.core.read_namespaced_service("digits", ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.selector == {"tfps.io/job-name": "digits"}
    assert svc.metadata.owner_references[0].uid == job["metadata"]["uid"]

    status = wait_for(
        "4 pending workers",
        lambda: (s := op.status("digits")).get("replicaStatuses", {}).get("Worker", {}).get("pending") == 4 and s,
    )
    assert status["phase"] == "Pending" and status["startTime"] and status["workersReady"] == "0/4"
    op.set_all("digits", "Running")
    status = op.wait_phase("digits", "Running")
    assert status["replicaStatuses"]["PS"]["active"] == 2 and status["workersReady"] == "4/4"
    assert op.condition("digits", "Running")["reason"] == "TrainingJobRunning"
    shown = op.cluster.kubectl("get", "tj", "digits", "-n", ns).stdout
    assert "Running" in shown and "2/2" in shown and "4/4" in shown
    wait_for("Created and Running events", lambda: {"Created", "Running"} <= {r for r, _ in op.events("digits")})


def test_deleting_the_job_removes_every_child(tfps_operator):
    op, ns = tfps_operator, tfps_operator.namespace
    op.create(job_manifest("gone", ps=1, workers=2))
    op.wait_pods("gone", {"gone-ps-0", "gone-worker-0", "gone-worker-1"})
    op.cluster.kubectl("delete", "tj", "gone", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for("pods gone", lambda: not op.core.list_namespaced_pod(ns, label_selector="tfps.io/job-name=gone").items)
    wait_for("service gone", lambda: not op.core.list_namespaced_service(ns).items)


def test_custom_program_runs_on_the_node_and_succeeds(tfps_operator):
    """No `training`: the pods run the user's own program with TF_CONFIG (real containers)."""
    op, ns = tfps_operator, tfps_operator.namespace
    program = (
        "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
        "print('task', c['task']['type'], c['task']['index'], 'of', len(c['cluster']['worker']))"
    )
    template = {
        "spec": {
            "containers": [{"name": "tensorflow", "image": "tfps/worker:0.1.0", "command": ["python3", "-c", program]}]
        }
    }
    body = job_manifest("own", ps=0, workers=2, template=template, policy="Never")
    del body["spec"]["training"]
    op.create(body)
    status = op.wait_phase("own", "Succeeded", timeout=90)
    assert op.condition("own", "Succeeded")["reason"] == "TrainingJobSucceeded" and status["completionTime"]
    assert "task worker 0 of 2" in op.cluster.pod_log(ns, "own-worker-0")


def test_operator_metrics(tfps_operator):
    op = tfps_operator
    op.create(job_manifest("m", ps=1, workers=1))
    op.wait_pods("m", {"m-ps-0", "m-worker-0"})
    op.wait_phase("m", "Pending")
    text = wait_for(
        "operator metrics", lambda: (t := op.metrics()) and sample(t, "tfps_operator_jobs", phase="Pending") == 1 and t
    )
    assert sample(text, "tfps_operator_pods_created_total") == 2
    assert sample(text, "tfps_operator_reconcile_seconds_count") >= 1


PS_PROGRAM = """
import os, time
from tfps.runtime.metrics import Identity, PSMetrics
m = PSMetrics(Identity(os.environ['TFPS_JOB_NAME'], os.environ['TFPS_NAMESPACE'], 'ps', 0))
m.serve(int(os.environ['TFPS_METRICS_PORT']), addr='0.0.0.0')
step = 0
while True:
    step += 10
    m.global_step.set(step); m.loss.set(1.0 / step); m.examples.inc(640)
    time.sleep(0.5)
"""


def test_progress_is_read_from_the_ps_metrics(tfps_operator):
    """Real PS-like containers on the node serve the runtime's PS metrics on their pod IP."""
    op = tfps_operator
    op.kill()
    op.start(config={"progressSeconds": 1})
    ps = {
        "spec": {
            "containers": [{"name": "tensorflow", "image": "tfps/ps:0.1.0", "command": ["python3", "-c", PS_PROGRAM]}]
        }
    }
    worker = {
        "spec": {
            "containers": [
                {
                    "name": "tensorflow",
                    "image": "tfps/worker:0.1.0",
                    "command": ["python3", "-c", "import time; time.sleep(600)"],
                }
            ]
        }
    }
    body = job_manifest("prog", ps=1, workers=1)
    del body["spec"]["training"]
    body["spec"]["replicaSpecs"]["PS"]["template"] = ps
    body["spec"]["replicaSpecs"]["Worker"]["template"] = worker
    op.create(body)
    op.wait_phase("prog", "Running", timeout=90)
    progress = wait_for(
        "progress with a rate",
        lambda: (p := op.status("prog").get("progress", {})).get("examplesPerSecond") and p.get("step", 0) > 10 and p,
        timeout=60,
    )
    assert 0 < progress["loss"] < 0.1 and progress["examplesPerSecond"] > 0
    shown = op.cluster.kubectl("get", "tj", "prog", "-n", op.namespace, "--no-headers").stdout.split()
    assert shown[1] == "Running" and int(shown[4]) >= progress["step"]


def test_rendered_objects_are_valid_for_the_api_server(crds, namespace, tmp_path):
    """`tfps render` output passes the API server's own validation (server-side dry run)."""
    import subprocess
    import sys

    import yaml

    manifest = tmp_path / "job.yaml"
    gpu = {"spec": {"containers": [{"name": "tensorflow", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    manifest.write_text(yaml.safe_dump(job_manifest("render", ps=2, workers=2, template=gpu, chief=1)))
    out = subprocess.run(
        [sys.executable, "-m", "tfps.cli.main", "render", str(manifest), "-n", namespace],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    proc = crds.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=out)
    assert proc.stdout.count("(server dry run)") == 6  # the Service and 5 pods
