"""Names, label keys and the limits derived from them: the one place they are spelled.

Pod names come from the runtime (`tfconfig.pod_name`: `<job>-<type>-<i>`); the Service is
named after the job. The longest child name decides how long a job name may be.
"""
from __future__ import annotations

from tfps.runtime.spec import API_GROUP, ReplicaType
from tfps.runtime.tfconfig import pod_name

LABEL_JOB = f"{API_GROUP}/job-name"
LABEL_TYPE = f"{API_GROUP}/replica-type"
LABEL_INDEX = f"{API_GROUP}/replica-index"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "tfps-operator"

CONTAINER_NAME = "tensorflow"  # TFJob's convention
GRPC_PORT_NAME = "tfps"
DATA_PORT_NAME = "tfps-data"  # a PS's data path (runtime/datapath.py)
METRICS_PORT_NAME = "metrics"
GPU_RESOURCE = "nvidia.com/gpu"

MAX_REPLICAS = 1000  # per replica type; the CRD's `maximum` is this value
DNS_LABEL_MAX = 63
# `<job>-evaluator-999` is the longest child name (hostname and label value: 63 max).
_LONGEST_TYPE = max((t.task_type for t in ReplicaType), key=len)
MAX_JOB_NAME_LENGTH = DNS_LABEL_MAX - len(f"--{_LONGEST_TYPE}") - len(str(MAX_REPLICAS - 1))
# The job name is also the headless Service's name, so it must be a DNS-1035 label.
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def service_name(job: str) -> str:
    return job


def auth_secret_name(job: str) -> str:
    """The job's Secret: its bearer token and TLS material (operator/security.py)."""
    return f"{job}-tfps-auth"


def network_policy_name(job: str) -> str:
    return f"{job}-tfps"


def child_pod_name(job: str, rtype: ReplicaType, index: int) -> str:
    return pod_name(job, rtype, index)


def job_selector(job: str) -> dict[str, str]:
    return {LABEL_JOB: job}


def replica_labels(job: str, rtype: ReplicaType, index: int) -> dict[str, str]:
    return {
        LABEL_JOB: job,
        LABEL_TYPE: rtype.task_type,
        LABEL_INDEX: str(index),
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def replica_type_of(task_type: str) -> ReplicaType:
    """`worker` -> ReplicaType.WORKER (the pod label's value back to the spec's key)."""
    for rtype in ReplicaType:
        if rtype.task_type == task_type:
            return rtype
    raise ValueError(f"unknown replica type label {task_type!r}")
