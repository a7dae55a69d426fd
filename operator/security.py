"""Pure builders of each job's security objects, and what they add to its pods.

- The job's Secret `<job>-tfps-auth`: a random bearer token and a per-job CA + certificate
  (runtime/pki.py) valid for `*.<job>.<ns>.svc`. Created once, when the job has no pods at
  all, so a running pod never sees its token change; owned by the job.
- Every pod of the job mounts it read-only at AUTH_MOUNT_PATH and finds the token file in
  $TFPS_AUTH_TOKEN_FILE (runtime/auth.py reads it; the PS refuses calls without it).
- The job's NetworkPolicy `<job>-tfps`: selects every pod of the job and admits its gRPC
  port only from pods of the same job (same namespace, label tfps.io/job-name), and its
  metrics port from the peers in config.networkPolicy.metricsFrom (empty: from anywhere,
  so that Prometheus and the operator's progress reader can scrape). Pods' DNS and egress
  are untouched (only Ingress is restricted).
"""

from __future__ import annotations

import base64
import copy
from typing import Any

from tfps.api import naming
from tfps.api.spec import ReplicaType, TrainingJob
from tfps.runtime import pki

from .config import OperatorConfig
from .meta import object_meta

AUTH_VOLUME = "tfps-auth"
AUTH_MOUNT_PATH = "/var/run/tfps/auth"
AUTH_FILE_MODE = 0o440  # owner and group (fsGroup): the container's user, nobody else


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def build_auth_secret(job: TrainingJob, token: str, tls: pki.TlsMaterial) -> dict[str, Any]:
    """The job's Secret from its material (random parts are the caller's: see new_auth_secret)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": object_meta(job, naming.auth_secret_name(job.name)),
        # Pods read it through a volume; nobody edits it (kubelets need not watch it either).
        "immutable": True,
        "data": {
            naming.TOKEN_KEY: _b64(token.encode()),
            naming.CA_KEY: _b64(tls.ca_crt),
            naming.CERT_KEY: _b64(tls.tls_crt),
            naming.KEY_KEY: _b64(tls.tls_key),
        },
    }


def new_auth_secret(job: TrainingJob) -> dict[str, Any]:
    """A fresh token and certificate for `job` (always both: turning spec.training.tls on
    later needs no new Secret)."""
    tls = pki.issue(f"{job.name}.{job.namespace}", pki.job_dns_names(job.name, job.namespace))
    return build_auth_secret(job, pki.new_token(), tls)


def build_network_policy(job: TrainingJob, config: OperatorConfig) -> dict[str, Any]:
    same_job = {"podSelector": {"matchLabels": naming.job_selector(job.name)}}
    metrics_rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": config.ports.metrics}]}
    if config.network_policy.metrics_from:
        metrics_rule["from"] = copy.deepcopy(config.network_policy.metrics_from)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, naming.network_policy_name(job.name)),
        "spec": {
            "podSelector": {"matchLabels": naming.job_selector(job.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [same_job],
                    "ports": [
                        {"protocol": "TCP", "port": config.ports.grpc},
                        {"protocol": "TCP", "port": config.ports.data},
                    ],
                },
                metrics_rule,
            ],
        },
    }


def job_objects(job: TrainingJob, config: OperatorConfig) -> list[dict[str, Any]]:
    """What must exist before the job's first pod: its Secret (and NetworkPolicy)."""
    objects = [new_auth_secret(job)]
    if config.network_policy.enabled:
        objects.append(build_network_policy(job, config))
    return objects


def creates_every_pod(job: TrainingJob, create: list[tuple[ReplicaType, int]]) -> bool:
    """True when none of the job's pods exist: the only time its Secret may be (re)created."""
    return len(create) == sum(job.spec.replicas(t) for t in ReplicaType)


def secure_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """Mount the job's Secret into the pod's `tensorflow` container and name the token file
    in its environment; the pod gets no API token (the runtime never calls the API)."""
    job = pod["metadata"]["labels"][naming.LABEL_JOB]
    spec = pod["spec"]
    spec.setdefault("automountServiceAccountToken", False)
    volume = {
        "name": AUTH_VOLUME,
        "secret": {"secretName": naming.auth_secret_name(job), "defaultMode": AUTH_FILE_MODE},
    }
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v.get("name") != AUTH_VOLUME] + [volume]
    for c in spec["containers"]:
        if c.get("name") != naming.CONTAINER_NAME:
            continue
        mounts = [m for m in c.get("volumeMounts") or [] if m.get("name") != AUTH_VOLUME]
        c["volumeMounts"] = mounts + [{"name": AUTH_VOLUME, "mountPath": AUTH_MOUNT_PATH, "readOnly": True}]
        env = [e for e in c.get("env") or [] if e.get("name") != naming.ENV_AUTH_TOKEN_FILE]
        c["env"] = env + [{"name": naming.ENV_AUTH_TOKEN_FILE, "value": f"{AUTH_MOUNT_PATH}/{naming.TOKEN_KEY}"}]
    return pod
