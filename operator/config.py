"""Operator configuration: pod defaults (images, ports, resources, security) and timings.

Read from a YAML file (the Helm chart mounts its values there) named by `--config` or
$TFPS_OPERATOR_CONFIG; every field has a default, so no file is needed to start.
Field names are camelCase, as in the chart's values.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from tfps.api.naming import DATA_PORT, ENV_OPERATOR_CONFIG, GRPC_PORT, METRICS_PORT
from tfps.api.spec import ReplicaType


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Images(_Model):
    ps: str = "tfps/ps:0.1.0"
    worker: str = "tfps/worker:0.1.0"  # also Chief and Evaluator
    pull_policy: str = "IfNotPresent"

    def for_type(self, rtype: ReplicaType) -> str:
        return self.ps if rtype is ReplicaType.PS else self.worker


class Ports(_Model):
    grpc: int = Field(GRPC_PORT, ge=1, le=65535)
    data: int = Field(DATA_PORT, ge=1, le=65535)
    metrics: int = Field(METRICS_PORT, ge=1, le=65535)


def _default_resources() -> dict[ReplicaType, dict[str, Any]]:
    return {
        ReplicaType.PS: {"requests": {"cpu": "500m", "memory": "1Gi"}},
        ReplicaType.WORKER: {"requests": {"cpu": "1", "memory": "2Gi"}},
        ReplicaType.CHIEF: {"requests": {"cpu": "1", "memory": "2Gi"}},
        ReplicaType.EVALUATOR: {"requests": {"cpu": "500m", "memory": "1Gi"}},
    }


def _default_pod_security() -> dict[str, Any]:
    # uid/gid 10001: the USER of images/ps and images/worker.
    return {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _default_container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


class NetworkPolicySettings(_Model):
    # One NetworkPolicy per job: gRPC only from the job's own pods (operator/security.py).
    enabled: bool = True
    # NetworkPolicyPeers admitted to the metrics port (e.g. [{namespaceSelector: ...}]);
    # empty: from anywhere. Must admit Prometheus and the operator (it reads PS metrics).
    metrics_from: list[dict[str, Any]] = Field(default_factory=list)


class GangBackend(StrEnum):
    AUTO = "auto"  # Kubernetes' Workload API when the API server serves it, else none
    WORKLOAD = "workload"  # scheduling.k8s.io/v1alpha1 Workload + the kube-scheduler's GangScheduling plugin
    COSCHEDULING = "coscheduling"  # scheduler-plugins' PodGroup (scheduling.x-k8s.io/v1alpha1)
    VOLCANO = "volcano"  # Volcano's PodGroup (scheduling.volcano.sh/v1beta1)
    NONE = "none"


class Queueing(StrEnum):
    NONE = "none"
    KUEUE = "kueue"  # Kueue's plain pod groups (labels and an annotation on every pod)


# The scheduler each PodGroup backend's pods go to, unless `schedulerName` says otherwise.
DEFAULT_SCHEDULERS = {GangBackend.COSCHEDULING: "scheduler-plugins-scheduler", GangBackend.VOLCANO: "volcano"}


class SchedulingSettings(_Model):
    gang: GangBackend = GangBackend.AUTO
    # Gang-schedule every job, as TFJob does with a gang scheduler; otherwise only the jobs
    # that set spec.runPolicy.schedulingPolicy.
    all_jobs: bool = False
    scheduler_name: str | None = None
    queueing: Queueing = Queueing.NONE

    def scheduler_for(self, backend: GangBackend) -> str | None:
        return self.scheduler_name or DEFAULT_SCHEDULERS.get(backend)


class OperatorConfig(_Model):
    images: Images = Field(default_factory=Images)
    ports: Ports = Field(default_factory=Ports)
    # Per replica type, used when the user's template gives the container no resources.
    resources: dict[ReplicaType, dict[str, Any]] = Field(default_factory=_default_resources)
    pod_security_context: dict[str, Any] = Field(default_factory=_default_pod_security)
    container_security_context: dict[str, Any] = Field(default_factory=_default_container_security)
    # With a read-only root filesystem, TensorFlow still needs a writable /tmp.
    tmp_volume: bool = True
    network_policy: NetworkPolicySettings = Field(default_factory=NetworkPolicySettings)
    # Seconds between resyncs of a job when nothing happened (events wake it sooner).
    resync_seconds: float = Field(30.0, gt=0)
    # Seconds between reads of the PS pods' metrics for status.progress.
    progress_seconds: float = Field(10.0, gt=0)
    # Grace period of the pods a finished job still has: a program that ignores SIGTERM (PID 1 in its
    # container) must not hold its CPUs and GPUs for the pod's whole default grace period.
    finished_pod_grace_seconds: int = Field(2, ge=0)
    # Threads doing API calls for reconciles (jobs are reconciled concurrently).
    reconcile_workers: int = Field(16, ge=1)
    scheduling: SchedulingSettings = Field(default_factory=SchedulingSettings)

    @classmethod
    def load(cls, path: str | Path | None = None) -> OperatorConfig:
        path = path or os.environ.get(ENV_OPERATOR_CONFIG)
        if not path:
            return cls()
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
        return cls.model_validate(data)
