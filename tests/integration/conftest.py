"""Fixtures for the operator's integration tests: the CRDs installed, and `tfps operator`
running as a real process (killable, restartable) against the local control plane."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import hack_module, scrape, wait_for

from tfps.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]
CRDS = [REPO / "crds" / "trainingjob.yaml", REPO / "crds" / "kopf-peering.yaml"]
GROUP, VERSION, PLURAL = "tfps.io", "v1alpha1", "trainingjobs"
# Requests that fit the one-node local cluster (the chart's values for it), for pods that do run.
LOCAL_RESOURCES = yaml.safe_load((REPO / "hack" / "values-local.yaml").read_text())["runtime"]["resources"]
# Pods the node must not run: tests set their status through the API instead.
UNSCHEDULABLE = {"spec": {"nodeSelector": {"tfps.io/test": "status-set-by-test"}}}


def job_manifest(
    name: str,
    ps: int = 2,
    workers: int = 4,
    *,
    policy: str = "OnFailure",
    template=UNSCHEDULABLE,
    training: dict | None = None,
    run_policy: dict | None = None,
    chief: int = 0,
    **spec,
) -> dict:
    replicas = {
        "PS": {"replicas": ps, "template": template},
        "Worker": {"replicas": workers, "restartPolicy": policy, "template": template},
    }
    if chief:
        replicas["Chief"] = {"replicas": chief, "restartPolicy": policy, "template": template}
    if not ps:
        del replicas["PS"]
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {"replicaSpecs": replicas, **spec},
    }
    body["spec"]["training"] = training if training is not None else {"steps": 10}
    if run_policy:
        body["spec"]["runPolicy"] = run_policy
    return body


@pytest.fixture(scope="session")
def crds(cluster):
    cluster.kubectl("apply", "--server-side", "--force-conflicts", *[a for p in CRDS for a in ("-f", str(p))])
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/trainingjobs.tfps.io")
    return cluster


class OperatorHarness:
    """`tfps operator` serving one namespace, plus the API calls the tests make."""

    def __init__(self, cluster, namespace: str, log_dir: Path):
        self.cluster, self.namespace = cluster, namespace
        self.core = client.CoreV1Api(cluster.api)
        self.custom = client.CustomObjectsApi(cluster.api)
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.metrics_port = self.health_port = 0

    # --- the operator process -------------------------------------------------------
    def start(self, *extra: str, config: dict | None = None) -> subprocess.Popen:
        """Start `tfps operator`; `config` is written as its configuration file."""
        self.metrics_port, self.health_port = free_port(), free_port()
        config = {"resources": LOCAL_RESOURCES, **(config or {})}
        config_path = str(self.log_dir / f"config-{len(self.procs)}.yaml")
        Path(config_path).write_text(yaml.safe_dump(config))
        with open(self.log_dir / f"operator-{len(self.procs)}.log", "w") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tfps.cli.main",
                    "operator",
                    "--namespace",
                    self.namespace,
                    "--metrics-address",
                    "127.0.0.1",
                    "--metrics-port",
                    str(self.metrics_port),
                    "--health-port",
                    str(self.health_port),
                    *extra,
                ],
                env={**self.cluster.env, "TFPS_OPERATOR_CONFIG": config_path},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen | None = None) -> None:
        proc = proc or self.procs[-1]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.log_dir.glob("operator-*.log")))

    def metrics(self) -> str:
        return scrape(self.metrics_port)

    # --- TrainingJobs -----------------------------------------------------------------
    def create(self, body: dict) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def job(self, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def status(self, name: str) -> dict:
        return (self.job(name) or {}).get("status") or {}

    def patch_spec(self, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec})

    def wait_phase(self, name: str, phase: str, timeout: float = 30) -> dict:
        return wait_for(f"{name} phase {phase}", lambda: (s := self.status(name)).get("phase") == phase and s, timeout)

    def condition(self, name: str, ctype: str) -> dict | None:
        return next((c for c in self.status(name).get("conditions") or [] if c["type"] == ctype), None)

    def events(self, name: str) -> list[tuple[str, str]]:
        evs = self.core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={name}").items
        return [(e.reason, e.message) for e in evs if e.involved_object.kind == "TrainingJob"]

    # --- pods ---------------------------------------------------------------------------
    def pods(self, job: str | None = None) -> dict[str, Any]:
        selector = f"tfps.io/job-name={job}" if job else "tfps.io/job-name"
        items = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return {p.metadata.name: p for p in items if not p.metadata.deletion_timestamp}

    def wait_pods(self, job: str, names: set[str], timeout: float = 30) -> dict[str, Any]:
        return wait_for(f"pods {sorted(names)}", lambda: (p := self.pods(job)) and set(p) == names and p, timeout)

    def set_pod(self, name: str, phase: str, exit_code: int | None = None, restarts: int = 0) -> None:
        """Write a pod's status the way a kubelet would (the pod is never run: see UNSCHEDULABLE)."""
        if exit_code is not None:
            state = {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": "2026-01-01T00:00:00Z",
                    "finishedAt": "2026-01-01T00:00:01Z",
                }
            }
        else:
            state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        pod = self.core.read_namespaced_pod(name, self.namespace)
        status = {
            "phase": phase,
            "podIP": "127.0.0.1" if phase == "Running" else None,
            "containerStatuses": [
                {
                    "name": "tensorflow",
                    "image": pod.spec.containers[0].image,
                    "imageID": "",
                    "ready": phase == "Running",
                    "restartCount": restarts,
                    "state": state,
                }
            ],
        }
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status})

    def set_all(self, job: str, phase: str = "Running") -> None:
        for name in self.pods(job):
            self.set_pod(name, phase)

    def cleanup(self) -> None:
        """Delete the jobs while an operator still runs (its finalizer), then stop it."""
        if not any(p.poll() is None for p in self.procs):
            self.start()
        try:
            for item in self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"]:
                try:
                    self.custom.delete_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, PLURAL, item["metadata"]["name"]
                    )
                except ApiException as err:
                    if err.status != 404:
                        raise
            wait_for(
                "jobs deleted",
                lambda: not self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"],
                timeout=30,
            )
        finally:
            self.stop_all()


@pytest.fixture
def tfps_operator(crds, namespace, tmp_path, request):
    """A harness with `tfps operator --namespace <ns>` started; `.start()` again after `.kill()`."""
    harness = OperatorHarness(crds, namespace, tmp_path)
    harness.start()
    yield harness
    harness.cleanup()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        print(harness.logs()[-6000:])


@pytest.fixture
def kwok_nodes(cluster, tmp_path):
    """Starts kwok (hack/kwok.py) with the given fake nodes, for the rest of the test:
    `kwok_nodes([kwok.node_manifest(...), ...])`. Stopped afterwards, its nodes deleted with their pods."""
    kwok = hack_module("kwok")
    with contextlib.ExitStack() as stack:

        def start(nodes: list[dict]):
            stack.enter_context(kwok.running(cluster.kubeconfig, nodes, tmp_path / "kwok.log"))
            return kwok

        yield start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def tf_config(pod) -> dict:
    (c,) = [c for c in pod.spec.containers if c.name == "tensorflow"]
    return json.loads(next(e.value for e in c.env if e.name == "TF_CONFIG"))


def dump(obj) -> str:
    return yaml.safe_dump(obj)
