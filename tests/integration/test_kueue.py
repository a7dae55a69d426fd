"""Queueing with Kueue (sigs.k8s.io/kueue, built by hack/build-kueue.sh, run by hack/kueue.py) on the
real control plane, its pods on kwok's fake nodes (hack/kwok.py): a ClusterQueue with quota for
one job, two TrainingJobs submitted to it. The second waits, gated and unbound, while the first
runs; the first succeeds and its PS pod is cleaned up; then the second is admitted, runs and
succeeds; at the end both Workloads are finished and the ClusterQueue uses nothing. Also: a crashed
worker recreated into the group Kueue already admitted, and a suspended job's quota freed and its
resumed run queued as a new group."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import GROUP, OperatorHarness, job_manifest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import hack_module, pods_state, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

kueue_hack = hack_module("kueue")
kwok = hack_module("kwok")
KUEUE, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
GATE = "kueue.x-k8s.io/admission"
# Each pod asks for 1 CPU and 1Gi; a job is one PS and one worker: the queue holds one job's worth.
REQUESTS = {"cpu": "1", "memory": "1Gi"}
QUOTA = {"cpu": "2", "memory": "2Gi"}


def _template(succeed_after: str | None = None) -> dict:
    meta = {"annotations": {kwok.SUCCEED_AFTER: succeed_after}} if succeed_after else {}
    return {
        "metadata": meta,
        "spec": {**_placement(), "containers": [{"name": "tensorflow", "resources": {"requests": REQUESTS}}]},
    }


def _job(name: str, worker_succeeds_after: str | None, queue_label: bool) -> dict:
    body = job_manifest(name, ps=1, workers=1, template=_template())
    body["spec"]["replicaSpecs"]["Worker"]["template"] = _template(worker_succeeds_after)
    if queue_label:  # how Kueue's users label their jobs
        body["metadata"]["labels"] = {QUEUE_LABEL: "tfps-queue"}
    else:  # TFJob's field
        body["spec"]["runPolicy"] = {"schedulingPolicy": {"queue": "tfps-queue"}}
    return body


# kwok's fake node for these tests alone: a label of its own, so another test's kwok (one per
# label, hack/kwok.py) never plays or deletes it. Its pods get addresses in kwok.POD_CIDR, which
# the operator dials to read a PS pod's metrics: hack/kwok.py routes that block nowhere.
NODE = "kwok-kueue-0"
NODE_LABEL = ("tfps.io/kueue-test-node", "true")


def _placement() -> dict:
    return kwok.placement(NODE_LABEL)


def _kwok_node(cluster, log_path: Path):
    """kwok playing the kubelet of one node with 8 CPUs and 32Gi."""
    node = kwok.node_manifest(NODE, cpu="8", memory="32Gi", label=NODE_LABEL)
    return kwok.running(cluster.kubeconfig, [node], log_path, label=NODE_LABEL)


@pytest.fixture(scope="module")
def kueue_env(crds, tmp_path_factory):
    """The kwok node and Kueue, shared by this file's tests (each has its own namespace and queues)."""
    if not kueue_hack.binary().exists():
        pytest.skip(f"Kueue is not built ({kueue_hack.binary()} is missing): run hack/build-kueue.sh")
    logs = tmp_path_factory.mktemp("kueue")
    with _kwok_node(crds, logs / "kwok.log"), kueue_hack.running(crds.kubeconfig, logs / "kueue.log") as kueue:
        yield kueue


@pytest.fixture
def kueue_cluster(kueue_env, crds, namespace):
    """The test's namespace managed by Kueue (labelled); its queues deleted afterwards."""
    crds.kubectl("label", "namespace", namespace, f"{kueue_hack.NAMESPACE_LABEL[0]}={kueue_hack.NAMESPACE_LABEL[1]}")
    try:
        yield kueue_env
    finally:
        _delete_queues(client.CustomObjectsApi(crds.api), namespace)


def _queues(custom: client.CustomObjectsApi, namespace: str) -> str:
    flavor = f"tfps-{namespace}"
    custom.create_cluster_custom_object(
        KUEUE,
        KUEUE_VERSION,
        "resourceflavors",
        {"apiVersion": f"{KUEUE}/{KUEUE_VERSION}", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
    )
    custom.create_cluster_custom_object(
        KUEUE,
        KUEUE_VERSION,
        "clusterqueues",
        {
            "apiVersion": f"{KUEUE}/{KUEUE_VERSION}",
            "kind": "ClusterQueue",
            "metadata": {"name": flavor},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "resourceGroups": [
                    {
                        "coveredResources": list(QUOTA),
                        "flavors": [
                            {"name": flavor, "resources": [{"name": r, "nominalQuota": q} for r, q in QUOTA.items()]}
                        ],
                    }
                ],
            },
        },
    )
    custom.create_namespaced_custom_object(
        KUEUE,
        KUEUE_VERSION,
        namespace,
        "localqueues",
        {
            "apiVersion": f"{KUEUE}/{KUEUE_VERSION}",
            "kind": "LocalQueue",
            "metadata": {"name": "tfps-queue"},
            "spec": {"clusterQueue": flavor},
        },
    )
    return flavor


def _delete_queues(custom: client.CustomObjectsApi, namespace: str) -> None:
    name = f"tfps-{namespace}"
    for delete in (
        lambda: custom.delete_namespaced_custom_object(KUEUE, KUEUE_VERSION, namespace, "localqueues", "tfps-queue"),
        lambda: custom.delete_cluster_custom_object(KUEUE, KUEUE_VERSION, "clusterqueues", name),
        lambda: custom.delete_cluster_custom_object(KUEUE, KUEUE_VERSION, "resourceflavors", name),
    ):
        try:
            delete()
        except ApiException as err:
            if err.status != 404:
                raise


def _report(op: OperatorHarness, kueue) -> None:
    """What a failure here needs, most telling first (CI output keeps a failure's first lines):
    where each pod is and what holds it, then the operator's and Kueue's last lines."""
    print("\n".join(pods_state(op.core.api_client, op.namespace)))
    print(op.logs()[-4000:], "\n--- kueue ---\n", kueue.log()[-4000:])


def _condition(obj: dict | None, ctype: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def test_second_job_waits_for_the_quota_the_first_frees(kueue_cluster, crds, namespace, tmp_path):
    custom = client.CustomObjectsApi(crds.api)
    cq = _queues(custom, namespace)
    wait_for(
        "the ClusterQueue active",
        lambda: (
            _condition(custom.get_cluster_custom_object(KUEUE, KUEUE_VERSION, "clusterqueues", cq), "Active").get(
                "status"
            )
            == "True"
        ),
    )

    op = OperatorHarness(crds, namespace, tmp_path)
    op.start(config={"scheduling": {"queueing": "kueue", "gang": "none"}})
    try:
        _run_two_jobs(op, custom, cq)
    except BaseException:
        _report(op, kueue_cluster)
        raise
    finally:
        op.cleanup()


def _workload(custom, namespace: str, name: str) -> dict | None:
    try:
        return custom.get_namespaced_custom_object(KUEUE, KUEUE_VERSION, namespace, "workloads", name)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _group(op: OperatorHarness, job: str) -> str:
    pods = op.wait_pods(job, {f"{job}-ps-0", f"{job}-worker-0"}, timeout=60)
    (group,) = {p.metadata.labels[GROUP_LABEL] for p in pods.values()}
    return group


def _run_two_jobs(op: OperatorHarness, custom, cq: str) -> None:
    ns = op.namespace
    # The first job's worker runs until the test lets it finish (the annotation comes later).
    op.create(_job("first", worker_succeeds_after=None, queue_label=False))
    first = _group(op, "first")
    wait_for(
        "the first job's Workload admitted",
        lambda: _condition(_workload(custom, ns, first), "Admitted").get("status") == "True",
        timeout=60,
    )
    op.wait_phase("first", "Running", timeout=60)
    assert {p.spec.node_name for p in op.pods("first").values()} == {NODE}

    op.create(_job("second", worker_succeeds_after="2s", queue_label=True))
    second = _group(op, "second")
    held = wait_for(
        "the second job's Workload pending for quota",
        lambda: (c := _condition(_workload(custom, ns, second), "QuotaReserved")) and c["status"] == "False" and c,
        timeout=60,
    )
    assert "insufficient" in held["message"] or "quota" in held["message"], held
    # While the first runs, the second's pods exist but Kueue's gate keeps them off every node.
    assert op.status("first")["phase"] == "Running"
    for pod in op.pods("second").values():
        assert GATE in [g.name for g in pod.spec.scheduling_gates or []], pod.metadata.name
        assert pod.spec.node_name is None
        assert pod.status.phase == "Pending"
    # ... and the job says why it is Pending.
    waiting = wait_for(
        "the second job's Running condition naming its queue",
        lambda: next(
            (
                c
                for c in op.status("second").get("conditions") or []
                if c["type"] == "Running" and c["reason"] == "SchedulingGated"
            ),
            None,
        ),
        timeout=30,
    )
    assert op.status("second")["phase"] == "Pending"
    assert "until Kueue's queue" in waiting["message"] and waiting["status"] == "False", waiting

    # The first job's worker finishes: the job succeeds, its PS pod is cleaned up.
    op.core.patch_namespaced_pod("first-worker-0", ns, {"metadata": {"annotations": {kwok.SUCCEED_AFTER: "1s"}}})
    op.wait_phase("first", "Succeeded", timeout=60)
    wait_for("the first job's PS pod gone", lambda: "first-ps-0" not in _all_pods(op, "first"), timeout=60)
    done = wait_for(
        "the first job's Workload finished",
        lambda: (c := _condition(_workload(custom, ns, first), "Finished")) and c["status"] == "True" and c,
        timeout=60,
    )
    assert done["reason"] == "Succeeded", done

    # Then the second is admitted, placed, runs and succeeds.
    wait_for(
        "the second job's Workload admitted",
        lambda: _condition(_workload(custom, ns, second), "Admitted").get("status") == "True",
        timeout=60,
    )
    op.wait_phase("second", "Succeeded", timeout=90)
    wait_for("the second job's PS pod gone", lambda: "second-ps-0" not in _all_pods(op, "second"), timeout=60)
    wait_for(
        "the second job's Workload finished",
        lambda: _condition(_workload(custom, ns, second), "Finished").get("status") == "True",
        timeout=60,
    )

    # Every pod of both jobs ran on the kwok node; nothing holds the queue's quota any more.
    usage = wait_for(
        "the ClusterQueue's quota released",
        lambda: (
            (s := custom.get_cluster_custom_object(KUEUE, KUEUE_VERSION, "clusterqueues", cq).get("status") or {})
            and s.get("admittedWorkloads") == 0
            and s.get("reservingWorkloads") == 0
            and s
        ),
        timeout=60,
    )
    totals = {r["name"]: r["total"] for f in usage.get("flavorsUsage", []) for r in f["resources"]}
    assert set(totals) == set(QUOTA) and all(v in ("0", 0) for v in totals.values()), usage


def _all_pods(op: OperatorHarness, job: str) -> set[str]:
    """Every pod of the job the API server still has, terminating ones included."""
    items = op.core.list_namespaced_pod(op.namespace, label_selector=f"{GROUP}/job-name={job}").items
    return {p.metadata.name for p in items}


def test_a_restarted_worker_rejoins_the_admitted_group(kueue_cluster, crds, namespace, tmp_path):
    """The operator recreates a failed worker under the same name: Kueue lets the new pod into the
    Workload it already admitted (no second admission, no quota counted twice)."""
    custom = client.CustomObjectsApi(crds.api)
    cq = _queues(custom, namespace)
    op = OperatorHarness(crds, namespace, tmp_path)
    op.start(config={"scheduling": {"queueing": "kueue", "gang": "none"}})
    try:
        op.create(_job("job", worker_succeeds_after=None, queue_label=True))
        group = _group(op, "job")
        op.wait_phase("job", "Running", timeout=60)
        before = op.pods("job")["job-worker-0"].metadata.uid
        op.set_pod("job-worker-0", "Failed", exit_code=1)  # as its kubelet would report a crash
        again = wait_for(
            "a new job-worker-0 running",
            lambda: (
                (p := op.pods("job").get("job-worker-0"))
                and p.metadata.uid != before
                and p.status.phase == "Running"
                and p
            ),
            timeout=90,
        )
        assert again.spec.node_name == NODE and not again.spec.scheduling_gates
        assert op.status("job")["restartCount"] == 1
        workload = _workload(custom, namespace, group)
        assert _condition(workload, "Admitted")["status"] == "True" and not _condition(workload, "Finished")
        # One Workload, counted once (ClusterQueue status is written a moment after admission).
        wait_for(
            "one job's quota in use",
            lambda: (
                (
                    s := custom.get_cluster_custom_object(KUEUE, KUEUE_VERSION, "clusterqueues", cq).get("status") or {}
                ).get("admittedWorkloads")
                == 1
                and {r["name"]: r["total"] for f in s.get("flavorsUsage", []) for r in f["resources"]} == QUOTA
            ),
            timeout=30,
        )
        op.core.patch_namespaced_pod(
            "job-worker-0", namespace, {"metadata": {"annotations": {kwok.SUCCEED_AFTER: "1s"}}}
        )
        op.wait_phase("job", "Succeeded", timeout=60)
        wait_for(
            "the Workload finished",
            lambda: _condition(_workload(custom, namespace, group), "Finished").get("status") == "True",
            timeout=60,
        )
    except BaseException:
        _report(op, kueue_cluster)
        raise
    finally:
        op.cleanup()


def test_suspending_a_queued_job_frees_its_quota_and_resuming_queues_it_anew(kueue_cluster, crds, namespace, tmp_path):
    custom = client.CustomObjectsApi(crds.api)
    cq = _queues(custom, namespace)
    op = OperatorHarness(crds, namespace, tmp_path)
    op.start(config={"scheduling": {"queueing": "kueue", "gang": "none"}})

    def usage() -> dict:
        status = custom.get_cluster_custom_object(KUEUE, KUEUE_VERSION, "clusterqueues", cq).get("status") or {}
        return {r["name"]: r["total"] for f in status.get("flavorsUsage", []) for r in f["resources"]}

    try:
        op.create(_job("job", worker_succeeds_after=None, queue_label=True))
        first = _group(op, "job")
        op.wait_phase("job", "Running", timeout=60)
        wait_for("the job's quota in use", lambda: usage() == QUOTA, timeout=30)
        op.patch_spec("job", {"runPolicy": {"suspend": True}})
        op.wait_phase("job", "Suspended", timeout=30)
        wait_for("every pod of the job gone", lambda: not _all_pods(op, "job"), timeout=60)
        try:
            wait_for("the quota released", lambda: set(usage().values()) <= {"0"}, timeout=120)
        except AssertionError as err:  # say what still holds it
            workloads = custom.list_namespaced_custom_object(KUEUE, KUEUE_VERSION, namespace, "workloads")["items"]
            raise AssertionError(f"{err}; usage {usage()}; Workloads: {workloads}") from None

        op.patch_spec("job", {"runPolicy": {"suspend": False}})
        second = _group(op, "job")
        assert second != first  # a new group, admitted on its own
        wait_for(
            "the new group admitted",
            lambda: _condition(_workload(custom, namespace, second), "Admitted").get("status") == "True",
            timeout=60,
        )
        op.wait_phase("job", "Running", timeout=60)
        wait_for("the job's quota in use", lambda: usage() == QUOTA, timeout=30)
    except BaseException:
        _report(op, kueue_cluster)
        raise
    finally:
        op.cleanup()
