"""Follow one TrainingJob until it ends: a progress bar from its status, then a summary.

Used by `make demo`; reads only what any user can read (the TrainingJob's status and Events, and
its pods' container statuses, for the images that ran).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kubernetes import client, config
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tfps.api.spec import API_GROUP, API_VERSION, PLURAL, TrainingJob

TERMINAL = {"Succeeded", "Failed"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--operator-namespace", default="tfps-system", help="where the chart's operator runs")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    args = ap.parse_args()
    config.load_kube_config()
    api = client.CustomObjectsApi()
    core = client.CoreV1Api()
    console = Console()
    images: dict[str, str] = {}

    def get() -> dict:
        return api.get_namespaced_custom_object(API_GROUP, API_VERSION, args.namespace, PLURAL, args.name)

    obj = get()
    steps = TrainingJob.model_validate(obj).spec.training.steps
    deadline = time.monotonic() + args.timeout
    phase = ""
    rates: list[float] = []  # readings while training ran, for a summary not skewed by the end
    with Progress(
        TextColumn("[bold]{task.fields[phase]:<10}"),
        BarColumn(),
        TextColumn("step {task.completed:>6.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[eps]} ex/s"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("train", total=steps, phase="Pending", loss="-", eps="-")
        while time.monotonic() < deadline:
            obj = get()
            status = obj.get("status") or {}
            progress = status.get("progress") or {}
            if status.get("phase") != phase:
                phase = status.get("phase", "")
                cond = next((c for c in reversed(status.get("conditions") or []) if c.get("status") == "True"), {})
                bar.console.log(f"phase {phase}: {cond.get('reason', '')} {cond.get('message', '')}")
            bar.update(
                task,
                completed=progress.get("step", 0),
                phase=phase or "Pending",
                loss=f"{progress['loss']:.4f}" if "loss" in progress else "-",
                eps=f"{progress['examplesPerSecond']:.0f}" if "examplesPerSecond" in progress else "-",
            )
            if progress.get("examplesPerSecond"):
                rates.append(progress["examplesPerSecond"])
            images.update(images_ran(core, args.namespace, args.name, args.operator_namespace))
            if phase in TERMINAL:
                break
            time.sleep(1.0)
    summary(console, obj, rates, images)
    if phase != "Succeeded":
        console.print(f"[red]{args.name} ended {phase or 'without finishing'} (timeout {args.timeout:.0f} s)")
        return 1
    return 0


def images_ran(core: client.CoreV1Api, namespace: str, job: str, operator_namespace: str) -> dict[str, str]:
    """Replica type (and the operator) -> the image its running container was started from, with
    the image's ID as the node's runtime reports it."""
    out = {}
    pods = core.list_namespaced_pod(namespace, label_selector=f"tfps.io/job-name={job}").items
    pods += core.list_namespaced_pod(operator_namespace, label_selector="app.kubernetes.io/name=tfps").items
    for pod in pods:
        role = (pod.metadata.labels or {}).get("tfps.io/replica-type", "operator")
        for cs in pod.status.container_statuses or []:
            if cs.image_id and (cs.state.running or cs.state.terminated):
                out[role] = f"{cs.image} ({cs.image_id.rsplit(':', 1)[-1][:12]})"
    return out


def summary(console: Console, obj: dict, rates: list[float], images: dict[str, str]) -> None:
    status = obj.get("status") or {}
    progress = status.get("progress") or {}
    meta = obj["metadata"]
    table = Table(title=f"TrainingJob {meta['namespace']}/{meta['name']}", show_header=False)
    table.add_row("phase", status.get("phase", "?"))
    table.add_row("steps", str(progress.get("step", "?")))
    for key, label, fmt in (
        ("loss", "final loss", "{:.4f}"),
        ("accuracy", "test accuracy", "{:.4f}"),
        ("auc", "test AUC", "{:.4f}"),
    ):
        if key in progress or key != "auc":
            table.add_row(label, fmt.format(progress[key]) if key in progress else "n/a")
    table.add_row("examples/s (median while training)", f"{statistics.median(rates):.0f}" if rates else "n/a")
    table.add_row("started / completed", f"{status.get('startTime', '?')} / {status.get('completionTime', '?')}")
    for role, image in sorted(images.items()):
        table.add_row(f"image ({role})", image)
    console.print(table)
    console.print(
        "Metrics: every PS and worker pod serves Prometheus metrics on port 9090 (/metrics); "
        "the operator on its metrics port. With prometheus-operator, install the chart with "
        "--set monitoring.podMonitor.enabled=true and import charts/tfps/files/dashboard.json into Grafana. "
        "Here each pod has its own address on the node's bridge (198.18.0.0/24): `kubectl get pods -o wide` "
        "shows it, and `curl http://<podIP>:9090/metrics` reads a pod's metrics from this machine; "
        "`kubectl port-forward pod/<pod> 9090` works too."
    )


if __name__ == "__main__":
    sys.exit(main())
