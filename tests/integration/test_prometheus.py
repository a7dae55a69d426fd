"""A real Prometheus scraping a real training run: every dashboard panel returns data, every
alert rule parses and evaluates.

The run: one PS and two workers started as their pods start them (`tfps ps`, `tfps worker`
with the environment the operator gives a pod: TF_CONFIG, TFPS_* variables), each on its
own loopback address standing for its pod IP, serving /metrics on port 9090. Prometheus
(Debian's package) listens on 127.0.0.1 with its TSDB in a temporary folder, and scrapes
them with the scrape config the chart's PodMonitor (rendered by helm) stands for: the
targets carry the `__meta_kubernetes_*` labels their pods would have, and the PodMonitor's
selector, jobLabel, honorLabels and relabelings turn them into the series the dashboard
selects (hack/prometheus.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from support import hack_module, wait_for

from tfps.api import naming, tfconfig
from tfps.api.spec import ReplicaType, TrainingJobSpec
from tfps.runtime.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tfps"
DASHBOARD = json.loads((CHART / "files" / "dashboard.json").read_text())
RULES_FILE = CHART / "files" / "prometheus-rules.yaml"
JOB = "digits"
SCRAPE_INTERVAL = "1s"
# What Grafana puts in for $__rate_interval at a 1 s scrape interval is 4 s; a little more
# keeps a sample or two of slack on a busy machine.
RATE_INTERVAL = "10s"
# Panels that only an external exporter feeds, so a run of tfps alone leaves them empty:
# GPU utilisation comes from NVIDIA's DCGM exporter (DCGM_FI_DEV_GPU_UTIL), not from tfps.
EXTERNAL_PANELS = {"GPU utilisation": "DCGM_FI_DEV_"}


prom = hack_module("prometheus")


def _helm() -> str | None:
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    try:
        from test_chart import find_helm
    finally:
        sys.path.pop(0)
    return find_helm()


def _podmonitor() -> dict:
    helm = _helm()
    if helm is None:
        pytest.fail("helm not built: run hack/build-cluster.sh (the PodMonitor is rendered from the chart)")
    out = subprocess.run(
        [
            helm,
            "template",
            "tfps",
            str(CHART),
            "--namespace",
            "monitoring",
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--show-only",
            "templates/podmonitor.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return yaml.safe_load(out)


class Run:
    """One PS and two workers of TrainingJob `digits`, each as its pod would run it."""

    def __init__(self, namespace: str, workdir: Path):
        self.namespace, self.workdir = namespace, workdir
        # A loopback /24 of its own, like a node's pod CIDR; ports are the pods' fixed ones.
        self.subnet = f"127.{random.randint(64, 250)}.{random.randint(0, 255)}"
        self.spec = TrainingJobSpec.model_validate(
            {
                "replicaSpecs": {"PS": {"replicas": 1}, "Worker": {"replicas": 2}},
                "training": {
                    "model": "digits-mlp",
                    "batchSize": 32,
                    "steps": 1_000_000,
                    "optimizer": {"name": "adam", "learningRate": 0.001},
                    "consistency": {"mode": "sync"},
                },
            }
        )
        self.procs: dict[str, subprocess.Popen] = {}

    def ip(self, rtype: ReplicaType, index: int) -> str:
        offset = {ReplicaType.PS: 10, ReplicaType.WORKER: 20}[rtype]
        return f"{self.subnet}.{offset + index}"

    def replicas(self) -> list[tuple[ReplicaType, int]]:
        return [(t, i) for t in (ReplicaType.PS, ReplicaType.WORKER) for i in range(self.spec.replicas(t))]

    def env(self, rtype: ReplicaType, index: int) -> dict[str, str]:
        cfg = tfconfig.tf_config(
            JOB, self.namespace, self.spec, rtype, index, address=lambda t, i: f"{self.ip(t, i)}:{naming.GRPC_PORT}"
        )
        return {
            **os.environ,
            naming.ENV_TF_CONFIG: json.dumps(cfg),
            naming.ENV_JOB_NAME: JOB,
            naming.ENV_NAMESPACE: self.namespace,
            naming.ENV_TRAINING: json.dumps(self.spec.training.to_manifest()),
            naming.ENV_BIND_ADDRESS: self.ip(rtype, index),
            naming.ENV_METRICS_PORT: str(naming.METRICS_PORT),
            "TFPS_INTRA_OP_THREADS": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "CUDA_VISIBLE_DEVICES": "",
        }

    def start(self) -> None:
        tfps = shutil.which("tfps", path=str(Path(sys.executable).parent)) or "tfps"
        for rtype, index in self.replicas():
            name = naming.pod_name(JOB, rtype, index)
            with open(self.workdir / f"{name}.log", "wb") as log:  # the child keeps its own copy
                self.procs[name] = subprocess.Popen(
                    [tfps, rtype.task_type],
                    env=self.env(rtype, index),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def targets(self) -> list:

        return [
            prom.PodTarget(
                namespace=self.namespace,
                name=naming.pod_name(JOB, t, i),
                address=f"{self.ip(t, i)}:{naming.METRICS_PORT}",
                labels=naming.replica_labels(JOB, t, i),
                port_name=naming.METRICS_PORT_NAME,
                container=naming.CONTAINER_NAME,
            )
            for t, i in self.replicas()
        ]

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.workdir / f"{name}.log").read_text()[-3000:]
                pytest.fail(f"{name} exited with {proc.returncode} during the run:\n{log}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """A training run in progress and a Prometheus that has scraped it for a while."""
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        pytest.fail("prometheus/promtool not installed: run hack/install-system-deps.sh")
    workdir = tmp_path_factory.mktemp("prometheus")
    namespace = f"prom-{uuid.uuid4().hex[:6]}"
    run = Run(namespace, workdir)
    scrape = prom.podmonitor_scrape_config(_podmonitor(), static_targets=run.targets(), interval=SCRAPE_INTERVAL)
    rules = prom.alert_rules_from_chart(RULES_FILE, workdir / "rules.yaml")
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prom.prometheus_config([scrape], [str(rules)]), sort_keys=False))
    port = free_port()
    server = prom.start(config, workdir / "tsdb", port, workdir / "prometheus.log")
    api = prom.API(f"http://127.0.0.1:{port}")
    run.start()
    try:
        api.wait_ready(timeout=90)
        sel = f'namespace="{namespace}", job="{JOB}"'

        def scraped_enough():
            run.check_alive()
            targets = api.get("/api/v1/targets")["activeTargets"]
            up = [t for t in targets if t["health"] == "up"]
            # Every replica scraped several times while the workers were stepping.
            samples = api.query(f"min(count_over_time(tfps_worker_steps_total{{{sel}}}[1m]))")["result"]
            stepping = api.query(f"sum(rate(tfps_worker_steps_total{{{sel}}}[{RATE_INTERVAL}])) > 0")["result"]
            ps_samples = api.query(f"min(count_over_time(tfps_ps_global_step{{{sel}}}[1m]))")["result"]
            return (
                len(up) == len(run.procs)
                and samples
                and float(samples[0]["value"][1]) >= 12
                and stepping
                and ps_samples
                and float(ps_samples[0]["value"][1]) >= 12
            )

        wait_for("every replica scraped while the workers step", scraped_enough, timeout=300, interval=1)
        yield api, namespace, run, workdir
    finally:
        run.stop()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _substitute(expr: str, namespace: str) -> str:
    return (
        expr.replace("$namespace", namespace)
        .replace("$job", JOB)
        .replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__interval", SCRAPE_INTERVAL)
    )


def _panels():
    return [p for p in DASHBOARD["panels"] if p.get("targets")]


def test_targets_get_pod_labels_like_the_podmonitor_gives(scraped_run):
    api, namespace, run, _ = scraped_run
    up = api.query(f'up{{namespace="{namespace}"}}')["result"]
    got = sorted(
        (
            s["metric"]["job"],
            s["metric"]["pod"],
            s["metric"]["instance"],
            s["metric"]["replica_type"],
            s["metric"]["replica_index"],
        )
        for s in up
    )
    assert got == [
        (JOB, "digits-ps-0", "digits-ps-0", "ps", "0"),
        (JOB, "digits-worker-0", "digits-worker-0", "worker", "0"),
        (JOB, "digits-worker-1", "digits-worker-1", "worker", "1"),
    ]
    # honorLabels: the labels the processes export win over the target's (no exported_job).
    steps = api.query(f'tfps_worker_steps_total{{namespace="{namespace}"}}')["result"]
    assert {s["metric"]["job"] for s in steps} == {JOB}
    assert not any("exported_job" in s["metric"] for s in steps)


def test_dashboard_variables_list_the_run(scraped_run):
    api, namespace, _, _ = scraped_run
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    for name, want in (("namespace", namespace), ("job", JOB)):
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name]["query"])
        assert m, variables[name]["query"]
        selector, label = _substitute(m.group(1), namespace), m.group(2)
        values = api.get(f"/api/v1/label/{label}/values", **{"match[]": selector})
        assert want in values


@pytest.mark.parametrize("panel", _panels(), ids=lambda p: p["title"])
def test_every_panel_query_returns_data(scraped_run, panel):
    api, namespace, run, _ = scraped_run
    run.check_alive()
    for target in panel["targets"]:
        expr = _substitute(target["expr"], namespace)
        result = api.query(expr)["result"]  # raises on a query Prometheus refuses
        if panel["title"] in EXTERNAL_PANELS:
            assert EXTERNAL_PANELS[panel["title"]] in expr
            continue
        assert result, f"{panel['title']}: no series for {expr}"
        values = [float(s["value"][1]) for s in result]
        assert any(math.isfinite(v) for v in values), f"{panel['title']}: only NaN/Inf for {expr}: {values}"


def test_external_allow_list_is_exactly_the_gpu_panel():
    titles = {p["title"] for p in _panels()}
    assert set(EXTERNAL_PANELS) <= titles
    for panel in _panels():
        uses_external = any(m in t["expr"] for t in panel["targets"] for m in ("DCGM_",))
        assert uses_external == (panel["title"] in EXTERNAL_PANELS), panel["title"]


def test_alert_rules_pass_promtool(scraped_run):
    _, _, _, workdir = scraped_run
    proc = subprocess.run(
        ["promtool", "check", "rules", str(workdir / "rules.yaml")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_expression_evaluates(scraped_run):
    api, _, _, _ = scraped_run
    rules = [r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]
    assert rules
    for rule in rules:
        data = api.query(rule["expr"])  # raises when Prometheus cannot parse or evaluate it
        assert data["resultType"] == "vector", rule["alert"]

    # Prometheus also loaded the same rules and evaluates them every second without error.
    def all_evaluated_ok():
        loaded = {r["name"]: r for g in api.get("/api/v1/rules")["groups"] for r in g["rules"]}
        # health is "unknown" until a rule's first evaluation, "err" when it failed.
        return set(loaded) == {r["alert"] for r in rules} and all(r["health"] == "ok" for r in loaded.values())

    wait_for("every rule evaluated without error", all_evaluated_ok, timeout=30, interval=1)


def test_a_healthy_run_raises_no_alert(scraped_run):
    api, namespace, _, _ = scraped_run
    for rule in (r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]):
        if rule["alert"] == "TfpsPSApplyLatencyHigh":
            continue  # a matter of the machine's speed, not of the run's health
        result = api.query(rule["expr"])["result"]
        ours = [s for s in result if s["metric"].get("namespace") == namespace]
        assert not ours, f"{rule['alert']} fires on a healthy run: {ours}"
