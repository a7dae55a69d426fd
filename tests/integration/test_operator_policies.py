"""Restart policies, backoff, success policies and cleanPodPolicy on the real control plane.
Pod phases and exit codes are written through the API, as a kubelet would write them."""

from __future__ import annotations

import pytest
from conftest import job_manifest
from support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _running(op, name, pods):
    op.wait_pods(name, pods)
    op.set_all(name, "Running")
    op.wait_phase(name, "Running")


def _uid(op, job, pod):
    return op.pods(job)[pod].metadata.uid


@pytest.mark.parametrize("policy,exit_code", [("OnFailure", 1), ("Always", 1), ("ExitCode", 137)])
def test_retried_failures_recreate_the_pod(tfps_operator, policy, exit_code):
    op = tfps_operator
    op.create(job_manifest("r", ps=1, workers=2, policy=policy))
    _running(op, "r", {"r-ps-0", "r-worker-0", "r-worker-1"})
    before = _uid(op, "r", "r-worker-1")
    op.set_pod("r-worker-1", "Failed", exit_code=exit_code)
    wait_for("a new r-worker-1", lambda: "r-worker-1" in (p := op.pods("r")) and p["r-worker-1"].metadata.uid != before)
    status = op.status("r")
    assert status["restartCount"] == 1 and status["phase"] in ("Restarting", "Pending")
    assert op.condition("r", "Restarting")["status"] == "True"
    op.set_pod("r-worker-1", "Running")
    op.wait_phase("r", "Running")
    assert op.condition("r", "Restarting")["status"] == "False"
    assert any(reason == "PodRestarting" and "exit code" in msg for reason, msg in op.events("r"))


@pytest.mark.parametrize("policy,exit_code", [("Never", 1), ("ExitCode", 1), ("ExitCode", 2)])
def test_permanent_failures_fail_the_job(tfps_operator, policy, exit_code):
    op = tfps_operator
    op.create(job_manifest("p", ps=1, workers=2, policy=policy))
    _running(op, "p", {"p-ps-0", "p-worker-0", "p-worker-1"})
    op.set_pod("p-worker-0", "Failed", exit_code=exit_code)
    status = op.wait_phase("p", "Failed")
    failed = op.condition("p", "Failed")
    assert failed["reason"] == "WorkerFailed" and f"exit code {exit_code}" in failed["message"]
    assert status["completionTime"] and status["restartCount"] == 0
    # cleanPodPolicy Running: what was still running (the PS, the other worker) is deleted
    wait_for("only the failed worker left", lambda: set(op.pods("p")) == {"p-worker-0"})


def test_backoff_limit_exhausted_fails_the_job(tfps_operator):
    op = tfps_operator
    op.create(job_manifest("b", ps=1, workers=1, run_policy={"backoffLimit": 2}))
    _running(op, "b", {"b-ps-0", "b-worker-0"})
    for attempt in (1, 2):
        uid = _uid(op, "b", "b-worker-0")
        op.set_pod("b-worker-0", "Failed", exit_code=1)
        wait_for(
            f"restart {attempt}",
            lambda uid=uid: "b-worker-0" in (p := op.pods("b")) and p["b-worker-0"].metadata.uid != uid,
        )
        op.set_pod("b-worker-0", "Running")
    op.set_pod("b-worker-0", "Failed", exit_code=1)
    status = op.wait_phase("b", "Failed")
    assert op.condition("b", "Failed")["reason"] == "BackoffLimitExceeded" and status["restartCount"] == 2


def test_in_place_restarts_count_against_backoff(tfps_operator):
    op = tfps_operator
    op.create(job_manifest("k", ps=1, workers=1, run_policy={"backoffLimit": 1}))
    _running(op, "k", {"k-ps-0", "k-worker-0"})
    op.set_pod("k-worker-0", "Running", restarts=1)  # the kubelet restarted the container (OnFailure)
    wait_for("restart counted", lambda: op.status("k").get("restartCount") == 1)
    assert op.status("k")["phase"] == "Running"
    op.set_pod("k-worker-0", "Running", restarts=2)
    op.wait_phase("k", "Failed")
    assert op.condition("k", "Failed")["reason"] == "BackoffLimitExceeded"


def test_ps_failure_restarts_the_ps_and_the_job_keeps_running(tfps_operator):
    op = tfps_operator
    op.create(job_manifest("ps", ps=2, workers=2))
    _running(op, "ps", {"ps-ps-0", "ps-ps-1", "ps-worker-0", "ps-worker-1"})
    workers = {n: p.metadata.uid for n, p in op.pods("ps").items() if "worker" in n}
    uid = _uid(op, "ps", "ps-ps-1")
    op.set_pod("ps-ps-1", "Failed", exit_code=1)
    wait_for("a new ps-ps-1", lambda: "ps-ps-1" in (p := op.pods("ps")) and p["ps-ps-1"].metadata.uid != uid)
    assert op.status("ps")["phase"] != "Failed"
    op.set_pod("ps-ps-1", "Running")
    op.wait_phase("ps", "Running")
    assert {n: p.metadata.uid for n, p in op.pods("ps").items() if "worker" in n} == workers  # workers untouched


@pytest.mark.parametrize(
    "success_policy,finish", [("", ["s-worker-0"]), ("AllWorkers", ["s-worker-0", "s-worker-1", "s-worker-2"])]
)
def test_success_policies(tfps_operator, success_policy, finish):
    op = tfps_operator
    op.create(job_manifest("s", ps=1, workers=3, successPolicy=success_policy))
    _running(op, "s", {"s-ps-0", "s-worker-0", "s-worker-1", "s-worker-2"})
    for name in finish[:-1]:
        op.set_pod(name, "Succeeded", exit_code=0)
    if finish[:-1]:
        wait_for(
            "status sees the finished workers",
            lambda: op.status("s")["replicaStatuses"]["Worker"]["succeeded"] == len(finish) - 1,
        )
        assert op.status("s")["phase"] == "Running"
    op.set_pod(finish[-1], "Succeeded", exit_code=0)
    status = op.wait_phase("s", "Succeeded")
    assert status["completionTime"] and op.condition("s", "Running")["status"] == "False"
    wait_for("PS deleted (cleanPodPolicy Running)", lambda: "s-ps-0" not in op.pods("s"))


def test_chief_success_decides(tfps_operator):
    op = tfps_operator
    op.create(job_manifest("c", ps=1, workers=1, chief=1))
    _running(op, "c", {"c-ps-0", "c-worker-0", "c-chief-0"})
    op.set_pod("c-worker-0", "Succeeded", exit_code=0)
    wait_for("worker 0 seen", lambda: op.status("c")["replicaStatuses"]["Worker"]["succeeded"] == 1)
    assert op.status("c")["phase"] == "Running"
    op.set_pod("c-chief-0", "Succeeded", exit_code=0)
    op.wait_phase("c", "Succeeded")
    assert "Chief" in op.condition("c", "Succeeded")["message"]


@pytest.mark.parametrize(
    "policy,left", [("Running", {"x-worker-0"}), ("All", set()), ("None", {"x-ps-0", "x-worker-0", "x-worker-1"})]
)
def test_clean_pod_policy(tfps_operator, policy, left):
    op = tfps_operator
    op.create(job_manifest("x", ps=1, workers=2, run_policy={"cleanPodPolicy": policy}))
    _running(op, "x", {"x-ps-0", "x-worker-0", "x-worker-1"})
    op.set_pod("x-worker-0", "Succeeded", exit_code=0)
    op.wait_phase("x", "Succeeded")
    # The pass that finishes the job deletes per cleanPodPolicy before its Events are posted:
    # once the Succeeded Event is there, the pods left are the ones the policy keeps.
    wait_for("the Succeeded Event", lambda: "TrainingJobSucceeded" in {r for r, _ in op.events("x")})
    wait_for(f"pods left: {sorted(left)}", lambda: set(op.pods("x")) == left)
    assert set(op.pods("x")) == left
