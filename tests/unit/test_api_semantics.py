"""One manifest, one meaning: the same exits fed to the operator's plan() and to `tfps local`'s
decisions give the same outcome (tfps.api.semantics decides on both paths)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tfps.api import semantics
from tfps.api.spec import ReplicaType, RestartPolicy, TrainingJob
from tfps.operator import builders, reconcile
from tfps.operator.config import OperatorConfig
from tfps.runtime.local import LocalRun

NOW = datetime(2026, 1, 1, tzinfo=UTC)
CUSTOM = {"spec": {"containers": [{"name": "tensorflow", "command": ["python3", "-c", "pass"]}]}}


def _job_of(replicas: dict[str, tuple[int, str]], training=True, success_policy="", backoff=3) -> TrainingJob:
    """A job of these replica types, in this order: (count, restartPolicy) each."""
    specs = {
        rtype: {"replicas": n, "restartPolicy": policy, **({} if training else {"template": CUSTOM})}
        for rtype, (n, policy) in replicas.items()
    }
    spec = {"replicaSpecs": specs, "runPolicy": {"backoffLimit": backoff}, "successPolicy": success_policy}
    if training:
        spec["training"] = {}
    return TrainingJob.model_validate(
        {"metadata": {"name": "j", "namespace": "ns", "uid": "uid-j", "generation": 1}, "spec": spec}
    )


def _job(workers=(2, "OnFailure"), ps=(1, "OnFailure"), chief=None, evaluator=None, **options) -> TrainingJob:
    """A job of one PS and two workers, all OnFailure, unless told otherwise ((count, restartPolicy),
    None for none); `options`: _job_of's."""
    replicas = {"PS": ps, "Chief": chief, "Worker": workers, "Evaluator": evaluator}
    return _job_of({rtype: r for rtype, r in replicas.items() if r is not None}, **options)


# (what the job has, the exits in order as "type-index:code") -> (outcome, restarts). A failed
# job's restart count is left out: a kubelet has already restarted in place the one that
# exceeded the budget when the operator sees it, where `tfps local` never starts it.
CASES = {
    "worker 0 decides by default": (_job(), ["worker-0:0"], ("Succeeded", 0)),
    "worker 1 alone does not": (_job(), ["worker-1:0"], ("Running", 0)),
    "AllWorkers waits for every worker": (_job(success_policy="AllWorkers"), ["worker-0:0"], ("Running", 0)),
    "AllWorkers, all done": (_job(success_policy="AllWorkers"), ["worker-0:0", "worker-1:0"], ("Succeeded", 0)),
    "the Chief decides, not worker 0": (_job(chief=(1, "OnFailure")), ["worker-0:0", "worker-1:0"], ("Running", 0)),
    "the Chief completes": (_job((1, "OnFailure"), chief=(1, "OnFailure")), ["chief-0:0"], ("Succeeded", 0)),
    "an Evaluator does not decide": (
        _job((1, "OnFailure"), evaluator=(1, "OnFailure")),
        ["evaluator-0:0"],
        ("Running", 0),
    ),
    "OnFailure restarts a failed worker": (_job(), ["worker-1:1"], ("Running", 1)),
    "Never fails the job": (_job((2, "Never")), ["worker-1:1"], ("Failed", 0)),
    "ExitCode retries 137": (_job((2, "ExitCode")), ["worker-1:137"], ("Running", 1)),
    "ExitCode fails on 1": (_job((2, "ExitCode")), ["worker-1:1"], ("Failed", 0)),
    "Always restarts a PS that exited 0": (_job((1, "OnFailure"), ps=(1, "Always")), ["ps-0:0"], ("Running", 1)),
    "Always: a finished worker is done": (_job((2, "Always"), ps=(1, "Always")), ["worker-0:0"], ("Succeeded", 0)),
    "the backoff limit is spent": (_job(backoff=1), ["worker-1:1", "worker-1:1"], ("Failed", None)),
    "custom program, Chief decides": (
        _job(ps=None, chief=(1, "OnFailure"), training=False),
        ["worker-0:0", "chief-0:0"],
        ("Succeeded", 0),
    ),
    "custom program, no PS needed": (_job((1, "Never"), ps=None, training=False), ["worker-0:3"], ("Failed", 0)),
}


def _parse(exit_: str) -> tuple[str, int, int]:
    replica, _, code = exit_.partition(":")
    rtype, _, index = replica.rpartition("-")
    return rtype, int(index), int(code)


def local_outcome(job: TrainingJob, exits: list[str], tmp_path) -> tuple[str, int]:
    run = LocalRun(job, workdir=tmp_path)
    for exit_ in exits:
        rtype, index, code = _parse(exit_)
        _, failure = run.on_exit(run.replicas[(rtype, index)], code)
        if failure:
            return "Failed", run.restarts
    return ("Succeeded" if run.succeeded() else "Running"), run.restarts


def _running() -> dict:
    """A pod's status while its container runs, not yet restarted."""
    return {
        "phase": "Running",
        "containerStatuses": [{"name": "tensorflow", "restartCount": 0, "state": {"running": {}}}],
    }


def operator_outcome(job: TrainingJob, exits: list[str]) -> tuple[str, int]:
    """The pods as the kubelet leaves them after each exit (a restart in place, Succeeded or
    Failed by the pod's restartPolicy), then the operator's plan()."""
    body = {
        "apiVersion": "tfps.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": job.metadata,
        "spec": job.spec.to_manifest(),
        "status": {},
    }
    pods = {p["metadata"]["name"]: p for p in builders.desired_pods(job, OperatorConfig())}
    for name, pod in pods.items():
        pod["metadata"]["uid"] = f"uid-{name}"
        pod["status"] = _running()
    body["status"] = reconcile.plan(body, list(pods.values()), NOW).status
    for exit_ in exits:
        rtype, index, code = _parse(exit_)
        pod = pods[f"j-{rtype}-{index}"]
        container = pod["status"]["containerStatuses"][0]
        kubelet = pod["spec"]["restartPolicy"]
        if kubelet == "Always" or (kubelet == "OnFailure" and code != 0):
            container["restartCount"] += 1
        else:
            pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            container["state"] = {"terminated": {"exitCode": code}}
        result = reconcile.plan(body, list(pods.values()), NOW)
        body["status"] = result.status
        for name in result.restart:  # recreated by the controller
            pods[name]["status"] = _running()
        if result.status["phase"] in ("Succeeded", "Failed"):
            break
    phase = body["status"]["phase"]
    return ("Running" if phase in ("Pending", "Running", "Restarting") else phase), body["status"]["restartCount"]


@pytest.mark.parametrize("case", CASES)
def test_tfps_local_and_the_operator_decide_alike(case, tmp_path):
    job, exits, expected = CASES[case]

    def seen(outcome):
        return (outcome[0], None) if outcome[0] == "Failed" and expected[1] is None else outcome

    assert seen(operator_outcome(job, exits)) == expected
    assert seen(local_outcome(job, exits, tmp_path)) == expected


def test_replicas_come_in_creation_order():
    job = _job_of(
        {"Evaluator": (1, "Never"), "Worker": (2, "OnFailure"), "Chief": (1, "OnFailure"), "PS": (1, "OnFailure")}
    )
    assert semantics.replicas(job.spec) == [
        (ReplicaType.PS, 0),
        (ReplicaType.CHIEF, 0),
        (ReplicaType.WORKER, 0),
        (ReplicaType.WORKER, 1),
        (ReplicaType.EVALUATOR, 0),
    ]


@pytest.mark.parametrize(
    "policy, code, retried",
    [
        ("OnFailure", 1, True),
        ("Always", 1, True),
        ("Never", 1, False),
        ("ExitCode", 1, False),
        ("ExitCode", 137, True),
        ("ExitCode", -9, True),
        ("ExitCode", None, True),
        ("Never", None, False),
        ("Always", semantics.USER_CODE_EXIT_CODE, False),  # a model that cannot load won't on a restart
        ("OnFailure", semantics.USER_CODE_EXIT_CODE, False),
    ],
)
def test_retryable_exit_codes(policy, code, retried):
    assert semantics.retryable(RestartPolicy(policy), code) is retried


def test_tfps_local_runs_every_replica_and_custom_programs(tmp_path):
    job = _job((1, "OnFailure"), ps=None, chief=(1, "OnFailure"), evaluator=(1, "OnFailure"), training=False)
    run = LocalRun(job, workdir=tmp_path)
    assert set(run.replicas) == {("chief", 0), ("worker", 0), ("evaluator", 0)}
    chief = run.replicas[("chief", 0)]
    assert run._command(chief) == ["python3", "-c", "pass"]
    env = run._environment(chief)
    assert "TFPS_TRAINING" not in env and env["TFPS_RESULT_FILE"]  # the Chief reports
    built_in = LocalRun(_job((1, "OnFailure")), workdir=tmp_path / "b")
    assert built_in._command(built_in.replicas[("ps", 0)])[-1] == "ps"
