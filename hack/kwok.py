#!/usr/bin/env python3
"""Fake nodes for scale and scheduling checks: kwok plays the kubelet of Node objects that
advertise CPU, memory and `nvidia.com/gpu`, on the local control plane (hack/cluster.py).

The real scheduler binds pods to these nodes; kwok's stages then move each pod along: Running
at once, Succeeded after the delay its `SUCCEED_AFTER` annotation gives (none: it runs until
deleted), gone when deleted. No container runs anywhere.

Addresses (the network rule): kwok hands out pod IPs from POD_CIDR and reports NODE_IP for its
nodes. Both lie in 198.18.128.0/17, inside the cluster's own 198.18.0.0/15 and outside the real
node's pod bridge; `running()` routes that block to a blackhole while kwok runs, so a connection
to a fake pod (the operator reading a PS pod's metrics) fails at once on this machine.

Usage (standard library only; the cluster must be up):
    hack/kwok.py up [--nodes N] [--gpus G] [--cpu C] [--memory M]   # runs until interrupted
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster  # noqa: E402  (hack/cluster.py, beside this file)

log = logging.getLogger("tfps.kwok")

BLACKHOLE = "198.18.128.0/17"
NODE_IP = "198.18.128.1"
POD_CIDR = "198.18.192.0/18"
NODE_LABEL = ("type", "kwok")
TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
# On a pod: how long after it runs kwok ends it Succeeded, as a Go duration ("30s", "1m").
SUCCEED_AFTER = "tfps.io/kwok-succeed-after"
# kwok's own stages, from its module (hack/build-cluster.sh copies them beside the binary).
STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-delete.yaml",
)

# Ours: a Running pod with the annotation ends Succeeded after its delay.
SUCCEED_STAGE = {
    "apiVersion": "kwok.x-k8s.io/v1alpha1",
    "kind": "Stage",
    "metadata": {"name": "tfps-pod-succeed-after"},
    "spec": {
        "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
        "selector": {
            "matchExpressions": [
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {"key": f'.metadata.annotations["{SUCCEED_AFTER}"]', "operator": "Exists"},
            ]
        },
        "delay": {
            "durationMilliseconds": 0,
            "durationFrom": {"expressionFrom": f'.metadata.annotations["{SUCCEED_AFTER}"]'},
        },
        "next": {
            "statusTemplate": (
                "{{ $now := Now }}\n"
                "containerStatuses:\n"
                "{{ range .spec.containers }}\n"
                "- name: {{ .name | Quote }}\n"
                "  image: {{ .image | Quote }}\n"
                "  ready: false\n"
                "  restartCount: 0\n"
                "  state:\n"
                "    terminated:\n"
                "      exitCode: 0\n"
                "      reason: Completed\n"
                "      startedAt: {{ $now | Quote }}\n"
                "      finishedAt: {{ $now | Quote }}\n"
                "{{ end }}\n"
                "phase: Succeeded\n"
            )
        },
    },
}


def kwok_dir() -> Path:
    return cluster.binary("kwok").resolve().parent


def placement(label: tuple[str, str] = NODE_LABEL) -> dict:
    """The pod-spec fields that put a pod on kwok's nodes with `label` only (never on the real node)."""
    return {
        "nodeSelector": {label[0]: label[1]},
        "tolerations": [{"key": TAINT["key"], "operator": "Exists", "effect": TAINT["effect"]}],
    }


def node_manifest(
    name: str,
    cpu: str = "64",
    memory: str = "256Gi",
    gpus: int = 0,
    pods: int = 250,
    label: tuple[str, str] = NODE_LABEL,
) -> dict:
    capacity = {"cpu": cpu, "memory": memory, "pods": str(pods)}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {label[0]: label[1], "kubernetes.io/hostname": name},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
        },
        "spec": {"taints": [TAINT]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def write_config(path: Path) -> Path:
    docs = [(kwok_dir() / "stage" / stage).read_text() for stage in STAGES]
    docs.append(json.dumps(SUCCEED_STAGE))  # JSON is YAML
    path.write_text("\n---\n".join(docs))
    return path


def argv(kubeconfig: Path, config: Path, label: tuple[str, str] = NODE_LABEL) -> list[str]:
    """One kwok per label: several may run side by side, each playing only its own nodes."""
    return [
        str(cluster.binary("kwok")),
        f"--kubeconfig={kubeconfig}",
        f"--config={config}",
        f"--manage-nodes-with-label-selector={label[0]}={label[1]}",
        f"--cidr={POD_CIDR}",
        f"--node-ip={NODE_IP}",
        "--node-lease-duration-seconds=40",
    ]


def _route(action: str) -> None:
    subprocess.run(
        ["ip", "route", action, "blackhole", BLACKHOLE],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _kwok_running() -> bool:
    """Whether any kwok process still runs (several may, each with its own nodes): the blackhole
    route goes only with the last one."""
    exe = str(cluster.binary("kwok").resolve())
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str((proc / "exe").resolve()) == exe:
                return True
        except OSError:
            continue
    return False


def _api(p: cluster.Paths, path: str, method: str = "GET", body: object = None) -> tuple[int, bytes]:
    return cluster.api_call(p, cluster.load_info(p)["apiserver_url"], path, timeout=30, method=method, body=body)


def create_nodes(p: cluster.Paths, nodes: list[dict]) -> None:
    for manifest in nodes:
        code, body = _api(p, "/api/v1/nodes", "POST", manifest)
        if code not in (201, 409):
            raise RuntimeError(f"creating node {manifest['metadata']['name']}: {code} {body[:300]!r}")


def delete_nodes(p: cluster.Paths, names: list[str], timeout: float = 30) -> None:
    """The nodes deleted, and the pods bound to them with them, before it returns. Left to the
    cluster, those pods stay (no kubelet finishes them) until the pod GC's quarantine (40 s) ends,
    and a node made again under the same name meanwhile starts with them on it."""
    for name in names:
        _api(p, f"/api/v1/nodes/{name}", "DELETE")
    deadline = time.monotonic() + timeout
    while bound := _pods_bound_to(p, names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"pods still bound to deleted kwok nodes after {timeout:.0f}s: {bound[:5]}")
        for namespace, pod in bound:
            _api(p, f"/api/v1/namespaces/{namespace}/pods/{pod}?gracePeriodSeconds=0", "DELETE")
        time.sleep(0.2)


def _pods_bound_to(p: cluster.Paths, names: list[str]) -> list[tuple[str, str]]:
    out = []
    for name in names:
        code, body = _api(p, f"/api/v1/pods?fieldSelector=spec.nodeName%3D{name}")
        if code != 200:
            raise RuntimeError(f"listing the pods on {name}: {code} {body[:300]!r}")
        out += [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in json.loads(body)["items"]]
    return out


def nodes_ready(p: cluster.Paths, names: list[str], label: tuple[str, str] = NODE_LABEL) -> bool:
    code, body = _api(p, f"/api/v1/nodes?labelSelector={label[0]}%3D{label[1]}")
    if code != 200:
        return False
    ready = {
        n["metadata"]["name"]
        for n in json.loads(body)["items"]
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
    }
    return set(names) <= ready


@contextlib.contextmanager
def running(
    kubeconfig: str | Path,
    nodes: list[dict],
    log_path: str | Path,
    timeout: float = 60,
    label: tuple[str, str] = NODE_LABEL,
) -> Iterator[subprocess.Popen]:
    """kwok for the nodes with `label`, and `nodes` (made with that label), Ready; on exit those
    nodes are deleted (their pods with them) and kwok stops."""
    kubeconfig = Path(kubeconfig)
    p = cluster.Paths(kubeconfig.parent)
    log_path = Path(log_path)
    config = write_config(log_path.with_suffix(".stages.yaml"))
    _route("replace")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv(kubeconfig, config, label), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    names = [n["metadata"]["name"] for n in nodes]
    try:
        create_nodes(p, nodes)
        deadline = time.monotonic() + timeout
        while not nodes_ready(p, names, label):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kwok nodes not Ready after {timeout:.0f}s (kwok log: {log_path})")
            time.sleep(0.2)
        yield proc
    finally:
        delete_nodes(p, names)  # only its own: another kwok may run beside it with other nodes
        cluster.stop_child(proc)
        if not _kwok_running():
            _route("del")


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/kwok.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="run kwok with fake nodes until interrupted")
    u.add_argument("--nodes", type=int, default=4)
    u.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu per node")
    u.add_argument("--cpu", default="64")
    u.add_argument("--memory", default="256Gi")
    u.add_argument("--state-dir", type=Path, default=cluster.state_dir())
    a = ap.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    nodes = [node_manifest(f"kwok-{i}", a.cpu, a.memory, a.gpus) for i in range(a.nodes)]
    with running(a.state_dir / "kubeconfig", nodes, a.state_dir / "logs" / "kwok.log"):
        log.info("%d kwok nodes Ready (%s GPUs each); Ctrl-C stops them", a.nodes, a.gpus)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
