"""Operator benchmark (not a test): 20 TrainingJobs of 2 PS + 8 workers on the local
control plane; time from create to all pods created and to phase Running (p50, p99),
and the operator process's CPU seconds and peak memory.

    python -m tfps.bench.operator [--jobs 20] [--workers 8] [--ps 2] [--spacing SECONDS] [--timeline]

Needs the control plane up, alone: `hack/cluster.sh up --no-node`. The pods are never run:
this process plays the kubelet and writes each new pod's status Running, with an IP, as soon
as it sees the pod (so "to Running" includes that write and the operator's reaction to it).
A node left up costs the benchmark: its NetworkPolicy agent (kube-router) reprograms the
firewall for each of those pods and each job's NetworkPolicy, on the same cores as the API
server, where a real cluster runs it on its nodes. The result lists the nodes that were
registered (`nodes`). Goal from the issue: p50 <= 1 s to all pods created. Also printed: the
time to each job's first pod, and the p50s over the raw-create anchor (the same number of
pods created directly, measured right after in the same run: machine load moves both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tfps.api.spec import API_GROUP as GROUP
from tfps.api.spec import API_VERSION as VERSION
from tfps.api.spec import PLURAL, manifest_for

from .procs import flag_args, module_cmd

REPO = Path(__file__).resolve().parent.parent
UNSCHEDULABLE = {"spec": {"nodeSelector": {"tfps.io/bench": "status-set-by-bench"}}}


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def _proc_usage(pid: int) -> tuple[float, int]:
    """CPU seconds (user+system) and peak RSS in bytes of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    peak = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
    return cpu, peak


def _job(name: str, ps: int, workers: int) -> dict:
    replicas = {
        "PS": {"replicas": ps, "template": UNSCHEDULABLE},
        "Worker": {"replicas": workers, "template": UNSCHEDULABLE},
    }
    return manifest_for(name, {"replicaSpecs": replicas, "training": {"steps": 10}})


def operator_argv(ns: str) -> list[str]:
    """`tfps operator` for namespace `ns` alone, out of the cluster, on ports of its own choice."""
    flags = {"-n": ns, "--metrics-port": 0, "--health-port": 0}
    log_level = os.environ.get("TFPS_BENCH_OPERATOR_LOG", "warning")
    return module_cmd("tfps.cli.main", "operator", "--standalone", *flag_args({**flags, "--log-level": log_level}))


def operator_env(kubeconfig: str) -> dict[str, str]:
    """The operator's environment: the benchmark's cluster, and its built-in configuration."""
    return {**os.environ, "KUBECONFIG": kubeconfig, "TFPS_OPERATOR_CONFIG": ""}


def _raw_create_seconds(core, count: int) -> float:
    """Seconds to create `count` pods directly (16 threads), in a namespace of their own."""
    ns = f"bench-raw-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    while True:
        try:
            core.read_namespaced_service_account("default", ns)
            break
        except Exception:  # noqa: BLE001 - not there yet
            time.sleep(0.2)
    pod = {"spec": {**UNSCHEDULABLE["spec"], "containers": [{"name": "tensorflow", "image": "tfps/worker:0.1.0"}]}}
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as ex:
        list(
            ex.map(
                lambda i: core.create_namespaced_pod(
                    ns, {**pod, "metadata": {"name": f"p-{i}"}}, _preload_content=False
                ),
                range(count),
            )
        )
    seconds = time.monotonic() - started
    core.delete_namespace(ns)
    return seconds


def _until(done, timeout: float, interval: float = 0.1) -> bool:
    """Poll `done()` until it is true or `timeout` seconds pass; whether it became true."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def _new_namespace(core, client) -> str:
    ns = f"bench-operator-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})

    def has_default_account() -> bool:  # pods are refused until the namespace's default ServiceAccount exists
        try:
            core.read_namespaced_service_account("default", ns)
            return True
        except client.ApiException:
            return False

    _until(has_default_account, timeout=60, interval=0.2)
    return ns


def _delete_jobs(custom, ns: str) -> None:
    for item in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, item["metadata"]["name"])
    _until(
        lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"], timeout=60, interval=0.2
    )


def _watch_forever(watch, stop: threading.Event, list_fn, *args, on_event) -> None:
    """A watch that survives its timeouts and the API server's hiccups until `stop`."""
    while not stop.is_set():
        try:
            # Plain dicts: building the client's typed models for every pod in this process would
            # delay when pods are seen and take CPU from the operator being measured.
            for ev in watch.Watch().stream(list_fn, *args, timeout_seconds=5, deserialize=False):
                on_event(ev)
                if stop.is_set():
                    return
        except Exception:  # noqa: BLE001 - re-watch; a re-list repeats ADDED, handled by the caller
            time.sleep(0.1)


def run_bench(
    kubeconfig: str,
    jobs: int,
    ps: int,
    workers: int,
    spacing: float = 0.0,
    timeout: float = 180.0,
    timeline: bool = False,
) -> dict:
    from kubernetes import client, config, watch

    from .training_operator import install_crd

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise SystemExit('kubectl is not on PATH: eval "$(hack/cluster.sh env)" first')
    install_crd(
        kubectl, kubeconfig, REPO / "crds" / "trainingjob.yaml", f"{PLURAL}.{GROUP}"
    )  # a fresh cluster has none
    api = config.new_client_from_config(config_file=kubeconfig)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ns = _new_namespace(core, client)
    nodes = sorted(n.metadata.name for n in core.list_node().items)

    # The operator writes to its own copy of the descriptor; the file stays (delete=False) for the report.
    with tempfile.NamedTemporaryFile("w", prefix="tfps-operator-bench-", suffix=".log", delete=False) as log:
        operator = subprocess.Popen(
            operator_argv(ns), env=operator_env(kubeconfig), stdout=log, stderr=subprocess.STDOUT
        )
    created_at: dict[str, float] = {}
    pods_seen: dict[str, list[float]] = {}
    first_seen: dict[str, float] = {}
    running_at: dict[str, float] = {}
    stop = threading.Event()
    # Status writes go out in parallel, so that seeing pods (the timing) never waits for them.
    patcher = ThreadPoolExecutor(max_workers=8)
    per_job = ps + workers

    def pod_seen(ev):
        """Records when each new pod is seen, and reports it Running, as a kubelet would."""
        pod = ev["object"]
        name = pod["metadata"]["name"]
        if ev["type"] != "ADDED" or name in first_seen:
            return
        first_seen[name] = now = time.monotonic()
        pods_seen.setdefault(pod["metadata"].get("labels", {}).get("tfps.io/job-name"), []).append(now)
        patcher.submit(report_running, pod)

    def report_running(pod):
        status = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "containerStatuses": [
                {
                    "name": "tensorflow",
                    "image": pod["spec"]["containers"][0]["image"],
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                }
            ],
        }
        with contextlib.suppress(client.ApiException):
            core.patch_namespaced_pod_status(pod["metadata"]["name"], ns, {"status": status}, _preload_content=False)

    def job_seen(ev):
        obj = ev["object"]
        name = obj["metadata"]["name"]
        if (obj.get("status") or {}).get("phase") == "Running" and name not in running_at:
            running_at[name] = time.monotonic()

    kubelet = lambda: _watch_forever(watch, stop, core.list_namespaced_pod, ns, on_event=pod_seen)  # noqa: E731
    job_watcher = lambda: _watch_forever(  # noqa: E731
        watch,
        stop,
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        ns,
        PLURAL,
        on_event=job_seen,
    )
    threads = [threading.Thread(target=kubelet, daemon=True), threading.Thread(target=job_watcher, daemon=True)]
    for t in threads:
        t.start()
    try:
        # Wait until the operator serves (its first reconcile of a probe job), so the start-up is not timed.
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _job("warmup", 1, 1))
        _until(lambda: "warmup" in running_at, timeout=60)
        cpu0, _ = _proc_usage(operator.pid)
        for i in range(jobs):
            name = f"job-{i:02d}"
            created_at[name] = time.monotonic()
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _job(name, ps, workers))
            time.sleep(spacing)
        _until(lambda: all(n in running_at for n in created_at), timeout=timeout)
        cpu1, peak = _proc_usage(operator.pid)
    finally:
        stop.set()
        _delete_jobs(custom, ns)
        operator.terminate()
        operator.wait(20)
        core.delete_namespace(ns)

    raw = _raw_create_seconds(core, jobs * per_job)
    to_pods = [max(pods_seen[n]) - t for n, t in created_at.items() if len(pods_seen.get(n, [])) >= per_job]
    to_first = [min(pods_seen[n]) - t for n, t in created_at.items() if pods_seen.get(n)]
    to_running = [running_at[n] - t for n, t in created_at.items() if n in running_at]

    def quantiles(values: list[float]) -> dict | None:
        return (
            {"p50": round(_percentile(values, 0.5), 3), "p99": round(_percentile(values, 0.99), 3)} if values else None
        )

    ratio = lambda values: round(_percentile(values, 0.5) / raw, 2) if values and raw > 0 else None  # noqa: E731
    result = {
        "jobs": jobs,
        "pods_per_job": per_job,
        "spacing_s": spacing,
        "nodes": nodes,
        "jobs_all_pods_created": len(to_pods),
        "jobs_running": len(to_running),
        "to_first_pod_created_s": quantiles(to_first),
        "to_all_pods_created_s": quantiles(to_pods),
        "to_running_s": quantiles(to_running),
        "operator_cpu_seconds": round(cpu1 - cpu0, 2),
        "operator_peak_rss_mib": round(peak / 2**20, 1),
        "goal_p50_to_all_pods_created_s": 1.0,
        # Anchor, measured right after: the same number of pods created straight through the
        # API with 16 threads and no operator (the floor this API server sets on this machine).
        "anchor_raw_create_all_pods_s": round(raw, 3),
        # p50 over the anchor: 1.0 would be an operator as fast per job as the whole burst
        # of raw creates (the anchor is on an idle API server, so it moves with machine load).
        "ratio_p50_all_pods_created_to_anchor": ratio(to_pods),
        "ratio_p50_running_to_anchor": ratio(to_running),
        "operator_log": log.name,
    }
    if timeline:  # per job, seconds from the first job's creation: created, first pod, last pod, Running
        t0 = min(created_at.values())
        result["timeline"] = {
            n: [
                round(v - t0, 3) if v is not None else None
                for v in (t, min(pods_seen.get(n) or [None]), max(pods_seen.get(n) or [None]), running_at.get(n))
            ]
            for n, t in created_at.items()
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfps.bench.operator", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--spacing", type=float, default=0.0, help="seconds between job creations (0: all at once)")
    parser.add_argument(
        "--timeline", action="store_true", help="also print each job's created / first pod / last pod / Running times"
    )
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG") or str(REPO / ".tfps" / "kubeconfig"))
    args = parser.parse_args(argv)
    result = run_bench(args.kubeconfig, args.jobs, args.ps, args.workers, args.spacing, timeline=args.timeline)
    print(json.dumps(result, indent=2))
    if result["nodes"]:
        print(
            f"note: measured with node(s) {', '.join(result['nodes'])} up; their agents share the cores "
            "(hack/cluster.sh up --no-node runs the control plane alone)",
            file=sys.stderr,
        )
    return 0 if result["jobs_running"] == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
