"""Every name two parts of tfps must agree on, spelled once: label keys, ports and their
names, environment variables, and the names of a job's objects.

`<job>-<type>-<i>` is each pod's name and hostname; with `subdomain: <job>` and the job's
headless Service its DNS name is `<job>-<type>-<i>.<job>.<ns>.svc`. The longest child name
decides how long a job name may be.
"""

from __future__ import annotations

from .spec import API_GROUP, ReplicaType

LABEL_JOB = f"{API_GROUP}/job-name"
LABEL_TYPE = f"{API_GROUP}/replica-type"
LABEL_INDEX = f"{API_GROUP}/replica-index"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "tfps-operator"

CONTAINER_NAME = "tensorflow"  # TFJob's convention
GPU_RESOURCE = "nvidia.com/gpu"

# Ports, and their names in pod specs.
GRPC_PORT = 2222  # TF_CONFIG's addresses
DATA_PORT = 2223  # a PS's data path (runtime/datapath.py)
METRICS_PORT = 9090
GRPC_PORT_NAME = "tfps"
DATA_PORT_NAME = "tfps-data"
METRICS_PORT_NAME = "metrics"

# What the operator (and `tfps local`) put in every replica's environment.
ENV_TF_CONFIG = "TF_CONFIG"
ENV_JOB_NAME = "TFPS_JOB_NAME"
ENV_NAMESPACE = "TFPS_NAMESPACE"
ENV_TRAINING = "TFPS_TRAINING"  # JSON of spec.training (manifest field names)
ENV_BIND_ADDRESS = "TFPS_BIND_ADDRESS"  # where a replica listens (default every address; tfps local: loopback)
ENV_METRICS_PORT = "TFPS_METRICS_PORT"
ENV_DATA_PORT = "TFPS_DATA_PORT"  # PS: the data path's port; 0 or unset: any free port; "off": none
ENV_AUTH_TOKEN_FILE = "TFPS_AUTH_TOKEN_FILE"  # the job's bearer token, mounted from its Secret
# Keys of the job's Secret = file names in its mounted folder (the operator writes, the PS reads).
TOKEN_KEY, CA_KEY, CERT_KEY, KEY_KEY = "token", "ca.crt", "tls.crt", "tls.key"
# Knobs a process reads from its environment (api/settings.py), with their defaults there.
ENV_RESULT_FILE = "TFPS_RESULT_FILE"  # the reporting replica writes its final JSON result here (tfps local)
ENV_TERMINATION_LOG = "TFPS_TERMINATION_LOG"  # in a pod: where the termination message goes
ENV_RETRY_SECONDS = "TFPS_PS_RETRY_SECONDS"  # how long workers retry an unavailable PS
ENV_WORKER_TIMEOUT = "TFPS_WORKER_TIMEOUT_SECONDS"  # PS: silence after which a worker is not live
ENV_INTRA_OP_THREADS = "TFPS_INTRA_OP_THREADS"  # TensorFlow threads per pool (intra- and inter-op)
ENV_DATA_PATH = "TFPS_DATA_PATH"  # worker: "0" sends Steps over gRPC even when a PS offers a data port
ENV_PIPELINE = "TFPS_PIPELINE"  # "0": async workers wait for each push before computing on
ENV_SCHED_BATCH = "TFPS_SCHED_BATCH"  # "0": keep the scheduling policy the process started with, not SCHED_BATCH
ENV_CRASH_AT = "TFPS_TEST_CHECKPOINT_CRASH_AT"  # tests only: crash while writing this step's checkpoint
ENV_OPERATOR_CONFIG = "TFPS_OPERATOR_CONFIG"  # the operator's configuration file (Helm values)

MAX_REPLICAS = 1000  # per replica type; the CRD's `maximum` is this value
DNS_LABEL_MAX = 63
# `<job>-evaluator-999` is the longest child name (hostname and label value: 63 max).
_LONGEST_TYPE = max((t.task_type for t in ReplicaType), key=len)
MAX_JOB_NAME_LENGTH = DNS_LABEL_MAX - len(f"--{_LONGEST_TYPE}") - len(str(MAX_REPLICAS - 1))
# The job name is also the headless Service's name, so it must be a DNS-1035 label.
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def pod_name(job: str, rtype: ReplicaType, index: int) -> str:
    return f"{job}-{rtype.task_type}-{index}"


def dns_name(job: str, namespace: str, rtype: ReplicaType, index: int) -> str:
    return f"{pod_name(job, rtype, index)}.{job}.{namespace}.svc"


def service_name(job: str) -> str:
    return job


def auth_secret_name(job: str) -> str:
    """The job's Secret: its bearer token and TLS material (operator/security.py)."""
    return f"{job}-tfps-auth"


def network_policy_name(job: str) -> str:
    return f"{job}-tfps"


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
