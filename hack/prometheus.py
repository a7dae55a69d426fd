#!/usr/bin/env python3
"""A local Prometheus that scrapes tfps job pods the way the chart's PodMonitor asks.

prometheus-operator turns a PodMonitor into a Prometheus scrape config; `podmonitor_scrape_config`
does the same for the parts the chart uses (selector on a label that exists, port name,
jobLabel, honorLabels, relabelings), so a plain Prometheus (Debian's package) scrapes with
the PodMonitor's settings. Targets are static and carry the `__meta_kubernetes_*` labels
Kubernetes service discovery would give their pods (processes on loopback addresses
standing for pods); Debian's Prometheus is built without Kubernetes service discovery. A
Prometheus that has it can be given `kubernetes_sd` instead.

    hack/prometheus.py config --podmonitor PM.yaml --target NS/POD=IP:PORT[,label=value...] [--rules FILE]
    hack/prometheus.py run CONFIG --port 9099 --storage DIR

Prometheus listens on 127.0.0.1 only and keeps its data in the given folder.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml


def sanitize(name: str) -> str:
    """A Kubernetes label name as Prometheus's service discovery spells it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


@dataclass
class PodTarget:
    """A pod (or a process standing for one) with the labels Kubernetes SD would give it."""

    namespace: str
    name: str
    address: str  # ip:port of the metrics endpoint
    labels: dict[str, str] = field(default_factory=dict)
    port_name: str = "metrics"
    container: str = "tensorflow"

    def meta_labels(self) -> dict[str, str]:
        meta = {
            "__meta_kubernetes_namespace": self.namespace,
            "__meta_kubernetes_pod_name": self.name,
            "__meta_kubernetes_pod_ip": self.address.rsplit(":", 1)[0],
            "__meta_kubernetes_pod_container_name": self.container,
            "__meta_kubernetes_pod_container_port_name": self.port_name,
            "__meta_kubernetes_pod_phase": "Running",
        }
        for key, value in self.labels.items():
            meta[f"__meta_kubernetes_pod_label_{sanitize(key)}"] = value
            meta[f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}"] = "true"
        return meta


_RELABEL_KEYS = {
    "sourceLabels": "source_labels",
    "targetLabel": "target_label",
    "replacement": "replacement",
    "regex": "regex",
    "separator": "separator",
    "modulus": "modulus",
}


def _relabel(rule: dict) -> dict:
    out = {_RELABEL_KEYS[k]: v for k, v in rule.items() if k in _RELABEL_KEYS}
    if "action" in rule:
        out["action"] = rule["action"].lower()
    return out


def _selector_relabels(selector: dict) -> list[dict]:
    rules = []
    for key, value in (selector.get("matchLabels") or {}).items():
        rules.append(
            {
                "action": "keep",
                "source_labels": [
                    f"__meta_kubernetes_pod_label_{sanitize(key)}",
                    f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}",
                ],
                "regex": f"({re.escape(value)});true",
            }
        )
    for expr in selector.get("matchExpressions") or []:
        key, op = sanitize(expr["key"]), expr["operator"]
        values = "|".join(re.escape(v) for v in expr.get("values", []))
        if op == "Exists":
            rules.append(
                {"action": "keep", "source_labels": [f"__meta_kubernetes_pod_labelpresent_{key}"], "regex": "true"}
            )
        elif op == "DoesNotExist":
            rules.append(
                {"action": "drop", "source_labels": [f"__meta_kubernetes_pod_labelpresent_{key}"], "regex": "true"}
            )
        elif op == "In":
            rules.append(
                {"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{key}"], "regex": f"({values})"}
            )
        elif op == "NotIn":
            rules.append(
                {"action": "drop", "source_labels": [f"__meta_kubernetes_pod_label_{key}"], "regex": f"({values})"}
            )
        else:
            raise ValueError(f"unsupported selector operator {op}")
    return rules


def podmonitor_scrape_config(
    podmonitor: dict,
    *,
    static_targets: list[PodTarget] | None = None,
    kubernetes_sd: dict | None = None,
    interval: str | None = None,
    endpoint_index: int = 0,
) -> dict:
    """The scrape config prometheus-operator would generate for one PodMonitor endpoint.

    `interval` overrides the endpoint's (tests scrape every second)."""
    meta, spec = podmonitor["metadata"], podmonitor["spec"]
    endpoint = spec["podMetricsEndpoints"][endpoint_index]
    relabels: list[dict] = [
        {"action": "replace", "source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}
    ]
    relabels += _selector_relabels(spec.get("selector") or {})
    if "port" in endpoint:
        relabels.append(
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": re.escape(endpoint["port"]),
            }
        )
    relabels += [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta.get('namespace', 'default')}/{meta['name']}"},
    ]
    if spec.get("jobLabel"):
        relabels.append(
            {
                "source_labels": [f"__meta_kubernetes_pod_label_{sanitize(spec['jobLabel'])}"],
                "target_label": "job",
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    if "port" in endpoint:
        relabels.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    relabels += [_relabel(r) for r in endpoint.get("relabelings") or []]

    config: dict = {
        "job_name": f"podMonitor/{meta.get('namespace', 'default')}/{meta['name']}/{endpoint_index}",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path", "/metrics"),
        "scheme": endpoint.get("scheme", "http"),
        "scrape_interval": interval or endpoint.get("interval", "30s"),
        "relabel_configs": relabels,
    }
    if endpoint.get("scrapeTimeout"):
        config["scrape_timeout"] = endpoint["scrapeTimeout"]
    if interval:
        config["scrape_timeout"] = interval
    if kubernetes_sd is not None:
        config["kubernetes_sd_configs"] = [{"role": "pod", **kubernetes_sd}]
    else:
        config["static_configs"] = [{"targets": [t.address], "labels": t.meta_labels()} for t in static_targets or []]
    return config


def prometheus_config(
    scrape_configs: list[dict], rule_files: list[str] | None = None, evaluation_interval: str = "1s"
) -> dict:
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": evaluation_interval},
        "rule_files": list(rule_files or []),
        "scrape_configs": scrape_configs,
    }


def alert_rules_from_chart(rule_file: Path, out: Path) -> Path:
    """The chart's alert rule file as Prometheus reads it (it already is one; copied so that
    a test's Prometheus loads exactly what the chart ships)."""
    shutil.copyfile(rule_file, out)
    return out


def start(config: Path, storage: Path, port: int, log: Path) -> subprocess.Popen:
    """Start Prometheus on 127.0.0.1:`port` with its TSDB in `storage`."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (hack/install-system-deps.sh installs it)")
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={storage}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1d",
        "--log.level=warn",
    ]
    with open(log, "ab") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


class API:
    """The few calls of Prometheus's HTTP API the tests and the demo use."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, time_: float | None = None) -> dict:
        params = {"query": expr}
        if time_ is not None:
            params["time"] = f"{time_:.3f}"
        return self.get("/api/v1/query", **params)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Prometheus at {self.url} not ready after {timeout}s")
            time.sleep(0.5)


def _parse_target(text: str) -> PodTarget:
    # NS/POD=IP:PORT[,key=value...]
    m = re.match(r"^([^/]+)/([^=]+)=([^,]+)(?:,(.*))?$", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad target {text!r} (want NS/POD=IP:PORT[,label=value...])")
    labels = dict(kv.split("=", 1) for kv in (m.group(4) or "").split(",") if kv)
    return PodTarget(namespace=m.group(1), name=m.group(2), address=m.group(3), labels=labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a local Prometheus scraping tfps pods like the chart's PodMonitor")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cfg = sub.add_parser("config", help="print a Prometheus config for a PodMonitor")
    cfg.add_argument("--podmonitor", required=True, type=Path, help="a PodMonitor manifest (e.g. from helm template)")
    cfg.add_argument(
        "--target", action="append", type=_parse_target, default=[], help="NS/POD=IP:PORT[,label=value...]"
    )
    cfg.add_argument("--interval", help="scrape interval (default: the PodMonitor's)")
    cfg.add_argument("--rules", action="append", default=[], help="rule files to load")
    run = sub.add_parser("run", help="run Prometheus on 127.0.0.1")
    run.add_argument("config", type=Path)
    run.add_argument("--port", type=int, default=9099)
    run.add_argument("--storage", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.cmd == "config":
        pm = next(d for d in yaml.safe_load_all(args.podmonitor.read_text()) if d and d.get("kind") == "PodMonitor")
        scrape = podmonitor_scrape_config(pm, static_targets=args.target, interval=args.interval)
        yaml.safe_dump(prometheus_config([scrape], args.rules), sys.stdout, sort_keys=False)
        return 0
    proc = start(args.config, args.storage, args.port, args.storage / "prometheus.log")
    print(f"prometheus: http://127.0.0.1:{args.port} (pid {proc.pid}, log {args.storage / 'prometheus.log'})")
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
