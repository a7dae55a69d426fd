"""Shared fixtures: the local cluster, its control plane and its real node (`cluster`), and a fresh
namespace per test (`namespace`).

The cluster comes from hack/cluster.sh (state in $TFPS_STATE, default <repo>/.tfps). A cluster that
is already up is reused; one that a test session started is stopped when the last session using it
ends (set TFPS_KEEP_CLUSTER=1 to keep it for the next run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import hack_module, pods_state, wait_for

REPO = Path(__file__).resolve().parent.parent
CLUSTER_SH = REPO / "hack" / "cluster.sh"


def _hack_cluster():
    return hack_module("cluster")


EXIT_MARK = "tfps-exec-exit="  # Cluster.exec_python: what precedes a snippet's exit status in its output


class CommandFailed(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


@dataclass
class Cluster:
    kubeconfig: Path
    env: dict  # os.environ + KUBECONFIG + PATH with the control-plane tools first
    api: object  # kubernetes.client.ApiClient
    state_dir: Path
    apiserver_url: str
    node_name: str = "tfps-local"

    @property
    def hack(self):
        """hack/cluster.py, with hack/node.py as its `node`."""
        return _hack_cluster()

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["kubectl", *args], env=self.env, input=input, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise CommandFailed(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc

    def exec_python(
        self, namespace: str, pod: str, code: str, check: bool = True, tries: int = 3, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """`kubectl exec` a Python snippet in the pod's first container. Its exit status is the one
        the pod prints after it, not kubectl's: kubectl ends 0 when the exec's stream is cut
        (kubernetes/kubectl#1726), which reads a failed probe as a success; such a run is made again."""
        for _ in range(tries):
            proc = self.kubectl(
                "exec",
                "-n",
                namespace,
                pod,
                "--",
                "sh",
                "-c",
                f'python3 -c "$1"; echo "{EXIT_MARK}$?"',
                "sh",
                code,
                check=False,
                timeout=timeout,
            )
            out, mark, status = proc.stdout.rpartition(EXIT_MARK)
            if mark and status.strip().isdigit():
                if check and int(status) != 0:
                    raise CommandFailed(int(status), proc.args, out, proc.stderr)
                return subprocess.CompletedProcess(proc.args, int(status), out, proc.stderr)
        raise AssertionError(
            f"kubectl exec in {namespace}/{pod} ended {tries} times without the snippet's exit status; "
            f"the last: exit {proc.returncode}, stdout {proc.stdout!r}, stderr {proc.stderr!r}"
        )

    def wait_pod(self, namespace: str, name: str, until, timeout: float = 90, what: str = "condition"):
        """Polls a pod (a kubernetes V1Pod) until `until(pod)` is true; fails with its last status."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.api)
        last = []

        def reached():
            try:
                pod = core.read_namespaced_pod(name, namespace)
            except ApiException as e:
                if e.status != 404:
                    raise
                pod = None
            last[:] = [pod]
            return pod if until(pod) else None

        try:
            return wait_for(f"pod {namespace}/{name}: {what}", reached, timeout=timeout, interval=0.25)
        except AssertionError:
            pod = last[0] if last else None
            raise AssertionError(
                f"pod {namespace}/{name}: no {what} within {timeout}s; last: "
                f"{pod.status if pod else 'absent'}\nlog:\n{self.pod_log(namespace, name)[-2000:]}"
                f"\nkubelet ({self.state_dir / 'logs' / 'kubelet.log'}):\n{self.kubelet_log_tail()}"
            ) from None

    def create_namespace(self, name: str) -> str:
        """A namespace for tests, once its default ServiceAccount exists (pods are refused before)."""
        from kubernetes import client

        core = client.CoreV1Api(self.api)
        core.create_namespace({"metadata": {"name": name, "labels": {"tfps.io/test": "true"}}})
        wait_for(
            f"namespace {name}'s default ServiceAccount",
            lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items,
            timeout=60,
        )
        return name

    def delete_namespace(self, name: str) -> None:
        """Deleted without waiting."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            client.CoreV1Api(self.api).delete_namespace(name)
        except ApiException as e:
            if e.status != 404:
                raise

    def container_pid(self, pod, container: str = "") -> int:
        """The host pid of a pod's container (its first one unless named), from containerd."""
        statuses = [cs for cs in pod.status.container_statuses or [] if not container or cs.name == container]
        assert statuses and statuses[0].container_id, f"{pod.metadata.name}: no container running"
        cid = statuses[0].container_id.split("://", 1)[1]
        out = self.hack.ctr("tasks", "ls").stdout
        for line in out.splitlines()[1:]:
            task, pid, *_ = line.split()
            if task == cid:
                return int(pid)
        raise AssertionError(f"containerd runs no task {cid} ({pod.metadata.name})")

    def kubelet_log_tail(self, lines: int = 8) -> str:
        path = self.state_dir / "logs" / "kubelet.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def pod_log(self, namespace: str, pod: str, container: str = "tensorflow") -> str:
        """A pod's container output as `kubectl logs` gives it: the previous run's first when the
        container was restarted; empty when the pod or its log is gone."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.api)
        out = []
        for previous in (True, False):
            try:
                out.append(core.read_namespaced_pod_log(pod, namespace, container=container, previous=previous))
            except ApiException as e:
                if e.status not in (400, 404):
                    raise
        return "".join(out)


@pytest.fixture(scope="session")
def cluster():
    hc = _hack_cluster()
    missing = hc.missing_binaries()
    if missing:
        pytest.skip(
            f"cluster parts missing ({', '.join(missing)}; binaries under {hc.bin_dir()}); run `make cluster-tools`"
        )
    state = hc.state_dir()
    session = os.getpid()
    proc = subprocess.run(
        [str(CLUSTER_SH), "up", "--json", f"--session={session}"], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(f"hack/cluster.sh up failed ({proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    import json

    info = json.loads(proc.stdout.strip().splitlines()[-1])
    from kubernetes import config

    kubeconfig = Path(info["kubeconfig"])
    env = dict(os.environ)
    env["KUBECONFIG"] = str(kubeconfig)
    env["PATH"] = f"{hc.bin_dir()}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield Cluster(kubeconfig=kubeconfig, env=env, api=api, state_dir=state, apiserver_url=info["apiserver_url"])
    finally:
        api.close()
        if os.environ.get("TFPS_KEEP_CLUSTER") != "1":
            subprocess.run([str(CLUSTER_SH), "release", f"--session={session}"], timeout=300, check=False)


def _namespace_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")
    base = re.sub(r"^test-", "", base)[:52].strip("-") or "t"
    return f"{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(cluster, request):
    """A fresh namespace named after the test, with its default ServiceAccount in place (pods are
    refused until the controller-manager creates it). Deleted afterwards without waiting."""
    name = cluster.create_namespace(_namespace_name(request.node.name))
    yield name
    cluster.delete_namespace(name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the cluster shows the node's state with its failure: whether it is
    Ready and tainted, which components are down, the kubelet's last lines, and for a test with
    a namespace where its pods are (bound, or why not) and what the scheduler said of them."""
    report = (yield).get_result()
    if report.failed and report.when in ("setup", "call") and "cluster" in item.fixturenames:
        report.sections.append(
            (
                "the cluster when the test failed",
                _cluster_state(item.funcargs.get("cluster"), item.funcargs.get("namespace")),
            )
        )


def _scheduler_lines(log: Path, namespace: str, n: int = 40) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    mine = [line.replace(f"{namespace}/", "") for line in text.splitlines() if namespace in line]
    return "\n".join(mine[-n:])


def _cluster_state(cluster: Cluster | None = None, namespace: str | None = None) -> str:
    hc = _hack_cluster()
    p = hc.Paths(hc.state_dir())
    try:
        down = [c for c in hc.COMPONENTS if hc.recorded_pid(p, c) is None]
        info = hc.load_info(p)
        lines = [f"components down: {', '.join(down) or 'none'}"]
        if info.get("apiserver_url"):
            lines.append(f"node {hc.NODE_NAME}: {hc.node_summary(p, info['apiserver_url'])}")
        lines += ["kubelet log:", hc.tail(p.logfile("kubelet"), 15)]
        if cluster and namespace:
            lines += pods_state(cluster.api, namespace)
            lines += [
                f"kube-scheduler log, lines naming {namespace}:",
                _scheduler_lines(p.logfile("kube-scheduler"), namespace),
            ]
        return "\n".join(lines)
    except Exception as err:  # a report of the state must not hide the test's own failure
        return f"could not read the cluster's state: {err!r}"


# --- the reliability report (hack/reliability.py): figures the fault and bad-input tests leave ---

_RELIABILITY = hack_module("reliability")
_reliability_records: list[dict] = []


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome == "failed"):
        _RELIABILITY.collect(_reliability_records, report.nodeid, report.outcome, report.user_properties)


def pytest_sessionfinish(session):
    if _reliability_records:
        _RELIABILITY.write(_reliability_records)


def pytest_terminal_summary(terminalreporter):
    lines = _RELIABILITY.summary(_reliability_records)
    if lines:
        terminalreporter.section("reliability")
        for line in lines:
            terminalreporter.write_line(line)
