"""The operator as a process that can die: killed mid-creation and restarted, it leaves
exactly the right pods; two replicas elect a leader and the standby takes over."""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import job_manifest
from kubernetes.client.rest import ApiException
from support import sample, scrape, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKERS = 120


def _pod_uids(op, job: str) -> dict[str, str]:
    resp = op.core.list_namespaced_pod(op.namespace, label_selector=f"tfps.io/job-name={job}", _preload_content=False)
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in json.loads(resp.data)["items"]}


def test_operator_killed_mid_creation_leaves_exactly_the_right_pods(tfps_operator):
    op = tfps_operator
    expected = {f"big-ps-{i}" for i in range(2)} | {f"big-worker-{i}" for i in range(WORKERS)}
    for _attempt in range(3):
        op.create(job_manifest("big", ps=2, workers=WORKERS))
        at_kill = wait_for("the first pods", lambda: _pod_uids(op, "big"), timeout=60, interval=0.02)
        op.kill()
        at_kill = _pod_uids(op, "big")
        if len(at_kill) < len(expected):
            break
        # Everything was created before the kill landed: try again with a fresh job.
        op.start()
        op.cleanup()
        op.start()
    assert 0 < len(at_kill) < len(expected), f"could not kill mid-creation ({len(at_kill)} pods)"

    # While no operator runs (the killed one has exited), a second job is created: it must not be lost.
    op.create(job_manifest("late", ps=1, workers=1))
    assert not op.status("late") and not _pod_uids(op, "late")

    op.start()
    wait_for(f"{len(expected)} pods", lambda: set(_pod_uids(op, "big")) == expected, timeout=90)
    now = _pod_uids(op, "big")
    assert {name: now[name] for name in at_kill} == at_kill  # none deleted and recreated
    status = wait_for(
        "status counts every pod",
        lambda: (s := op.status("big")).get("replicaStatuses", {}).get("Worker", {}).get("pending") == WORKERS and s,
        timeout=60,
    )
    # (the pods are held unschedulable: the Running condition says so, status False)
    assert status["restartCount"] == 0 and [c["type"] for c in status["conditions"] if c["status"] == "True"] == [
        "Created"
    ]
    wait_for("the late job's pods", lambda: set(_pod_uids(op, "late")) == {"late-ps-0", "late-worker-0"})
    # A spec change makes the operator reconcile the big job once more (observedGeneration says
    # when): that pass, which saw every pod, creates nothing more.
    generation = op.job("big")["metadata"]["generation"]
    op.patch_spec("big", {"runPolicy": {"ttlSecondsAfterFinished": 3600}})
    wait_for("a pass over the changed spec", lambda: (op.status("big").get("observedGeneration") or 0) > generation)
    assert set(_pod_uids(op, "big")) == expected


def _healthy(port: int) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{port}/healthz", timeout=2
        ) as resp:
            return resp.status == 200
    except OSError:
        return False


def _peers(op) -> dict | None:
    try:
        return op.custom.get_namespaced_custom_object("kopf.dev", "v1", op.namespace, "kopfpeerings", "tfps").get(
            "status"
        )
    except ApiException as err:
        if err.status == 404:  # the operator creates it when it starts
            return None
        raise


def test_two_replicas_elect_a_leader_and_the_standby_takes_over(tfps_operator):
    op = tfps_operator
    op.kill()  # the fixture's operator: replaced by two with known priorities
    leader = op.start("--priority", "200", "--peering-lifetime", "8")
    wait_for("the leader's peering record", lambda: _peers(op), timeout=30)
    standby = op.start("--priority", "100", "--peering-lifetime", "8")
    standby_metrics = op.metrics_port
    wait_for("the standby up", lambda: _healthy(op.health_port), timeout=60)

    op.create(job_manifest("le", ps=1, workers=2))
    op.wait_pods("le", {"le-ps-0", "le-worker-0", "le-worker-1"})
    op.set_all("le")
    op.wait_phase("le", "Running")
    # The standby, up before the job existed, starts paused and stays so while the leader's
    # record is fresh: the leader did all the work, the standby made no reconcile pass.
    assert sample(scrape(standby_metrics), "tfps_operator_reconcile_seconds_count") == 0
    standby_log = (op.log_dir / "operator-2.log").read_text()
    assert "Resuming operations" not in standby_log and "created" not in standby_log

    op.kill(leader)
    uid = _pod_uids(op, "le")["le-worker-1"]
    op.set_pod("le-worker-1", "Failed", exit_code=1)
    wait_for(
        "the standby recreates the failed worker",
        lambda: _pod_uids(op, "le").get("le-worker-1") not in (None, uid),
        timeout=60,
    )
    assert standby.poll() is None and "Resuming operations" in (op.log_dir / "operator-2.log").read_text()
    assert sorted(_pod_uids(op, "le")) == ["le-ps-0", "le-worker-0", "le-worker-1"]
    assert op.status("le")["restartCount"] == 1
