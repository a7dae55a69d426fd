"""The operator benchmark's anchor: Kubeflow's training-operator v1.8.1 running TFJobs, out of
cluster, on the same control plane. Built from its Go module into the cache by
hack/build-training-operator.sh (its code never enters this repository): stock, and a build
with two flags added for its client's QPS and burst.

How v1.8.1 runs outside a cluster: `--enable-scheme=tfjob --namespace=NS` with
MY_POD_NAMESPACE set; a Secret `training-operator-webhook-cert` in that namespace and a
serving certificate in /tmp/k8s-webhook-server/serving-certs (its hard-coded folder;
self-signed: with no webhook configuration the API server never calls it); the TFJob CRD
from the module's manifests/base/crds/.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

VERSION = "v1.8.1"
MODULE = "github.com/kubeflow/training-operator"
GROUP, API_VERSION, PLURAL = "kubeflow.org", "v1", "tfjobs"
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")
SECRET = "training-operator-webhook-cert"
SERVICE = "training-operator"
# The raised build's flags: the limits that the earlier measurement used.
RAISED_ARGS = ("--kube-api-qps=1000", "--kube-api-burst=2000", "--controller-threads=4")


def cache_dir() -> Path:
    return Path(os.environ.get("TFPS_CACHE") or Path.home() / ".cache" / "tfps") / "bench"


def binary(raised: bool) -> Path:
    return cache_dir() / f"training-operator-{VERSION}{'-raised' if raised else ''}" / "training-operator"


def crd_path() -> Path:
    """The TFJob CRD in the Go module cache (`go mod download` puts the module there)."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
        cwd=tempfile.gettempdir(),
    )
    return Path(json.loads(out.stdout)["Dir"]) / "manifests" / "base" / "crds" / "kubeflow.org_tfjobs.yaml"


def install_crd(kubectl: str, kubeconfig: str, path: Path | None = None, name: str = f"{PLURAL}.{GROUP}") -> None:
    """Apply a CRD (the TFJob one unless `path` is given) and wait until it is Established."""
    subprocess.run(
        [
            kubectl,
            f"--kubeconfig={kubeconfig}",
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            str(path or crd_path()),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    for _ in range(30):  # kubectl's discovery may not list it yet right after the apply
        if (
            subprocess.run(
                [
                    kubectl,
                    f"--kubeconfig={kubeconfig}",
                    "wait",
                    "--for=condition=Established",
                    "--timeout=60s",
                    f"crd/{name}",
                ],
                capture_output=True,
                text=True,
            ).returncode
            == 0
        ):
            return
        time.sleep(1)
    raise RuntimeError(f"the CRD {name} is not Established")


def replica_specs(ps: int, workers: int, templates: dict[str, dict]) -> dict[str, dict]:
    """`ps` PS and `workers` workers with the given pod templates (by replica type), restarted on
    failure: the same in a TFJob's tfReplicaSpecs as in a TrainingJob's replicaSpecs."""
    return {
        rtype: {"replicas": n, "restartPolicy": "OnFailure", "template": copy.deepcopy(templates[rtype])}
        for rtype, n in (("PS", ps), ("Worker", workers))
        if n
    }


def tfjob(
    name: str, ps: int, workers: int, templates: dict[str, dict], clean_pod_policy: str = "Running"
) -> dict[str, Any]:
    """A TFJob of `ps` PS and `workers` workers with the given pod templates (by replica type)."""
    specs = replica_specs(ps, workers, templates)
    return {
        "apiVersion": f"{GROUP}/{API_VERSION}",
        "kind": "TFJob",
        "metadata": {"name": name},
        "spec": {"tfReplicaSpecs": specs, "runPolicy": {"cleanPodPolicy": clean_pod_policy}},
    }


def phase(status: dict | None) -> str | None:
    """A TFJob's phase, as tfps names them: the last condition that is true (Created, Running,
    Restarting, Succeeded, Failed)."""
    true = [c["type"] for c in (status or {}).get("conditions") or [] if c.get("status") == "True"]
    return true[-1] if true else None


def _self_signed(ns: str, workdir: Path) -> dict[str, bytes]:
    """A CA and a serving certificate for the webhook Service's name, valid ten years (the
    rotator keeps a certificate that is valid for long enough)."""
    dns = f"{SERVICE}.{ns}.svc"

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=workdir)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-subj",
        "/CN=bench-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={dns}", "-keyout", "tls.key", "-out", "tls.csr")
    (workdir / "san.ext").write_text(f"subjectAltName=DNS:{dns},DNS:{SERVICE}.{ns}.svc.cluster.local\n")
    run(
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        "san.ext",
        "-out",
        "tls.crt",
    )
    return {name: (workdir / name).read_bytes() for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")}


def prepare_namespace(core, ns: str) -> None:
    """The webhook Secret in `ns` and the same certificate in the hard-coded serving folder."""
    with tempfile.TemporaryDirectory(prefix="tfps-bench-to-cert-") as tmp:
        files = _self_signed(ns, Path(tmp))
    core.create_namespaced_secret(
        ns,
        {
            "metadata": {"name": SECRET},
            "type": "Opaque",
            "data": {k: base64.b64encode(v).decode() for k, v in files.items()},
        },
    )
    CERT_DIR.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (CERT_DIR / name).write_bytes(data)


def argv(ns: str, raised: bool, webhook_port: int) -> list[str]:
    args = [
        str(binary(raised)),
        "--enable-scheme=tfjob",
        f"--namespace={ns}",
        "--metrics-bind-address=0",
        "--health-probe-bind-address=0",
        f"--webhook-server-port={webhook_port}",
        "--zap-log-level=info",
    ]
    return args + list(RAISED_ARGS if raised else ())


def env(ns: str, kubeconfig: str) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": kubeconfig, "MY_POD_NAMESPACE": ns}
