"""The controller's decisions (pure): restart policies, backoff, success, cleanup, time, scale."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tfps.api.spec import ReplicaType, TrainingJob
from tfps.operator import builders, reconcile
from tfps.operator.config import OperatorConfig

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
PS, WORKER, CHIEF = ReplicaType.PS, ReplicaType.WORKER, ReplicaType.CHIEF


def _body(ps=2, workers=4, chief=0, policy="OnFailure", status=None, **spec):
    replica_specs = {"PS": {"replicas": ps}, "Worker": {"replicas": workers, "restartPolicy": policy}}
    if chief:
        replica_specs["Chief"] = {"replicas": chief, "restartPolicy": policy}
    return {
        "apiVersion": "tfps.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "uid-j", "generation": 1},
        "spec": {"replicaSpecs": replica_specs, "training": {}, **spec},
        "status": status or {},
    }


def _pods(body, phase="Running", **overrides):
    """Pods as the operator would create them, with a status; overrides: name -> (phase, exit code, restarts)."""
    job = TrainingJob.model_validate(body)
    pods = []
    for pod in builders.desired_pods(job, OperatorConfig()):
        name = pod["metadata"]["name"]
        ph, code, restarts = overrides.get(name.replace("-", "_"), (phase, None, 0))
        pod["metadata"]["uid"] = f"uid-{name}"
        state = {"terminated": {"exitCode": code}} if code is not None else {"running": {}}
        pod["status"] = {
            "phase": ph,
            "podIP": "127.0.0.5",
            "containerStatuses": [{"name": "tensorflow", "restartCount": restarts, "state": state}],
        }
        pods.append(pod)
    return pods


def _settle(body, pods, now=NOW):
    """Run the plan and keep its status, as the operator would."""
    p = reconcile.plan(body, pods, now)
    body["status"] = p.status
    return p


def test_new_job_creates_every_pod_and_is_pending():
    body = _body()
    p = _settle(body, [])
    assert p.create == [(PS, 0), (PS, 1), (WORKER, 0), (WORKER, 1), (WORKER, 2), (WORKER, 3)]
    assert p.status["phase"] == "Pending" and p.status["startTime"]
    assert p.status["replicaStatuses"]["Worker"] == {"active": 0, "pending": 4, "succeeded": 0, "failed": 0}
    assert [c["type"] for c in p.status["conditions"]] == ["Created"]


def test_all_running_is_running_and_a_second_plan_changes_nothing():
    body = _body()
    _settle(body, [])
    pods = _pods(body)
    p = _settle(body, pods)
    assert p.status["phase"] == "Running" and not p.create and not p.delete
    assert p.status["replicaStatuses"]["Worker"] == {"active": 4, "pending": 0, "succeeded": 0, "failed": 0}
    assert p.status["workersReady"] == "4/4" and p.status["psReady"] == "2/2"
    again = reconcile.plan(body, pods, NOW + timedelta(seconds=5))
    assert again.status == p.status and not again.events and not again.create


@pytest.mark.parametrize(
    "policy,code,restarted",
    [("OnFailure", 1, True), ("Always", 1, True), ("ExitCode", 137, True), ("ExitCode", 1, False), ("Never", 1, False)],
)
def test_restart_policies(policy, code, restarted):
    body = _body(policy=policy)
    _settle(body, [])
    p = _settle(body, _pods(body, j_worker_1=("Failed", code, 0)))
    if restarted:
        assert p.restart == ["j-worker-1"] and p.status["phase"] == "Restarting" and p.status["restartCount"] == 1
    else:
        assert p.status["phase"] == "Failed" and not p.restart
        assert p.status["conditions"][-1]["reason"] == "WorkerFailed"
        assert "exit code 1" in p.status["conditions"][-1]["message"]
        assert set(p.stop) == {f"j-ps-{i}" for i in range(2)} | {f"j-worker-{i}" for i in (0, 2, 3)}


def test_ps_failure_restarts_the_ps_and_job_comes_back_running():
    body = _body()
    _settle(body, [])
    _settle(body, _pods(body))
    p = _settle(body, _pods(body, j_ps_0=("Failed", 1, 0)))
    assert p.restart == ["j-ps-0"] and p.status["phase"] == "Restarting"
    pods = [pod for pod in _pods(body) if pod["metadata"]["name"] != "j-ps-0"]
    p = _settle(body, pods)
    assert p.create == [(PS, 0)] and p.status["phase"] == "Restarting"
    p = _settle(body, _pods(body))
    assert p.status["phase"] == "Running"
    assert {c["type"]: c["status"] for c in p.status["conditions"]} == {
        "Created": "True",
        "Running": "True",
        "Restarting": "False",
    }


def test_backoff_limit_counts_recreations_and_in_place_restarts():
    body = _body(runPolicy={"backoffLimit": 2})
    _settle(body, [])
    _settle(body, _pods(body, j_worker_0=("Running", None, 1)))  # kubelet restarted it once
    assert body["status"]["restartCount"] == 1
    _settle(body, _pods(body, j_worker_0=("Running", None, 1)))  # seen again: not counted twice
    assert body["status"]["restartCount"] == 1
    p = _settle(body, _pods(body, j_worker_2=("Failed", 1, 0)))
    assert p.restart == ["j-worker-2"] and body["status"]["restartCount"] == 2
    p = _settle(body, _pods(body, j_worker_3=("Failed", 1, 0)))
    assert p.status["phase"] == "Failed" and p.status["conditions"][-1]["reason"] == "BackoffLimitExceeded"


def test_in_place_restarts_over_the_limit_fail_the_job():
    body = _body(runPolicy={"backoffLimit": 1})
    _settle(body, [])
    p = _settle(body, _pods(body, j_ps_1=("Running", None, 2)))
    assert p.status["phase"] == "Failed" and p.status["restartCount"] == 2


@pytest.mark.parametrize(
    "success_policy,finished,succeeded",
    [
        ("", ["j_worker_0"], True),
        ("", ["j_worker_1"], False),
        ("AllWorkers", ["j_worker_0"], False),
        ("AllWorkers", ["j_worker_0", "j_worker_1", "j_worker_2", "j_worker_3"], True),
    ],
)
def test_success_policy(success_policy, finished, succeeded):
    body = _body(successPolicy=success_policy)
    _settle(body, [])
    p = _settle(body, _pods(body, **{n: ("Succeeded", 0, 0) for n in finished}))
    assert (p.status["phase"] == "Succeeded") is succeeded
    if succeeded:
        assert p.status["completionTime"]
        # cleanPodPolicy Running (default): running pods (the PS above all) are stopped at once
        assert {"j-ps-0", "j-ps-1"} <= set(p.stop) and not set(p.stop) & {f"j-{n[2:]}" for n in finished}
        assert not p.delete


def test_chief_decides_success_when_present():
    body = _body(chief=1)
    _settle(body, [])
    assert _settle(body, _pods(body, j_worker_0=("Succeeded", 0, 0))).status["phase"] != "Succeeded"
    assert _settle(body, _pods(body, j_chief_0=("Succeeded", 0, 0))).status["phase"] == "Succeeded"


@pytest.mark.parametrize("policy,deleted", [("Running", 5), ("All", 6), ("None", 0)])
def test_clean_pod_policy(policy, deleted):
    body = _body(runPolicy={"cleanPodPolicy": policy})
    _settle(body, [])
    p = _settle(body, _pods(body, j_worker_0=("Succeeded", 0, 0)))
    assert len(p.stop) == deleted and not p.delete
    again = _settle(body, _pods(body, j_worker_0=("Succeeded", 0, 0)))  # after an operator restart: same cleanup
    assert len(again.stop) == deleted and not again.create


def test_deadline_fails_and_deletes_every_pod():
    body = _body(runPolicy={"activeDeadlineSeconds": 60, "cleanPodPolicy": "None"})
    p = _settle(body, [])
    assert p.requeue_after == 60
    p = _settle(body, _pods(body), NOW + timedelta(seconds=61))
    assert p.status["phase"] == "Failed" and p.status["conditions"][-1]["reason"] == "DeadlineExceeded"
    assert len(p.stop) == 6


def test_ttl_deletes_the_finished_job():
    body = _body(runPolicy={"ttlSecondsAfterFinished": 30})
    _settle(body, [])
    _settle(body, _pods(body, j_worker_0=("Succeeded", 0, 0)))
    p = _settle(body, [], NOW + timedelta(seconds=10))
    assert not p.delete_job and p.requeue_after == 20
    assert _settle(body, [], NOW + timedelta(seconds=31)).delete_job


def test_suspend_deletes_pods_and_resume_recreates_them():
    body = _body()
    _settle(body, [])
    _settle(body, _pods(body))
    body["spec"]["runPolicy"] = {"suspend": True}
    p = _settle(body, _pods(body))
    # a suspended job resumes: its pods keep their grace period (the PS writes its last checkpoint)
    assert p.status["phase"] == "Suspended" and len(p.delete) == 6 and not p.stop and not p.create
    p = _settle(body, [])
    assert p.status["phase"] == "Suspended" and not p.events
    body["spec"]["runPolicy"] = {"suspend": False}
    p = _settle(body, [], NOW + timedelta(seconds=100))
    assert len(p.create) == 6 and p.status["phase"] == "Pending"
    assert p.status["startTime"] == "2026-01-01T12:01:40Z"


def test_scale_up_and_down_keeps_running():
    body = _body()
    _settle(body, [])
    pods = _pods(body)
    _settle(body, pods)
    body["spec"]["replicaSpecs"]["Worker"]["replicas"] = 6
    p = _settle(body, pods)
    assert p.create == [(WORKER, 4), (WORKER, 5)] and p.status["phase"] == "Running" and not p.delete
    body["spec"]["replicaSpecs"]["Worker"]["replicas"] = 2
    p = _settle(body, pods)
    assert sorted(p.delete) == ["j-worker-2", "j-worker-3"] and p.status["phase"] == "Running"
    assert p.status["restartCount"] == 0


def test_pods_of_another_owner_are_ignored():
    body = _body()
    pods = _pods(body)
    for pod in pods:
        pod["metadata"]["ownerReferences"][0]["uid"] = "an-older-job"
    p = _settle(body, pods)
    assert len(p.create) == 6 and not p.delete


def test_deleting_pods_are_not_recreated_yet():
    body = _body()
    _settle(body, [])
    pods = _pods(body)
    pods[0]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    p = _settle(body, pods)
    assert not p.create and p.status["phase"] == "Pending"


def test_success_takes_final_figures_from_worker_0s_termination_message():
    """The progress timer's last reading may be seconds old at the end; worker 0's own report is final."""
    body = _body(status={"progress": {"step": 882, "loss": 0.3, "examplesPerSecond": 900.0}})
    _settle(body, [])
    body["status"]["progress"] = {"step": 882, "loss": 0.3, "examplesPerSecond": 900.0}
    pods = _pods(body, j_worker_0=("Succeeded", 0, 0))
    worker0 = next(p for p in pods if p["metadata"]["name"] == "j-worker-0")
    worker0["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = (
        '{"worker":0,"steps":1000,"loss":0.0500001234,"accuracy":0.9694444,"auc":0.81234,"export_path":null}'
    )
    p = reconcile.plan(body, pods, NOW)
    assert p.status["phase"] == "Succeeded"
    assert p.status["progress"] == {
        "step": 1000,
        "loss": 0.05,
        "accuracy": 0.9694,
        "auc": 0.8123,
        "examplesPerSecond": 900.0,
    }


@pytest.mark.parametrize("message", [None, "", "not json", "[1, 2]", '{"steps": "many"}'])
def test_unreadable_termination_message_leaves_progress_alone(message):
    body = _body()
    _settle(body, [])
    pods = _pods(body, j_worker_0=("Succeeded", 0, 0))
    if message is not None:
        worker0 = next(p for p in pods if p["metadata"]["name"] == "j-worker-0")
        worker0["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message
    p = reconcile.plan(body, pods, NOW)
    assert p.status["phase"] == "Succeeded"
    assert not p.status.get("progress")


def _not_scheduled(reason: str, message: str) -> list[dict]:
    """A pending pod's conditions as the scheduler leaves them when it cannot place the pod."""
    return [{"type": "PodScheduled", "status": "False", "reason": reason, "message": message}]


def test_pods_a_queue_has_not_admitted_are_explained_as_waiting_for_it():
    body = _body(runPolicy={"schedulingPolicy": {"queue": "team-a"}})
    _settle(body, [])
    pods = _pods(body, phase="Pending")
    for pod in pods:  # Kueue gates every pod of the group until its Workload is admitted
        pod["status"]["conditions"] = _not_scheduled(
            "SchedulingGated", "Scheduling is blocked due to non-empty scheduling gates"
        )
    p = _settle(body, pods)
    running = next(c for c in p.status["conditions"] if c["type"] == "Running")
    assert p.status["phase"] == "Pending" and running["status"] == "False" and running["reason"] == "SchedulingGated"
    assert running["message"] == "6 pods wait behind a scheduling gate until Kueue's queue 'team-a' admits the job"
    assert [e[0] for e in p.events if e[1] == "SchedulingGated"] == ["Normal"]
    assert not [e for e in _settle(body, pods).events if e[1] == "SchedulingGated"]


def test_unschedulable_pod_is_explained_not_silently_pending():
    body = _body()
    _settle(body, [])
    pods = _pods(body, phase="Pending")
    for pod in pods:
        if pod["metadata"]["name"] == "j-worker-3":
            pod["status"]["conditions"] = _not_scheduled(
                "Unschedulable", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
            )
    p = _settle(body, pods)
    assert p.status["phase"] == "Pending"
    running = next(c for c in p.status["conditions"] if c["type"] == "Running")
    assert running["status"] == "False" and running["reason"] == "Unschedulable"
    assert "j-worker-3" in running["message"] and "Insufficient nvidia.com/gpu" in running["message"]
    assert [e for e in p.events if e[1] == "Unschedulable"]
    again = _settle(body, pods)  # still stuck: no second Event, no status change
    assert not [e for e in again.events if e[1] == "Unschedulable"]
    assert again.status["conditions"] == p.status["conditions"]
    for pod in pods:
        pod["status"] = {**pod["status"], "phase": "Running", "conditions": []}
    running = next(c for c in _settle(body, pods).status["conditions"] if c["type"] == "Running")
    assert running["status"] == "True"


def _model_load_failed(pod: dict, message: str | None, in_place: bool) -> None:
    """The kubelet's record of a container that exited with the runtime's model-load exit code."""
    terminated = {"exitCode": 4, "reason": "Error", **({"message": message} if message else {})}
    status = pod["status"]["containerStatuses"][0]
    if in_place:  # restartPolicy OnFailure: the kubelet is already waiting to run it again
        status.update(
            restartCount=1, state={"waiting": {"reason": "CrashLoopBackOff"}}, lastState={"terminated": terminated}
        )
    else:
        pod["status"]["phase"] = "Failed"
        status["state"] = {"terminated": terminated}


@pytest.mark.parametrize("in_place", [True, False])
def test_a_model_that_cannot_load_fails_the_job_quoting_the_error(in_place):
    body = _body(policy="OnFailure")
    _settle(body, [])
    pods = _pods(body)
    error = "model mymodels.ctr:build: ModuleNotFoundError: No module named 'mymodels'"
    _model_load_failed(pods[3], error, in_place)
    p = _settle(body, pods)
    assert p.status["phase"] == "Failed" and not p.restart and not p.create
    failed = next(c for c in p.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ModelLoadFailed"
    assert error in failed["message"] and "j-worker-1" in failed["message"]
    # a crash-looping pod is stopped with the rest; a failed one stays, with its log
    assert ("j-worker-1" in p.stop) is in_place and "j-ps-0" in p.stop


def test_a_model_load_failure_without_a_message_points_at_the_log():
    body = _body(policy="ExitCode")
    _settle(body, [])
    pods = _pods(body)
    _model_load_failed(pods[0], None, in_place=False)
    p = _settle(body, pods)
    assert p.status["phase"] == "Failed"
    failed = next(c for c in p.status["conditions"] if c["type"] == "Failed")
    assert failed["message"].endswith("no message: see kubectl logs j-ps-0")
