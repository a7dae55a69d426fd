"""Faults during a real training run, each in its own test: the job still reaches Succeeded,
ends within 1 accuracy point of an undisturbed run with the same seed, a restored PS redoes at
most one checkpoint interval and no checkpointed step is lost, and never are two pods (in the
API) or two processes (on this machine) alive for one replica, nor more pods than replicas.

The stack is the real one: kube-apiserver, etcd, controller-manager and scheduler, the chart
installed by helm (its operator a container with the chart's ServiceAccount), PS and worker
containers run by a real kubelet, containerd and runc. Tests that restart kube-apiserver/etcd or
the node disturb every user of the cluster: run this file in a session of its own (`make
reliability` does).

Each fault's figures go to the reliability report (hack/reliability.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from jobrun import JobRun, install_chart, manifest
from kubernetes import client
from support import wait_for

from tfps.api.naming import ENV_CRASH_AT
from tfps.runtime.checkpoint import CRASH_MARKER

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "hack" / "cluster.sh"
# A checkpoint every 50 steps, the fault after step 150. The fault lands a second or more after the
# test sees step 150 (its scrapes, kubectl) and steps are fast: the run must outlast that delay by
# far, or the fault hits a job that has already finished.
STEPS, EVERY = 1600, 50
FAULT_AT = 150  # the step (of PS 0) after which the fault is injected
ACCURACY_POINTS = 0.01


@pytest.fixture(scope="module")
def stack(cluster):
    """A namespace with the chart installed (operator serving only it), shared by the module's jobs."""
    ns = cluster.create_namespace(f"faults-{uuid.uuid4().hex[:6]}")
    try:
        with install_chart(cluster, ns):
            yield ns
            custom = client.CustomObjectsApi(cluster.api)
            custom.delete_collection_namespaced_custom_object("tfps.io", "v1alpha1", ns, "trainingjobs")
            wait_for(
                "the jobs deleted (the operator's finalizer)",
                lambda: not custom.list_namespaced_custom_object("tfps.io", "v1alpha1", ns, "trainingjobs")["items"],
                timeout=60,
            )
    finally:
        cluster.delete_namespace(ns)


def _run(cluster, ns: str, name: str, tmp_path: Path, ps_env: dict | None = None) -> JobRun:
    body = manifest(name, tmp_path / "checkpoints", steps=STEPS, every=EVERY, ps_env=ps_env)
    return JobRun(cluster, ns, body).start()


@pytest.fixture(scope="module")
def baseline(cluster, stack, tmp_path_factory) -> dict:
    """The undisturbed run, same seed and shape: the accuracy the faulted runs are held to."""
    run = _run(cluster, stack, "baseline", tmp_path_factory.mktemp("baseline"))
    try:
        status = run.wait_finished()
    finally:
        run.stop_watching()
    assert status["phase"] == "Succeeded", status
    result = run.result()
    run.delete()
    assert result["steps"] == STEPS and result["accuracy"] >= 0.9, result
    return result


def _cluster_sh(cluster, *args: str) -> None:
    subprocess.run([str(CLUSTER_SH), *args], env=cluster.env, check=True, capture_output=True, timeout=300)


def _operator_pod(cluster, ns: str):
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(ns, label_selector="app.kubernetes.io/name=tfps").items
    (pod,) = [p for p in pods if not p.metadata.deletion_timestamp]
    return pod


def _kill_operator(cluster, ns: str) -> None:
    """SIGKILL the operator's process from the host; the kubelet restarts its container (the
    Deployment's pod has restartPolicy Always)."""
    pod = _operator_pod(cluster, ns)
    os.kill(cluster.container_pid(pod), signal.SIGKILL)

    def restarted():
        cs = _operator_pod(cluster, ns).status.container_statuses[0]
        return cs.restart_count > 0 and cs.state.running

    wait_for("the operator's container restarted by the kubelet", restarted, timeout=90, interval=0.5)


def _inject(fault: str, run: JobRun, cluster, ns: str) -> None:
    if fault == "ps-0 SIGKILL":
        run.kill("ps", 0)
    elif fault == "worker-1 SIGKILL":
        run.kill("worker", 1)
    elif fault == "ps-0 pod deleted (kubectl)":
        cluster.kubectl("delete", "pod", f"{run.name}-ps-0", "-n", ns, "--wait=false")
    elif fault == "worker-1 pod deleted (kubectl)":
        cluster.kubectl("delete", "pod", f"{run.name}-worker-1", "-n", ns, "--wait=false")
    elif fault == "operator SIGKILL and restart":
        _kill_operator(cluster, ns)
    elif fault == "kube-apiserver and etcd restart":
        _cluster_sh(cluster, "stop", "kube-apiserver", "etcd")
        time.sleep(5)  # training goes on without a control plane
        _cluster_sh(cluster, "restart", "etcd", "kube-apiserver")
    elif fault == "node restart (kubelet and containerd)":
        _cluster_sh(cluster, "stop", "kubelet", "containerd")
        time.sleep(5)  # containers go on without their node
        _cluster_sh(cluster, "restart", "containerd", "kubelet")
    else:
        raise ValueError(fault)


FAULTS = [
    "ps-0 SIGKILL",
    "worker-1 SIGKILL",
    "ps-0 pod deleted (kubectl)",
    "worker-1 pod deleted (kubectl)",
    "operator SIGKILL and restart",
    "kube-apiserver and etcd restart",
    "node restart (kubelet and containerd)",
]


def _check_run(run: JobRun, baseline: dict, fault: str, before: dict, record_property, status: dict) -> dict:
    """The assertions every faulted run must pass; records its figures first."""
    run.stop_watching()
    figures = {
        "kind": "fault",
        "fault": fault,
        "phase": status.get("phase"),
        "baseline": baseline["accuracy"],
        "checkpoint_interval": EVERY,
        "steps_redone": 0,
        "steps_lost": 0,
        "duplicates": len(run.watch.api_duplicates) + len(run.watch.process_duplicates) + len(run.watch.too_many),
    }
    restores = {}
    for ps in (0, 1):
        restored = run.events("ps", ps, "restored")[before[ps]["restores"] :]
        if restored:
            step = min(e["step"] for e in restored)
            restores[ps] = step
            figures["steps_redone"] = max(figures["steps_redone"], before[ps]["step"] - step)
            figures["steps_lost"] = max(figures["steps_lost"], before[ps]["checkpoint"] - step)
    figures["restores"] = restores
    result = {}
    if status.get("phase") == "Succeeded":
        result = run.result()
        figures["accuracy"] = result["accuracy"]
        figures["steps"] = result["steps"]
    record_property("reliability", figures)
    run.delete()  # its PS pods (cleanPodPolicy None), now that their logs are read

    assert status.get("phase") == "Succeeded", status
    assert result["steps"] == STEPS, result
    assert abs(result["accuracy"] - baseline["accuracy"]) <= ACCURACY_POINTS, (result, baseline)
    assert not run.watch.api_duplicates and not run.watch.too_many, run.watch
    assert not run.watch.process_duplicates, run.watch
    assert run.watch.polls > 10, run.watch
    assert figures["steps_lost"] <= 0, figures
    assert figures["steps_redone"] <= EVERY, figures
    return figures


def _before(run: JobRun) -> dict:
    """Per PS: its step, its last checkpoint and how many restores its log shows, just before a fault."""
    out = {}
    for ps in (0, 1):
        ckpts = run.events("ps", ps, "checkpoint")
        out[ps] = {
            "step": int(run.metric("ps", ps, "tfps_ps_global_step") or 0),
            "checkpoint": max((e["step"] for e in ckpts), default=0),
            "restores": len(run.events("ps", ps, "restored")),
        }
    return out


def _catch_up(run: JobRun, before: dict) -> None:
    """Steps a PS made between the scrape in `_before` and the fault: in sync mode the other PS
    stops within one step of a PS that died, so its step right after the fault bounds it."""
    for ps in (0, 1):
        other = run.metric("ps", 1 - ps, "tfps_ps_global_step")
        if other is not None:
            before[ps]["step"] = max(before[ps]["step"], int(other) - 1)


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_mid_run_is_survived(cluster, stack, baseline, fault, tmp_path, record_property):
    name = "f-" + "".join(ch if ch.isalnum() else "-" for ch in fault.lower().split(" (")[0]).strip("-")[:30].strip("-")
    run = _run(cluster, stack, name, tmp_path)
    try:
        run.wait_step(FAULT_AT)
        before = _before(run)
        _inject(fault, run, cluster, stack)
        _catch_up(run, before)
        status = run.wait_finished()
    finally:
        run.stop_watching()
    figures = _check_run(run, baseline, fault, before, record_property, status)
    if fault.startswith("ps-0"):
        assert 0 in figures["restores"], "PS 0 did not restore its checkpoint"
        assert run.watch.restarts.get(("ps", 0)) == (1 if "SIGKILL" in fault else 0), run.watch.restarts


def test_crash_in_the_middle_of_a_checkpoint_restores_the_previous_one(
    cluster, stack, baseline, tmp_path, record_property
):
    """Both PS die (SIGKILL, by a test hook) after writing the temporary file of the step-200
    checkpoint and before renaming it: each restarts from the step-150 checkpoint, intact."""
    crash_at = 4 * EVERY
    run = _run(cluster, stack, "f-checkpoint-crash", tmp_path, ps_env={ENV_CRASH_AT: str(crash_at)})
    try:
        run.wait_step(EVERY)
        before = {ps: {"step": crash_at, "checkpoint": crash_at - EVERY, "restores": 0} for ps in (0, 1)}
        status = run.wait_finished()
    finally:
        run.stop_watching()
    figures = _check_run(run, baseline, "crash mid-checkpoint (both PS)", before, record_property, status)
    assert figures["restores"] == {0: crash_at - EVERY, 1: crash_at - EVERY}, figures
    for ps in (0, 1):
        folder = tmp_path / "checkpoints" / f"ps-{ps}"
        assert (folder / CRASH_MARKER).read_text() == str(crash_at)
        assert list(folder.glob(".shard-*.tmp")), "the half-written temporary file should be left by the crash"
        assert run.watch.restarts.get(("ps", ps)) == 1, run.watch.restarts


def test_workers_scaled_up_live_mid_run(cluster, stack, tmp_path, record_property):
    """`kubectl scale tj/NAME --replicas=3` mid-run: no pod restarts, the new worker (whose
    TF_CONFIG names 3 workers while the PS pods' name 2) joins and trains, every worker cuts its
    batches in 3 from then on, and the job succeeds. A longer run than the faults', held to an
    absolute accuracy: the new pod takes a while to start (it imports TensorFlow), longer on busy
    cores, and the run must outlast that by far, or it ends before the new worker trains."""
    steps = 6000
    body = manifest("f-scale-up", tmp_path / "checkpoints", steps=steps, every=steps)
    run = JobRun(cluster, stack, body).start()
    core = client.CoreV1Api(cluster.api)
    try:
        run.wait_step(EVERY)
        uids = {
            p.metadata.name: p.metadata.uid
            for p in core.list_namespaced_pod(stack, label_selector=f"tfps.io/job-name={run.name}").items
        }
        run.replicas += 1  # the watcher's bound on live pods
        cluster.kubectl("scale", f"tj/{run.name}", "-n", stack, "--replicas=3")
        status = run.wait_finished()
    finally:
        run.stop_watching()
    result = run.result() if status.get("phase") == "Succeeded" else {}
    record_property(
        "reliability",
        {
            "kind": "fault",
            "fault": "workers scaled 2 -> 3 (kubectl scale)",
            "phase": status.get("phase"),
            "baseline": None,
            "accuracy": result.get("accuracy"),
            "steps": result.get("steps"),
            "checkpoint_interval": EVERY,
            "steps_redone": 0,
            "steps_lost": 0,
            "duplicates": len(run.watch.api_duplicates) + len(run.watch.process_duplicates) + len(run.watch.too_many),
        },
    )
    assert status.get("phase") == "Succeeded", status
    assert result["steps"] == steps and result["accuracy"] >= 0.9, result
    assert not run.watch.api_duplicates and not run.watch.too_many and not run.watch.process_duplicates, run.watch
    assert run.events("worker", 2, "joined"), ("worker 2 never joined", run.log("worker", 2)[-2000:])
    assert any(e["workers"] == 3 for e in run.events("worker", 0, "resplit")), "worker 0 kept cutting batches in 2"
    for name, uid in uids.items():  # nothing was restarted or recreated by the scale
        pods = core.list_namespaced_pod(stack, field_selector=f"metadata.name={name}").items
        for pod in pods:
            assert pod.metadata.uid == uid and pod.status.container_statuses[0].restart_count == 0, name
    run.delete()
