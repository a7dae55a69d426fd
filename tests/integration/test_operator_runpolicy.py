"""Time and spec changes on the real control plane: deadline, TTL, suspend/resume, live scaling."""

from __future__ import annotations

import pytest
from conftest import job_manifest
from support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_active_deadline_fails_the_job_and_deletes_all_pods(tfps_operator):
    op = tfps_operator
    # cleanPodPolicy None: the deadline deletes every pod anyway (TFJob semantics).
    op.create(job_manifest("d", ps=1, workers=2, run_policy={"activeDeadlineSeconds": 4, "cleanPodPolicy": "None"}))
    op.wait_pods("d", {"d-ps-0", "d-worker-0", "d-worker-1"})
    op.set_all("d", "Running")
    status = op.wait_phase("d", "Failed", timeout=30)
    assert op.condition("d", "Failed")["reason"] == "DeadlineExceeded" and status["completionTime"]
    wait_for("every pod deleted", lambda: not op.pods("d"))


def test_ttl_after_finished_deletes_the_job(tfps_operator):
    op = tfps_operator
    op.create(job_manifest("t", ps=1, workers=1, run_policy={"ttlSecondsAfterFinished": 3}))
    op.wait_pods("t", {"t-ps-0", "t-worker-0"})
    op.set_pod("t-worker-0", "Succeeded", exit_code=0)
    op.wait_phase("t", "Succeeded")
    wait_for("job deleted by its TTL", lambda: op.job("t") is None, timeout=30)
    wait_for("children gone", lambda: not op.pods("t"))


def test_suspend_deletes_pods_and_resume_recreates_them(tfps_operator):
    op = tfps_operator
    names = {"s-ps-0", "s-worker-0", "s-worker-1"}
    op.create(job_manifest("s", ps=1, workers=2))
    op.wait_pods("s", names)
    op.set_all("s")
    op.wait_phase("s", "Running")
    op.cluster.kubectl(
        "patch", "tj", "s", "-n", op.namespace, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}'
    )
    op.wait_phase("s", "Suspended")
    wait_for("pods deleted", lambda: not op.pods("s"))
    assert op.condition("s", "Suspended")["status"] == "True" and op.condition("s", "Running")["status"] == "False"
    op.cluster.kubectl(
        "patch", "tj", "s", "-n", op.namespace, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}'
    )
    op.wait_pods("s", names)
    op.set_all("s")
    op.wait_phase("s", "Running")
    assert op.condition("s", "Suspended")["reason"] == "Resumed"
    reasons = [r for r, _ in op.events("s")]
    assert "Suspended" in reasons and "Resumed" in reasons


def test_scale_workers_up_and_down_live(tfps_operator):
    op, ns = tfps_operator, tfps_operator.namespace
    op.create(job_manifest("w", ps=1, workers=2))
    op.wait_pods("w", {"w-ps-0", "w-worker-0", "w-worker-1"})
    op.set_all("w")
    op.wait_phase("w", "Running")
    uids = {n: p.metadata.uid for n, p in op.pods("w").items()}

    op.cluster.kubectl("scale", "tj/w", "-n", ns, "--replicas=4")
    pods = op.wait_pods("w", {"w-ps-0", "w-worker-0", "w-worker-1", "w-worker-2", "w-worker-3"})
    assert {n: pods[n].metadata.uid for n in uids} == uids  # nothing restarted
    op.set_all("w")
    wait_for("4/4 workers", lambda: op.status("w").get("workersReady") == "4/4")
    assert op.status("w")["phase"] == "Running"
    shown = op.cluster.kubectl("get", "--raw", f"/apis/tfps.io/v1alpha1/namespaces/{ns}/trainingjobs/w/scale").stdout
    assert '"replicas":4' in shown

    op.cluster.kubectl("scale", "tj/w", "-n", ns, "--replicas=1")
    op.wait_pods("w", {"w-ps-0", "w-worker-0"})
    status = wait_for("1/1 workers", lambda: (s := op.status("w")).get("workersReady") == "1/1" and s)
    assert status["phase"] == "Running" and status["restartCount"] == 0
    assert op.pods("w")["w-worker-0"].metadata.uid == uids["w-worker-0"]
