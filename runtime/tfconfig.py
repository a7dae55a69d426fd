"""Pod names, DNS names and TF_CONFIG (TFJob's shape), defined once.

`<job>-<type>-<i>` is each pod's name and hostname; with `subdomain: <job>` and the job's
headless Service its DNS name is `<job>-<type>-<i>.<job>.<ns>.svc`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from .spec import ReplicaType, TrainingJobSpec

GRPC_PORT = 2222
DATA_PORT = 2223  # a PS's data path (runtime/datapath.py)
METRICS_PORT = 9090
# Evaluators do not take part in training, so (as in TFJob) they are not in `cluster`.
CLUSTER_TYPES = (ReplicaType.CHIEF, ReplicaType.PS, ReplicaType.WORKER)

ENV_TF_CONFIG = "TF_CONFIG"
ENV_JOB_NAME = "TFPS_JOB_NAME"
ENV_NAMESPACE = "TFPS_NAMESPACE"
ENV_TRAINING = "TFPS_TRAINING"  # JSON of spec.training (manifest field names)
ENV_BIND_ADDRESS = "TFPS_BIND_ADDRESS"  # the pod IP, from the downward API
ENV_METRICS_PORT = "TFPS_METRICS_PORT"
ENV_DATA_PORT = "TFPS_DATA_PORT"  # PS: the data path's port; 0 or unset: any free port; "off": none


def pod_name(job: str, rtype: ReplicaType, index: int) -> str:
    return f"{job}-{rtype.task_type}-{index}"


def dns_name(job: str, namespace: str, rtype: ReplicaType, index: int) -> str:
    return f"{pod_name(job, rtype, index)}.{job}.{namespace}.svc"


def cluster_spec(
    spec: TrainingJobSpec,
    address: Callable[[ReplicaType, int], str],
) -> dict[str, list[str]]:
    return {
        rtype.task_type: [address(rtype, i) for i in range(spec.replicas(rtype))]
        for rtype in CLUSTER_TYPES
        if spec.replicas(rtype) > 0
    }


def tf_config(
    job: str,
    namespace: str,
    spec: TrainingJobSpec,
    rtype: ReplicaType,
    index: int,
    address: Callable[[ReplicaType, int], str] | None = None,
) -> dict:
    """TF_CONFIG for one replica. `address` defaults to the pods' DNS names on GRPC_PORT;
    `tfps local` passes loopback addresses instead."""
    if address is None:
        address = lambda t, i: f"{dns_name(job, namespace, t, i)}:{GRPC_PORT}"  # noqa: E731
    return {
        "cluster": cluster_spec(spec, address),
        "task": {"type": rtype.task_type, "index": index},
        "environment": "cloud",
    }


@dataclass(frozen=True)
class ClusterConfig:
    """TF_CONFIG as read back by a PS or worker process."""

    cluster: dict[str, list[str]]
    task_type: str
    task_index: int

    @property
    def ps(self) -> list[str]:
        return self.cluster.get("ps", [])

    @property
    def workers(self) -> list[str]:
        return self.cluster.get("worker", [])

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "ClusterConfig":
        env = os.environ if env is None else env
        raw = env.get(ENV_TF_CONFIG)
        if not raw:
            raise ValueError(f"{ENV_TF_CONFIG} is not set")
        data = json.loads(raw)
        return cls(cluster=data["cluster"], task_type=data["task"]["type"], task_index=int(data["task"]["index"]))
