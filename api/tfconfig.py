"""TF_CONFIG (TFJob's shape): written for every replica by the operator and `tfps local`,
read back by the PS and worker processes. Custom TF programs read the same variable."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .naming import ENV_TF_CONFIG, GRPC_PORT, dns_name
from .spec import ReplicaType, TrainingJobSpec

# Evaluators do not take part in training, so (as in TFJob) they are not in `cluster`.
CLUSTER_TYPES = (ReplicaType.CHIEF, ReplicaType.PS, ReplicaType.WORKER)


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
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClusterConfig:
        raw = (os.environ if env is None else env).get(ENV_TF_CONFIG)
        if not raw:
            raise ValueError(f"{ENV_TF_CONFIG} is not set")
        data = json.loads(raw)
        return cls(cluster=data["cluster"], task_type=data["task"]["type"], task_index=int(data["task"]["index"]))
