"""Operator scale benchmark (not a test): N jobs of 2 PS + 8 workers (300 by default: 3,000
pods) on kwok's fake nodes, for the tfps operator and, side by side in the same run, Kubeflow's
training-operator v1.8.1 running TFJobs of the same shape (stock, and a build with its client
limits raised), on the same control plane, the same nodes, with the same pod templates.

    python -m tfps.bench.operator_scale [--jobs 300] [--runs 3] [--sides tfps,stock,raised]
        [--succeed-after 30s] [--json FILE]

Needs the control plane up, alone (hack/cluster.sh up --no-node: kwok plays the nodes, and a
real node's NetworkPolicy agent would work for every pod on the API server's cores; see
bench/operator.py), kwok built (hack/build-cluster.sh) and the anchor built
(hack/build-training-operator.sh). The benchmark applies both CRDs. The real scheduler binds
the pods to the benchmark's own kwok nodes (operator_kwok.py; 30 × 128 CPU, 512Gi, 96 GPUs);
kwok plays the kubelet: pods run at once and workers end Succeeded after --succeed-after;
each operator then marks its job Succeeded and deletes the PS pods (clean pod policy Running).
Runs alternate sides (tfps, stock, raised, tfps, ...), each in a fresh namespace, with the
operator started for it.

Per run: create → all pods created, → job Running (as the operator reports it), → all pods
Running, → job Succeeded (p50, p99); first create → all jobs Succeeded and → all PS pods gone;
the operator process's CPU seconds and peak RSS; its API requests per job, counted by the API
server itself (operator_apiserver.py); all clients' writes per job in the same window. Then
the medians over runs and the goals: p99 to all pods created ≤ 0.5× the stock
training-operator's and ≤ 1.0× the raised one's, operator CPU ≤ 1.0×, peak RSS ≤ 300 MiB.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfps.api.spec import API_GROUP, API_VERSION, PLURAL, manifest_for

from . import operator_apiserver as apiserver
from . import operator_kwok
from . import operator_report as report
from . import training_operator as anchor
from .operator import _proc_usage, _until, operator_argv, operator_env
from .procs import free_port

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("tfps.bench.operator_scale")
TFPS = (API_GROUP, API_VERSION, PLURAL)
JOB_PREFIX = "job-"


def load_kwok():
    """hack/kwok.py (beside hack/cluster.py, not a package)."""
    sys.path.insert(0, str(REPO / "hack"))
    spec = importlib.util.spec_from_file_location("tfps_hack_kwok", REPO / "hack" / "kwok.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def templates(placement: dict, succeed_annotation: str | None, succeed_after: str | None) -> dict[str, dict]:
    """The pod templates both operators get, by replica type: the tfps operator's default
    requests written out, one GPU per worker, kwok placement; workers end after `succeed_after`."""

    def template(image: str, requests: dict, limits: dict, annotations: dict) -> dict:
        container = {
            "name": "tensorflow",
            "image": image,
            "resources": {"requests": requests, **({"limits": limits} if limits else {})},
        }
        return {
            "metadata": {"annotations": annotations} if annotations else {},
            "spec": {**copy.deepcopy(placement), "containers": [container]},
        }

    gpu = {"nvidia.com/gpu": "1"}
    worker_annotations = {succeed_annotation: succeed_after} if succeed_after else {}
    return {
        "PS": template("tfps/ps:0.1.0", {"cpu": "500m", "memory": "1Gi"}, {}, {}),
        "Worker": template("tfps/worker:0.1.0", {"cpu": "1", "memory": "2Gi", **gpu}, gpu, worker_annotations),
    }


def tfps_job(name: str, ps: int, workers: int, templates_: dict[str, dict]) -> dict[str, Any]:
    specs = anchor.replica_specs(ps, workers, templates_)
    return manifest_for(
        name, {"replicaSpecs": specs, "training": {"steps": 10}, "runPolicy": {"cleanPodPolicy": "Running"}}
    )


@dataclass(frozen=True)
class Side:
    """One operator under test: its job kind, how to build a job, read its phase, start it."""

    key: str
    gvp: tuple[str, str, str]
    job: Callable[[str, int, int, dict], dict]
    phase: Callable[[dict], str | None]
    argv: Callable[[str], list[str]]
    env: Callable[[str, str], dict[str, str]]
    prepare: Callable[[Any, str], None] = lambda core, ns: None


def sides() -> dict[str, Side]:
    tfps_env = lambda ns, kc: operator_env(kc)  # noqa: E731
    tfps_phase = lambda obj: (obj.get("status") or {}).get("phase")  # noqa: E731
    to_gvp = (anchor.GROUP, anchor.API_VERSION, anchor.PLURAL)
    to_phase = lambda obj: anchor.phase(obj.get("status"))  # noqa: E731
    anchors = {
        key: Side(
            key,
            to_gvp,
            anchor.tfjob,
            to_phase,
            lambda ns, raised=(key == "raised"): anchor.argv(ns, raised, free_port()),
            anchor.env,
            anchor.prepare_namespace,
        )
        for key in ("stock", "raised")
    }
    return {"tfps": Side("tfps", TFPS, tfps_job, tfps_phase, operator_argv, tfps_env), **anchors}


@dataclass
class Recorder:
    """Per-job timestamps (time.monotonic) from the pod and job watches."""

    pods_per_job: int
    ps_per_job: int
    phase: Callable[[dict], str | None]
    created: dict[str, float] = field(default_factory=dict)
    all_pods_created: dict[str, float] = field(default_factory=dict)
    pods_running: dict[str, float] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)
    succeeded: dict[str, float] = field(default_factory=dict)
    cleaned: dict[str, float] = field(default_factory=dict)
    _seen: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    _ran: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    _gone: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    pods_gone: int = 0

    @staticmethod
    def _mark(stamps: dict, group: set, member: str, job: str, needed: int, now: float) -> None:
        if member not in group:
            group.add(member)
            if len(group) >= needed and job not in stamps:
                stamps[job] = now

    def pod(self, kind: str, obj: dict) -> None:
        now = time.monotonic()
        meta = obj["metadata"]
        owners = [o["name"] for o in meta.get("ownerReferences") or [] if o.get("controller")]
        if not owners:
            return
        job, name = owners[0], meta["name"]
        self._mark(self.all_pods_created, self._seen[job], name, job, self.pods_per_job, now)
        if (obj.get("status") or {}).get("phase") in ("Running", "Succeeded"):
            self._mark(self.pods_running, self._ran[job], name, job, self.pods_per_job, now)
        if kind == "DELETED":
            self.pods_gone += 1
            if "-ps-" in name:
                self._mark(self.cleaned, self._gone[job], name, job, self.ps_per_job, now)

    def job(self, kind: str, obj: dict) -> None:
        now, name = time.monotonic(), obj["metadata"]["name"]
        phase = self.phase(obj)
        if phase in ("Running", "Succeeded") and name not in self.running:
            self.running[name] = now
        if phase == "Succeeded" and name not in self.succeeded:
            self.succeeded[name] = now

    def done(self) -> bool:
        timed = [n for n in self.created if n.startswith(JOB_PREFIX)]
        return bool(timed) and all(n in self.succeeded and n in self.cleaned for n in timed)


def watch(api, path: str, on_event: Callable[[str, dict], None], stop: threading.Event) -> None:
    """List then watch `path`, raw JSON (cheap at thousands of pods), until `stop`; a watch
    that expires re-lists (its objects come again as ADDED: the recorder takes them once)."""
    from kubernetes.watch.watch import iter_resp_lines

    call = lambda query: apiserver.raw_get(api, path, query)  # noqa: E731
    rv = ""
    while not stop.is_set():
        try:
            if not rv:
                listed = json.loads(call([]).data)
                rv = listed["metadata"]["resourceVersion"]
                for item in listed["items"]:
                    on_event("ADDED", item)
            for line in iter_resp_lines(
                call(
                    [
                        ("watch", "true"),
                        ("resourceVersion", rv),
                        ("allowWatchBookmarks", "true"),
                        ("timeoutSeconds", "30"),
                    ]
                )
            ):
                ev = json.loads(line)
                if ev["type"] == "ERROR":
                    rv = ""
                    break
                rv = ev["object"]["metadata"]["resourceVersion"]
                if ev["type"] != "BOOKMARK":
                    on_event(ev["type"], ev["object"])
                if stop.is_set():
                    return
        except Exception as err:  # noqa: BLE001 - the API server's hiccup: watch again
            log.debug("watch %s: %s", path, err)
            time.sleep(0.2)


@dataclass
class Context:
    api: Any
    kubeconfig: str
    identity_ns: str
    operator_kubeconfig: str
    jobs: int
    ps: int
    workers: int
    succeed_after: str
    timeout: float
    kwok: Any
    log_dir: Path


def _new_namespace(core, prefix: str) -> str:
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    _until(
        lambda: bool(core.list_namespaced_service_account(ns, field_selector="metadata.name=default").items), 60, 0.2
    )
    return ns


def _delete_namespace(core, custom, side: Side, ns: str, operator: subprocess.Popen, timeout: float) -> None:
    """Jobs first, while the operator runs (it holds finalizers), then the operator, then the namespace."""
    group, version, plural = side.gvp
    try:
        custom.delete_collection_namespaced_custom_object(group, version, ns, plural)
        _until(lambda: not custom.list_namespaced_custom_object(group, version, ns, plural)["items"], timeout, 0.5)
    finally:
        operator.terminate()
        try:
            operator.wait(20)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        core.delete_namespace(ns)
    gone = _until(lambda: not core.list_namespace(field_selector=f"metadata.name={ns}").items, timeout, 1.0)
    if not gone:
        log.warning("namespace %s still terminating after %.0f s", ns, timeout)


def _create_jobs(custom, side: Side, ns: str, rec: Recorder, names: list[str], ctx: Context, tpl: dict) -> None:
    """Creates the jobs from 8 threads (a client creating many jobs at once), stamping each."""
    group, version, plural = side.gvp

    def create(name: str) -> None:
        body = side.job(name, ctx.ps, ctx.workers, tpl)
        rec.created[name] = time.monotonic()
        custom.create_namespaced_custom_object(group, version, ns, plural, body, _preload_content=False)

    with ThreadPoolExecutor(max_workers=8) as ex:
        list(ex.map(create, names))


def run_once(ctx: Context, side: Side, index: int) -> dict[str, Any]:
    from kubernetes import client

    core, custom = client.CoreV1Api(ctx.api), client.CustomObjectsApi(ctx.api)
    ns = _new_namespace(core, f"bench-scale-{side.key}")
    side.prepare(core, ns)
    rec = Recorder(ctx.ps + ctx.workers, ctx.ps, side.phase)
    stop = threading.Event()
    group, version, plural = side.gvp
    threads = [
        threading.Thread(target=watch, args=(ctx.api, f"/api/v1/namespaces/{ns}/pods", rec.pod, stop), daemon=True),
        threading.Thread(
            target=watch,
            args=(ctx.api, f"/apis/{group}/{version}/namespaces/{ns}/{plural}", rec.job, stop),
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    log_path = ctx.log_dir / f"{side.key}-{index}.log"
    with open(log_path, "w") as out:
        operator = subprocess.Popen(
            side.argv(ns), env=side.env(ns, ctx.operator_kubeconfig), stdout=out, stderr=subprocess.STDOUT
        )
    result: dict[str, Any] = {"side": side.key, "run": index, "namespace": ns, "operator_log": str(log_path)}
    try:
        result.update(_measure(ctx, side, ns, rec, operator, custom))
    finally:
        stop.set()
        _delete_namespace(core, custom, side, ns, operator, timeout=300)
    return result


def _measure(ctx: Context, side: Side, ns: str, rec: Recorder, operator: subprocess.Popen, custom) -> dict[str, Any]:
    group, version, plural = side.gvp
    # Wait until the operator serves (a warm-up job that never ends reaches Running), so
    # that its start-up is not timed.
    warm = templates(operator_kwok.placement(ctx.kwok), None, None)
    custom.create_namespaced_custom_object(group, version, ns, plural, side.job("warmup", 1, 1, warm))
    if (
        not _until(lambda: "warmup" in rec.running or operator.poll() is not None, 120, 0.1)
        or operator.poll() is not None
    ):
        raise RuntimeError(f"{side.key}: the operator did not serve (log: {ns})")
    tpl = templates(operator_kwok.placement(ctx.kwok), ctx.kwok.SUCCEED_AFTER, ctx.succeed_after)
    metrics0 = apiserver.scrape(ctx.api)
    cpu0, _ = _proc_usage(operator.pid)
    load0 = os.getloadavg()[0]
    names = [f"{JOB_PREFIX}{i:03d}" for i in range(ctx.jobs)]
    _create_jobs(custom, side, ns, rec, names, ctx, tpl)
    finished = _until(rec.done, ctx.timeout, 0.5)
    cpu1, peak = _proc_usage(operator.pid)
    metrics1 = apiserver.scrape(ctx.api)
    timed = {n: t for n, t in rec.created.items() if n.startswith(JOB_PREFIX)}
    only = lambda stamps: {n: t for n, t in stamps.items() if n in timed}  # noqa: E731
    figures = report.run_figures(
        timed,
        only(rec.all_pods_created),
        only(rec.running),
        only(rec.pods_running),
        only(rec.succeeded),
        only(rec.cleaned),
    )
    flow0, flow1 = apiserver.flow_count(metrics0), apiserver.flow_count(metrics1)
    by = apiserver.diff(apiserver.requests_by(metrics1), apiserver.requests_by(metrics0))
    return {
        **figures,
        "finished": finished,
        "load_1min_before": round(load0, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "operator_cpu_s": round(cpu1 - cpu0, 2),
        "operator_peak_rss_mib": round(peak / 2**20, 1),
        "operator_requests": None if flow0 is None or flow1 is None else flow1 - flow0,
        "operator_requests_per_job": None if flow0 is None or flow1 is None else round((flow1 - flow0) / ctx.jobs, 1),
        "writes_per_job": round(apiserver.writes(by) / ctx.jobs, 1),
        "requests_by_verb_resource": dict(sorted(by.items(), key=lambda kv: -kv[1])[:25]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kubernetes import client, config

    kwok = load_kwok()
    api = config.new_client_from_config(config_file=args.kubeconfig)
    core = client.CoreV1Api(api)
    order = [s.strip() for s in args.sides.split(",") if s.strip()]
    all_sides = sides()
    for key in order:
        if key != "tfps" and not anchor.binary(key == "raised").exists():
            raise SystemExit(f"{anchor.binary(key == 'raised')} is missing: run hack/build-training-operator.sh")
    kubectl = shutil.which("kubectl") or str(kwok.cluster.binary("kubectl"))
    if "tfps" in order:
        anchor.install_crd(kubectl, args.kubeconfig, REPO / "crds" / "trainingjob.yaml", f"{TFPS[2]}.{TFPS[0]}")
    if any(k != "tfps" for k in order):
        anchor.install_crd(kubectl, args.kubeconfig)
    identity_ns = _new_namespace(core, "bench-scale-identity")
    log_dir = Path(tempfile.mkdtemp(prefix="tfps-bench-scale-"))
    runs: list[dict[str, Any]] = []
    try:
        operator_kubeconfig = apiserver.setup_identity(api, identity_ns, args.kubeconfig)
        ctx = Context(
            api,
            args.kubeconfig,
            identity_ns,
            str(operator_kubeconfig),
            args.jobs,
            args.ps,
            args.workers,
            args.succeed_after,
            args.timeout,
            kwok,
            log_dir,
        )
        nodes = operator_kwok.nodes(kwok, args.nodes, cpu="128", memory="512Gi", gpus=96, pods=250)
        with operator_kwok.running(kwok, args.kubeconfig, nodes, log_dir / "kwok.log"):
            for i in range(args.runs):
                for key in order:
                    log.info("run %d/%d: %s, %d jobs", i + 1, args.runs, key, args.jobs)
                    result = run_once(ctx, all_sides[key], i)
                    log.info("%s", json.dumps(result))
                    runs.append(result)
    finally:
        apiserver.teardown_identity(api, identity_ns)
        core.delete_namespace(identity_ns)
    out = report.summarize(runs)
    out.update(
        {
            "title": (
                f"operator scale: {args.jobs} jobs × ({args.ps} PS + {args.workers} workers), "
                f"{args.runs} run(s) per side"
            ),
            "jobs": args.jobs,
            "ps": args.ps,
            "workers": args.workers,
            "succeed_after": args.succeed_after,
            "kwok_nodes": args.nodes,
            "logs": str(log_dir),
            "notes": NOTES,
        }
    )
    return out


def report_only(args: argparse.Namespace) -> dict[str, Any]:
    lines = Path(args.report_only).read_text().splitlines()
    runs = [json.loads(line[line.index("{") :]) for line in lines if '"side"' in line]
    out = report.summarize(runs)
    counts = ", ".join(f"{side} {len(v['runs'])}" for side, v in out["sides"].items())
    out.update({"title": f"operator scale: {runs[0]['jobs'] if runs else 0} jobs; runs: {counts}", "notes": NOTES})
    return out


NOTES = [
    "operator's API requests: counted by the API server for the operator's own ServiceAccount "
    "(a flow schema of its own), from just before the first create until every job Succeeded "
    "and its PS pods were gone; warm-up excluded.",
    "API writes per job: every client's POST/PUT/PATCH/DELETE in that window (kwok, scheduler, "
    "controller-manager, the bench's own creates), for scale only.",
    "job Running: as each operator reports it (tfps: status.phase; training-operator: its Running "
    "condition, set once a worker runs); all pods Running: from the pods themselves.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfps.bench.operator_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sides", default="tfps,stock,raised", help="comma-separated, run in this order each round")
    parser.add_argument(
        "--succeed-after", default="30s", help="kwok ends a worker pod Succeeded this long after it runs"
    )
    parser.add_argument("--nodes", type=int, default=30, help="kwok nodes (128 CPU, 512Gi, 96 GPUs, 250 pods each)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds a run may take to finish")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG") or str(REPO / ".tfps" / "kubeconfig"))
    parser.add_argument(
        "--report-only",
        metavar="RUNS_JSONL",
        help="no measurement: the report of the runs in this file (one run's JSON a line, as each run logs it)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = report_only(args) if args.report_only else run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    from rich.console import Console

    report.render(out, Console(width=240))
    return 0 if all(r.get("finished") for side in out["sides"].values() for r in side["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
