"""A user's own TensorFlow program, no `training` section: TF's ParameterServerStrategy driven only
by the TF_CONFIG the operator injects, with Chief + 2 PS + 2 Workers, each pod with its own
network namespace so every `tf.distribute.Server` binds port 2222. The program is written here and
shipped in a ConfigMap; the job runs on the real node and succeeds when the Chief does, and then
no PS or worker pod is left (cleanPodPolicy Running), although their program ignores SIGTERM: a
finished job's pods get the operator's short grace period, not their own 30 s.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from kubernetes import client
from support import wait_for

from tfps.api.spec import API_GROUP, API_VERSION, PLURAL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROGRAM = textwrap.dedent("""
    import json, os, signal
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["type"] in ("ps", "worker"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as many servers do: only SIGKILL stops it
        server = tf.distribute.Server(resolver.cluster_spec(), job_name=task["type"],
                                      task_index=int(task["index"]), protocol="grpc", start=True)
        server.join()

    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        w = tf.Variable(tf.zeros([4, 1]), name="w")
        b = tf.Variable(0.0, name="b")
    placed = sorted({w.device, b.device})

    @tf.function
    def step():
        x = tf.random.normal([64, 4])
        y = tf.matmul(x, tf.constant([[1.0], [-2.0], [0.5], [3.0]])) + 0.5
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(0.1 * gw)
        b.assign_sub(0.1 * gb)
        return loss

    for _ in range(300):
        coordinator.schedule(step)
    coordinator.join()
    loss = float(coordinator.schedule(step).fetch())
    print(json.dumps({"event": "trained", "loss": loss, "variables_on": placed}), flush=True)
    raise SystemExit(0 if loss < 0.01 else 1)
""")


def _template() -> dict:
    return {
        "spec": {
            "containers": [
                {
                    "name": "tensorflow",
                    "command": ["python3", "/program/train.py"],
                    "resources": {"requests": {"cpu": "100m", "memory": "384Mi"}},
                    "volumeMounts": [{"name": "program", "mountPath": "/program", "readOnly": True}],
                }
            ],
            "volumes": [{"name": "program", "configMap": {"name": "pss-program"}}],
        }
    }


def test_parameter_server_strategy_program_trains_to_succeeded(cluster, namespace, release):
    core = client.CoreV1Api(cluster.api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "pss-program"}, "data": {"train.py": PROGRAM}})
    body = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": "pss"},
        "spec": {
            "replicaSpecs": {
                "Chief": {"replicas": 1, "restartPolicy": "OnFailure", "template": _template()},
                "PS": {"replicas": 2, "restartPolicy": "OnFailure", "template": _template()},
                "Worker": {"replicas": 2, "restartPolicy": "OnFailure", "template": _template()},
            },
            "runPolicy": {"backoffLimit": 2, "activeDeadlineSeconds": 500},
        },
    }
    custom = client.CustomObjectsApi(cluster.api)
    custom.create_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, body)

    def finished():
        got = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, "pss").get("status") or {}
        return got if got.get("phase") in ("Succeeded", "Failed") else None

    status = wait_for("the job to finish", finished, timeout=480, interval=0.5)
    chief_log = cluster.pod_log(namespace, "pss-chief-0")
    assert status.get("phase") == "Succeeded", (json.dumps(status, indent=1), chief_log[-3000:])
    trained = [json.loads(line) for line in chief_log.splitlines() if line.startswith('{"event": "trained"')]
    assert trained and trained[0]["loss"] < 0.01, chief_log[-2000:]
    assert {d.split("/task:")[0] for d in trained[0]["variables_on"]} == {"/job:ps/replica:0"}, trained

    def left():
        pods = core.list_namespaced_pod(namespace, label_selector="tfps.io/job-name=pss").items
        return sorted(
            p.metadata.name for p in pods if p.metadata.labels.get("tfps.io/replica-type") in ("ps", "worker")
        )

    # The chart's finishedPodGraceSeconds (2) and the kubelet's teardown, against the pods' own 30 s.
    wait_for("no PS or worker pod left (cleanPodPolicy Running)", lambda: left() == [], timeout=12, interval=0.25)
