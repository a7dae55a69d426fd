#!/usr/bin/env python3
"""Kueue (sigs.k8s.io/kueue, KUEUE_VERSION of hack/versions.env, built by hack/build-kueue.sh) run
out of cluster against the local control plane (hack/cluster.py), for queueing checks.

What it installs, all from Kueue's own module in Go's module cache:
- Kueue's CRDs (config/components/crd/bases), only those the cluster lacks, removed again after;
- its webhooks (config/components/webhook/manifests.yaml): the pod webhooks and those of Kueue's
  own objects, pointing at `https://127.0.0.1:<port><path>` with the CA of a serving certificate
  made here with openssl (SAN 127.0.0.1); the pod webhooks only for namespaces labelled
  NAMESPACE_LABEL, so a Kueue that died can block pod creation in those namespaces only.
Kueue runs with the `pod` integration managing the same namespaces only, leader election off,
its internal certificate management off, metrics and health on 127.0.0.1, and its visibility
API server off; it logs at verbosity 2 (`TFPS_KUEUE_LOG_LEVEL` sets another: 5 shows each
pod it ungates and why it skips one). Its manager reads the metrics certificate from a fixed
path, /etc/kueue/metrics/certs: it runs in a private mount namespace whose /etc is an overlay, so
the machine's /etc is never written.

On exit, in this order: the webhooks go, Kueue stops, the finalizers Kueue put on pods and on
its own objects are removed (nothing is left stuck terminating), and the CRDs installed here are
deleted. `hack/kueue.py down` does the same for a run that was killed.

Usage (the cluster must be up; root, for the mount namespace):
    hack/kueue.py up      # runs until interrupted
    hack/kueue.py down    # removes what a killed run left
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster  # noqa: E402  (hack/cluster.py, beside this file)

log = logging.getLogger("tfps.kueue")

MODULE = "sigs.k8s.io/kueue"
NAMESPACE_LABEL = ("tfps.io/kueue", "on")
# Every object installed here carries this label; `down` finds them by it.
OWNER_LABEL = ("app.kubernetes.io/managed-by", "tfps-hack-kueue")
WEBHOOK_NAMES = {
    "MutatingWebhookConfiguration": "tfps-kueue-mutating",
    "ValidatingWebhookConfiguration": "tfps-kueue-validating",
}
KUEUE_GROUP = "kueue.x-k8s.io"
POD_FINALIZER = "kueue.x-k8s.io/managed"
METRICS_CERTS = "/etc/kueue/metrics/certs"  # fixed in Kueue's cmd/kueue/main.go


def version() -> str:
    return cluster.read_versions()["KUEUE_VERSION"]


def binary() -> Path:
    return cluster.cache_dir() / "bin" / f"kueue-{version()}" / "kueue"


def module_dir() -> Path:
    """Kueue's module source (its CRDs and webhook manifests), downloaded if not cached."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{MODULE}@{version()}"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "GOTOOLCHAIN": "local"},
    )
    return Path(json.loads(out.stdout)["Dir"])


# ---------------------------------------------------------------------------------------------
# API calls (kubectl, as the cluster's admin)


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(cluster.binary("kubectl")), f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _items(kubeconfig: Path, *args: str) -> list[dict]:
    proc = kubectl(kubeconfig, "get", *args, "-o", "json", check=False)
    return json.loads(proc.stdout).get("items", []) if proc.returncode == 0 else []


def _apply(kubeconfig: Path, objects: list[dict]) -> None:
    kubectl(
        kubeconfig,
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=tfps-hack-kueue",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
    )


def _labelled(obj: dict) -> dict:
    obj.setdefault("metadata", {}).setdefault("labels", {})[OWNER_LABEL[0]] = OWNER_LABEL[1]
    return obj


# ---------------------------------------------------------------------------------------------
# What is installed


def crds(module: Path) -> list[dict]:
    docs = []
    for path in sorted((module / "config" / "components" / "crd" / "bases").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [_labelled(d) for d in docs]


def _served_here(webhook: dict) -> bool:
    """Pods (core group) and Kueue's own objects: the webhooks of the other integrations' kinds
    (Jobs, Deployments, JobSets, ...) are left out with those integrations."""
    groups = {g for rule in webhook.get("rules", []) for g in rule.get("apiGroups", [])}
    return bool(groups) and groups <= {"", KUEUE_GROUP}


def webhooks(module: Path, port: int, ca_pem: bytes) -> list[dict]:
    """Kueue's webhook configurations, renamed, pointed at 127.0.0.1:port."""
    bundle = base64.b64encode(ca_pem).decode()
    out = []
    path = module / "config" / "components" / "webhook" / "manifests.yaml"
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") not in WEBHOOK_NAMES:
            continue
        hooks = []
        for hook in doc["webhooks"]:
            if not _served_here(hook):
                continue
            path_ = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path_}", "caBundle": bundle}
            hook["timeoutSeconds"] = 10
            if any("" in rule.get("apiGroups", []) for rule in hook.get("rules", [])):
                hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL[0]: NAMESPACE_LABEL[1]}}
            hooks.append(hook)
        out.append(
            _labelled(
                {
                    "apiVersion": doc["apiVersion"],
                    "kind": doc["kind"],
                    "metadata": {"name": WEBHOOK_NAMES[doc["kind"]]},
                    "webhooks": hooks,
                }
            )
        )
    return out


def configuration(webhook_port: int, metrics_port: int, health_port: int, cert_dir: Path) -> dict:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL[0]: NAMESPACE_LABEL[1]}},
        "integrations": {"frameworks": ["pod"]},
    }


def make_certs(d: Path) -> bytes:
    """A CA and a serving certificate for 127.0.0.1 (tls.crt, tls.key: controller-runtime's names);
    the CA's PEM, for the webhooks' caBundle."""
    d.mkdir(parents=True, exist_ok=True)
    cluster.new_ca(
        d,
        "/CN=tfps-kueue-webhook-ca",
        2,
        "basicConstraints=critical,CA:TRUE",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )
    cluster.issue_leaf(d, "tls", "/CN=kueue-webhook", cluster.SERVER_EXT + "subjectAltName=IP:127.0.0.1\n", 2)
    return (d / "ca.crt").read_bytes()


def argv(kubeconfig: Path, config: Path, work: Path, certs: Path) -> list[str]:
    """Kueue in a private mount namespace whose /etc is an overlay holding the metrics certificate."""
    upper, scratch = work / "etc-upper", work / "etc-work"
    upper.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    setup = (
        f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={scratch} /etc"
        f" && mkdir -p {Path(METRICS_CERTS).parent} && ln -sfn {certs} {METRICS_CERTS}"
        f' && exec "$0" "$@"'
    )
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        setup,
        str(binary()),
        f"--kubeconfig={kubeconfig}",
        f"--config={config}",
        "--feature-gates=VisibilityOnDemand=false",
        "--zap-log-level=" + os.environ.get("TFPS_KUEUE_LOG_LEVEL", "2"),
    ]


# ---------------------------------------------------------------------------------------------
# Installing and removing


def remove_webhooks(kubeconfig: Path) -> None:
    for kind, name in WEBHOOK_NAMES.items():
        kubectl(kubeconfig, "delete", kind.lower(), name, "--ignore-not-found", "--wait=false", check=False)


def strip_finalizers(kubeconfig: Path) -> int:
    """Kueue's finalizer off every pod and every finalizer off Kueue's objects (Kueue is stopped:
    nobody else would remove them). The number of objects changed."""
    changed = 0
    for pod in _items(kubeconfig, "pods", "--all-namespaces", "-l", "kueue.x-k8s.io/managed=true"):
        meta = pod["metadata"]
        if POD_FINALIZER in (meta.get("finalizers") or []):
            keep = [f for f in meta["finalizers"] if f != POD_FINALIZER]
            patch = {"metadata": {"finalizers": keep, "resourceVersion": meta["resourceVersion"]}}
            changed += (
                kubectl(
                    kubeconfig,
                    "patch",
                    "pod",
                    "-n",
                    meta["namespace"],
                    meta["name"],
                    "--type=merge",
                    "-p",
                    json.dumps(patch),
                    check=False,
                ).returncode
                == 0
            )
    for crd in _items(kubeconfig, "crd", "-l", f"{OWNER_LABEL[0]}={OWNER_LABEL[1]}"):
        resource = crd["metadata"]["name"]
        for obj in _items(kubeconfig, resource, "--all-namespaces"):
            meta = obj["metadata"]
            if meta.get("finalizers"):
                where = ["-n", meta["namespace"]] if meta.get("namespace") else []
                changed += (
                    kubectl(
                        kubeconfig,
                        "patch",
                        resource,
                        *where,
                        meta["name"],
                        "--type=merge",
                        "-p",
                        '{"metadata":{"finalizers":null}}',
                        check=False,
                    ).returncode
                    == 0
                )
    return changed


def remove_crds(kubeconfig: Path) -> None:
    kubectl(
        kubeconfig,
        "delete",
        "crd",
        "-l",
        f"{OWNER_LABEL[0]}={OWNER_LABEL[1]}",
        "--ignore-not-found",
        "--timeout=60s",
        check=False,
    )


def down(kubeconfig: Path) -> None:
    """Everything a run installed, removed: webhooks first, then finalizers, then the CRDs."""
    remove_webhooks(kubeconfig)
    strip_finalizers(kubeconfig)
    remove_crds(kubeconfig)


def install_crds(kubeconfig: Path, module: Path) -> list[str]:
    """Kueue's CRDs the cluster lacks (one already there, not ours, is left alone); their names."""
    present = {c["metadata"]["name"] for c in _items(kubeconfig, "crd")}
    missing = [c for c in crds(module) if c["metadata"]["name"] not in present]
    if missing:
        _apply(kubeconfig, missing)
        for c in missing:
            kubectl(kubeconfig, "wait", "--for=condition=Established", "--timeout=60s", f"crd/{c['metadata']['name']}")
    return [c["metadata"]["name"] for c in missing]


def _ready(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _webhooks_answer(kubeconfig: Path) -> bool:
    """A server-side dry run of a ResourceFlavor goes through Kueue's mutating and validating webhooks."""
    flavor = {
        "apiVersion": f"{KUEUE_GROUP}/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "tfps-kueue-probe"},
    }
    return (
        kubectl(kubeconfig, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(flavor), check=False).returncode
        == 0
    )


@dataclass
class Kueue:
    proc: subprocess.Popen
    kubeconfig: Path
    log_path: Path
    metrics_port: int
    health_port: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _die_with_parent() -> None:
    """Kueue gets SIGTERM if this process dies without cleaning up (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _wait_ready(handle: Kueue, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (_ready(handle.health_port) and _webhooks_answer(handle.kubeconfig)):
        if handle.proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if handle.proc.poll() is not None else f"not ready after {timeout:.0f}s"
            raise RuntimeError(f"Kueue {why} (log: {handle.log_path}):\n{cluster.tail(handle.log_path)}")
        time.sleep(0.5)


@contextlib.contextmanager
def running(kubeconfig: str | Path, log_path: str | Path, timeout: float = 120) -> Iterator[Kueue]:
    """Kueue's CRDs, webhooks and manager, ready (its webhooks answer); all removed on exit."""
    kubeconfig, log_path = Path(kubeconfig).resolve(), Path(log_path).resolve()
    if not binary().exists():
        raise FileNotFoundError(f"{binary()} is missing: run hack/build-kueue.sh")
    work = log_path.with_suffix(".d")
    work.mkdir(parents=True, exist_ok=True)
    module = module_dir()
    remove_webhooks(kubeconfig)  # left by a run that was killed: they would point at nothing
    ports = [cluster.free_port() for _ in range(3)]
    certs = work / "certs"
    ca = make_certs(certs)
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(ports[0], ports[1], ports[2], certs)))
    try:
        install_crds(kubeconfig, module)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                argv(kubeconfig, config, work, certs),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        handle = Kueue(proc, kubeconfig, log_path, metrics_port=ports[1], health_port=ports[2])
        try:
            _apply(kubeconfig, webhooks(module, ports[0], ca))
            _wait_ready(handle, timeout)
            log.info("Kueue %s ready (pid %d, webhooks on 127.0.0.1:%d)", version(), proc.pid, ports[0])
            yield handle
        finally:
            remove_webhooks(kubeconfig)
            cluster.stop_child(proc, timeout=20)
    finally:
        strip_finalizers(kubeconfig)
        remove_crds(kubeconfig)


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/kueue.py", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["up", "down"])
    ap.add_argument("--state-dir", type=Path, default=cluster.state_dir())
    a = ap.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    kubeconfig = a.state_dir / "kubeconfig"
    if a.command == "down":
        down(kubeconfig)
        log.info("Kueue's webhooks, finalizers and CRDs removed")
        return 0
    # Ctrl-C, or a plain kill: either way the context manager's cleanup runs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with running(kubeconfig, a.state_dir / "logs" / "kueue.log"):
        log.info("label a namespace %s=%s for Kueue to manage its pods; Ctrl-C stops Kueue", *NAMESPACE_LABEL)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    log.info("Kueue stopped; its webhooks, finalizers and CRDs removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
