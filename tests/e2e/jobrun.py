"""Helpers of the end-to-end tests: the chart installed by helm, and a TrainingJob run on the real
stack, watched for duplicate pods (in the API, and as container processes on this machine) while
faults are injected."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

from tfps.api.spec import API_GROUP, API_VERSION, PLURAL, manifest_for

LABEL_JOB, LABEL_TYPE, LABEL_INDEX = "tfps.io/job-name", "tfps.io/replica-type", "tfps.io/replica-index"
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tfps"
LOCAL_VALUES = REPO / "hack" / "values-local.yaml"  # requests that fit the one-node local cluster


def helm(cluster, *args: str, check: bool = True, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["helm", *args], env=cluster.env, capture_output=True, text=True, timeout=timeout, check=check
    )


@contextlib.contextmanager
def install_chart(cluster, namespace: str, *set_values: str):
    """`helm install` of charts/tfps into `namespace` (its operator watching only that namespace),
    waited for; uninstalled on exit. Yields the release name."""
    name = f"tfps-{uuid.uuid4().hex[:6]}"
    sets = [a for v in (f"operator.watchNamespaces={{{namespace}}}", *set_values) for a in ("--set", v)]
    out = helm(
        cluster,
        "install",
        name,
        str(CHART),
        "--namespace",
        namespace,
        "-f",
        str(LOCAL_VALUES),
        *sets,
        "--wait",
        "--timeout",
        "5m",
        check=False,
    )
    assert out.returncode == 0, out.stderr
    try:
        yield name
    finally:
        helm(cluster, "uninstall", name, "--namespace", namespace, "--wait", "--timeout", "2m", check=False)


CHECKPOINT_MOUNT = "/var/tmp/tfps-checkpoints"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def manifest(name: str, checkpoint_dir: Path, *, steps: int, every: int, ps_env: dict | None = None) -> dict:
    """digits-mlp, 2 PS + 2 workers, sync; the PS pods keep their checkpoints on a hostPath
    volume, so a recreated PS pod finds them (as it would on a persistent volume). cleanPodPolicy
    None: the PS pods (still running when the job succeeds) outlive the job until it is deleted,
    so the test reads each PS's whole log, written to the end (under the default policy they go,
    their logs with them, as the job succeeds: a restore logged by a PS pod that lived a few
    seconds could be missed by the watcher's log reads)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir.chmod(0o1777)  # the containers run as uid 10001; a hostPath keeps the host's modes
    ps_container = {"name": "tensorflow", "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}]}
    if ps_env:
        ps_container["env"] = [{"name": k, "value": v} for k, v in ps_env.items()]
    ps_template = {
        "spec": {
            "volumes": [
                {"name": "checkpoints", "hostPath": {"path": str(checkpoint_dir), "type": "DirectoryOrCreate"}}
            ],
            "containers": [ps_container],
        }
    }
    return manifest_for(
        name,
        {
            "replicaSpecs": {
                "PS": {"replicas": 2, "restartPolicy": "OnFailure", "template": ps_template},
                "Worker": {"replicas": 2, "restartPolicy": "OnFailure"},
            },
            "training": {
                "model": "digits-mlp",
                "modelArgs": {"hidden": [64]},
                "seed": 0,
                "optimizer": {"name": "adam", "learningRate": 0.003},
                "batchSize": 32,
                "steps": steps,
                "consistency": {"mode": "sync"},
                "checkpoint": {"path": CHECKPOINT_MOUNT, "everySteps": every},
            },
            "runPolicy": {"backoffLimit": 4, "activeDeadlineSeconds": 900, "cleanPodPolicy": "None"},
        },
    )


def job_processes(namespace: str, job: str) -> dict[tuple[str, int], list[int]]:
    """The Python processes of a job's containers on this machine, by (task type, index), read
    from the host's /proc (their environment carries the job, namespace and TF_CONFIG the operator
    set)."""
    out: dict[tuple[str, int], list[int]] = {}
    want = (f"TFPS_JOB_NAME={job}".encode(), f"TFPS_NAMESPACE={namespace}".encode())
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            if b"python" not in cmd.split(b"\0", 1)[0]:
                continue
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z" or not all(w in env for w in want):
            continue
        tf = next((e[len(b"TF_CONFIG=") :] for e in env if e.startswith(b"TF_CONFIG=")), None)
        if tf is None:
            continue
        task = json.loads(tf)["task"]
        out.setdefault((task["type"], int(task["index"])), []).append(int(d))
    return out


def container_of(pid: int) -> str | None:
    """The container a process runs in: the last part of its cgroup path (kubepods/.../<id>)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths = [line.split(":", 2)[2] for line in lines if "kubepods" in line]
    return paths[0].rstrip("/").rsplit("/", 1)[-1] if paths else None


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Watch:
    """What the duplicate watcher saw during a run."""

    api_duplicates: list[str] = field(default_factory=list)
    process_duplicates: list[str] = field(default_factory=list)
    too_many: list[str] = field(default_factory=list)
    polls: int = 0
    # (replica type, index) -> the highest container restart count seen on its pod: cleanPodPolicy
    # may delete a finished job's PS pods before the test reads them.
    restarts: dict[tuple[str, int], int] = field(default_factory=dict)


class JobRun:
    """One TrainingJob on the cluster, watched from creation to its end."""

    def __init__(self, cluster, namespace: str, body: dict):
        self.cluster, self.namespace, self.body = cluster, namespace, body
        self.name = body["metadata"]["name"]
        self.replicas = sum(r["replicas"] for r in body["spec"]["replicaSpecs"].values())
        self.core = client.CoreV1Api(cluster.api)
        self.custom = client.CustomObjectsApi(cluster.api)
        self.watch = Watch()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch_loop, name=f"watch-{self.name}", daemon=True)
        # What the watcher read of each container run, as a log shipper would keep it: a pod's log
        # goes with the pod (cleanPodPolicy, kubectl delete), and the test still reads it.
        # (pod name, pod uid, restart count) -> output
        self._logs: dict[tuple[str, str, int], str] = {}
        self._logs_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> JobRun:
        self.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, self.body)
        self._thread.start()
        return self

    def stop_watching(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            self._check_api()
            self._check_processes()
            self.watch.polls += 1
            self._stop.wait(0.3)

    def _check_api(self) -> None:
        try:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{LABEL_JOB}={self.name}", _request_timeout=5
            ).items
        except Exception:  # the apiserver may be down on purpose
            return
        if self.watch.polls % 3 == 0:
            self._ship_logs(pods)
        for pod in pods:
            cs = next((c for c in pod.status.container_statuses or [] if c.name == "tensorflow"), None)
            if cs is not None:
                key = (pod.metadata.labels.get(LABEL_TYPE), int(pod.metadata.labels.get(LABEL_INDEX)))
                self.watch.restarts[key] = max(self.watch.restarts.get(key, 0), cs.restart_count)
        live = [p for p in pods if p.status.phase not in ("Succeeded", "Failed")]
        keys = Counter((p.metadata.labels.get(LABEL_TYPE), p.metadata.labels.get(LABEL_INDEX)) for p in live)
        for key, n in keys.items():
            if n > 1:
                self.watch.api_duplicates.append(f"{key}: {[p.metadata.name for p in live]}")
        if len(live) > self.replicas:
            self.watch.too_many.append(f"{len(live)} pods: {[p.metadata.name for p in live]}")

    def _check_processes(self) -> None:
        """Two containers alive at once for one replica is a duplicate; a replica's process and a
        child it forked (same container) are not."""
        procs = job_processes(self.namespace, self.name)
        for key, pids in procs.items():
            if len(pids) > 1:
                containers: dict[str | None, list[int]] = {}
                for pid in pids:
                    if Path(f"/proc/{pid}").exists():  # one that exited since the scan is not a duplicate
                        containers.setdefault(container_of(pid), []).append(pid)
                if len(containers) > 1:
                    self.watch.process_duplicates.append(f"{key}: containers {containers}")

    # -- reading the run ---------------------------------------------------------------------
    def job(self) -> dict:
        return self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, self.name)

    def pod(self, rtype: str, index: int):
        return self.core.read_namespaced_pod(f"{self.name}-{rtype}-{index}", self.namespace)

    def metric(self, rtype: str, index: int, name: str, timeout: float = 3) -> float | None:
        """A metric the pod serves on its IP (port 9090), or None when it does not answer, or
        stops answering mid-reply (a pod being deleted: http.client.IncompleteRead)."""
        try:
            ip = self.pod(rtype, index).status.pod_ip
            if not ip:
                return None
            with _NO_PROXY.open(f"http://{ip}:9090/metrics", timeout=timeout) as resp:
                text = resp.read().decode()
        except (OSError, http.client.HTTPException, ApiException):
            return None
        m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def wait_step(self, step: int, timeout: float = 300) -> int:
        """Wait until PS 0 has applied `step` updates; returns the step it reports."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.metric("ps", 0, "tfps_ps_global_step")
            if got is not None and got >= step:
                return int(got)
            time.sleep(0.3)
        raise AssertionError(
            f"{self.name}: PS 0 did not reach step {step} in {timeout}s; job status: "
            f"{json.dumps(self.job().get('status'), indent=1)}"
        )

    def wait_finished(self, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        status: dict = {}
        while time.monotonic() < deadline:
            try:
                status = self.job().get("status") or {}
            except Exception:  # apiserver restarting
                status = status
            if status.get("phase") in ("Succeeded", "Failed"):
                return status
            time.sleep(1)
        raise AssertionError(f"{self.name}: not finished in {timeout}s: {json.dumps(status, indent=1)}")

    def result(self) -> dict:
        """Worker 0's final result (steps, loss, accuracy): its termination message, which the
        kubelet puts in the container's terminated state."""
        pod = self.pod("worker", 0)
        for cs in pod.status.container_statuses or []:
            term = cs.state.terminated if cs.state else None
            if cs.name == "tensorflow" and term and term.message:
                return json.loads(term.message)
        raise AssertionError(f"worker 0 left no termination message: {pod.status}")

    def _ship_logs(self, pods) -> None:
        for pod in pods:
            cs = next((c for c in pod.status.container_statuses or [] if c.name == "tensorflow"), None)
            if cs is None:
                continue
            name, uid, runs = pod.metadata.name, pod.metadata.uid, cs.restart_count
            reads = [(runs, False)]
            if runs and (name, uid, runs) not in self._logs:  # a restart since the last read: finish the old run's
                reads.append((runs - 1, True))
            for run, previous in reads:
                try:
                    text = self.core.read_namespaced_pod_log(
                        name, self.namespace, container="tensorflow", previous=previous, _request_timeout=5
                    )
                except Exception:  # not started yet, gone, or the apiserver down on purpose
                    continue
                with self._logs_lock:
                    if len(text) >= len(self._logs.get((name, uid, run), "")):
                        self._logs[(name, uid, run)] = text

    def log(self, rtype: str, index: int) -> str:
        """Every run of the replica's container, earlier pods of the same name included, oldest first."""
        name = f"{self.name}-{rtype}-{index}"
        with contextlib.suppress(ApiException):
            self._ship_logs([self.pod(rtype, index)])
        with self._logs_lock:
            return "".join(text for (pod, _, _), text in self._logs.items() if pod == name)

    def events(self, rtype: str, index: int, event: str) -> list[dict]:
        out = []
        for line in self.log(rtype, index).splitlines():
            if f'"event": "{event}"' in line:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def kill(self, rtype: str, index: int, sig: int = signal.SIGKILL) -> int:
        """Signal the pod's process from the host (a container's processes are the host's too)."""
        pids = job_processes(self.namespace, self.name).get((rtype, index)) or []
        main = [p for p in pids if parent_of(p) not in pids]  # not a child the replica forked
        assert len(main) == 1, f"{rtype}-{index}: processes {pids}"
        os.kill(main[0], sig)
        return main[0]

    def delete(self) -> None:
        try:
            self.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, self.namespace, PLURAL, self.name)
        except ApiException as err:
            if err.status != 404:
                raise
