"""Kueue's plain pod groups (operator/kueue.py): the labels and annotations a queued job's pods get,
checked against the rules of Kueue's pod webhook and controller (sigs.k8s.io/kueue v0.17.0,
pkg/controller/jobs/pod), and the patches that let a finished job's group end."""

from __future__ import annotations

import re

import pytest

from tfps.api.spec import TrainingJob
from tfps.operator import builders, kueue
from tfps.operator.config import OperatorConfig

KUEUE_ON = OperatorConfig.model_validate({"scheduling": {"queueing": "kueue"}})
STARTED = "2026-11-30T18:00:00Z"
# Kubernetes' label value and DNS-1123 subdomain (a Workload's name: Kueue's ValidateLabelAsCRDName).
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _job(name="digits", uid="0f1e2d3c-aaaa-bbbb-cccc-000000000001", labels=None, policy=None, ps=2, workers=3, chief=0):
    replicas = {"PS": {"replicas": ps}, "Worker": {"replicas": workers}}
    if chief:
        replicas["Chief"] = {"replicas": chief}
    body = {
        "apiVersion": "tfps.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "ml", "uid": uid, "labels": labels or {}},
        "spec": {"replicaSpecs": replicas, "training": {"steps": 10}},
    }
    if policy is not None:
        body["spec"]["runPolicy"] = {"schedulingPolicy": policy}
    return TrainingJob.model_validate(body)


def _pods(job, config=KUEUE_ON):
    return kueue.label_pods(builders.desired_pods(job, config), job, config, STARTED)


def test_every_pod_of_a_queued_job_joins_one_group_of_all_its_pods():
    job = _job(policy={"queue": "team-a"}, chief=1)
    pods = _pods(job)
    assert len(pods) == 6
    groups = {p["metadata"]["labels"][kueue.GROUP_LABEL] for p in pods}
    assert len(groups) == 1
    for pod in pods:
        assert pod["metadata"]["labels"][kueue.QUEUE_LABEL] == "team-a"
        assert pod["metadata"]["annotations"][kueue.TOTAL_COUNT] == "6"
        # Kueue's pod webhook refuses a group label without the count annotation and the reverse.
        assert kueue.RETRIABLE not in pod["metadata"]["annotations"]
        # The operator's own labels stay.
        assert pod["metadata"]["labels"]["tfps.io/job-name"] == "digits"


def test_the_queue_comes_from_the_scheduling_policy_else_the_jobs_own_label():
    assert kueue.queue_name(_job(labels={kueue.QUEUE_LABEL: "lq"})) == "lq"
    assert kueue.queue_name(_job(labels={kueue.QUEUE_LABEL: "lq"}, policy={"queue": "team-a"})) == "team-a"
    assert kueue.queue_name(_job()) is None


@pytest.mark.parametrize(
    "config, job",
    [
        (OperatorConfig(), _job(policy={"queue": "team-a"})),  # queueing off: a queue name changes nothing
        (KUEUE_ON, _job()),  # no queue named: Kueue leaves the pods alone
    ],
)
def test_no_kueue_metadata_without_queueing_or_without_a_queue(config, job):
    assert kueue.pod_metadata(job, config, STARTED) == ({}, {})
    assert all(
        not any(
            k.startswith("kueue.x-k8s.io/") for k in {**p["metadata"]["labels"], **p["metadata"].get("annotations", {})}
        )
        for p in _pods(job, config)
    )


@pytest.mark.parametrize("name", ["a", "digits", "x" * 50, "ab-" * 16 + "c"])
def test_the_group_name_is_a_label_value_and_a_workload_name(name):
    group = kueue.group_name(_job(name=name), STARTED)
    assert len(group) <= 63 and LABEL_VALUE.match(group) and DNS_SUBDOMAIN.match(group)
    assert group.startswith(name[:20])


def test_the_group_is_one_per_incarnation():
    job = _job()
    assert kueue.group_name(job, STARTED) == kueue.group_name(job, STARTED)  # restarts, operator restarts
    assert kueue.group_name(job, STARTED) != kueue.group_name(job, "2026-11-30T19:00:00Z")  # resumed
    other_uid = _job(uid="0f1e2d3c-aaaa-bbbb-cccc-000000000002")  # deleted and created again
    assert kueue.group_name(job, STARTED) != kueue.group_name(other_uid, STARTED)


def _live(pod, phase, finalizers=(kueue.FINALIZER,), annotations=None):
    """A pod as the API returns it once Kueue's webhook has taken it."""
    pod = {
        **pod,
        "metadata": {**pod["metadata"], "resourceVersion": "7", "finalizers": list(finalizers)},
        "status": {"phase": phase},
    }
    if annotations:
        pod["metadata"]["annotations"] = {**pod["metadata"]["annotations"], **annotations}
    return pod


def test_at_the_end_every_pod_is_marked_and_running_pods_deleted_lose_kueues_finalizer():
    job = _job(policy={"queue": "q"}, ps=1, workers=2)
    ps, w0, w1 = _pods(job)
    pods = [
        _live(ps, "Running", finalizers=("other.io/keep", kueue.FINALIZER)),
        _live(w0, "Succeeded"),
        _live(w1, "Succeeded"),
    ]
    patches = dict(kueue.release_patches(pods, job.metadata["uid"], ending=True, delete=["digits-ps-0"]))
    assert set(patches) == {"digits-ps-0", "digits-worker-0", "digits-worker-1"}
    for patch in patches.values():
        assert patch["metadata"]["annotations"] == {kueue.RETRIABLE: "false"}
    # The PS goes when its kubelet has stopped it; the succeeded workers keep Kueue's finalizer:
    # Kueue counts them, ends the group, then removes it.
    assert patches["digits-ps-0"]["metadata"]["finalizers"] == ["other.io/keep"]
    assert patches["digits-ps-0"]["metadata"]["resourceVersion"] == "7"
    assert "finalizers" not in patches["digits-worker-0"]["metadata"]


def test_nothing_to_send_once_marked_and_nothing_for_pods_without_a_group_or_of_another_job():
    job = _job(policy={"queue": "q"}, ps=1, workers=1)
    ps, w0 = _pods(job)
    marked = [_live(p, "Succeeded", annotations={kueue.RETRIABLE: "false"}) for p in (ps, w0)]
    assert kueue.release_patches(marked, job.metadata["uid"], ending=True, delete=["digits-ps-0"]) == []
    unqueued = _pods(_job(), KUEUE_ON)
    assert kueue.release_patches([_live(p, "Running") for p in unqueued], job.metadata["uid"], ending=True) == []
    assert kueue.release_patches([_live(ps, "Running")], "another-uid", ending=True, delete=["digits-ps-0"]) == []


def test_a_restarted_pod_loses_the_finalizer_but_the_group_stays_retriable():
    """The replacement has the same name: Kueue would keep the failed pod until it exists."""
    job = _job(policy={"queue": "q"}, ps=1, workers=1)
    ps, w0 = _pods(job)
    pods = [_live(ps, "Running"), _live(w0, "Failed")]
    assert kueue.release_patches(pods, job.metadata["uid"], ending=False, restart=["digits-worker-0"]) == [
        ("digits-worker-0", {"metadata": {"finalizers": [], "resourceVersion": "7"}})
    ]


@pytest.mark.parametrize(
    "phase, ending",
    [
        ("Succeeded", True),
        ("Failed", True),
        ("Suspended", True),
        ("Running", False),
        ("Restarting", False),
        ("Pending", False),
        (None, False),
    ],
)
def test_which_phases_end_the_group(phase, ending):
    assert kueue.ending(phase) is ending
