"""Queueing with Kueue through its plain pod groups: what the operator adds to a job's pods, and
what it must do to them before it deletes any, so that Kueue's quota follows the job. Pure: the
job, the operator's config and the pods' dicts in; labels, annotations and merge patches out.

Kueue (its `pod` integration, on in the job's namespace) gates every pod that carries
`QUEUE_LABEL`; the pods that share `GROUP_LABEL` form one Workload (named after the group) of
`TOTAL_COUNT` pods, admitted as a whole when its ClusterQueue has quota for all of them; then
Kueue lifts the gate and the scheduler places them. No Go and no Kueue types in tfps: only these
labels and annotations, as Kueue's "Run Plain Pods" task and its pod webhook define them.

Kueue ends a group's Workload (and frees its quota) when as many pods succeeded as the group
counts, or, once one pod carries `RETRIABLE: "false"`, when no pod of the group is still active.
A TrainingJob's PS pods never succeed: the operator deletes them when the job ends. So:
- when the job has finished (or is suspended, or deleted) every pod of the group is marked
  `RETRIABLE: "false"` before any is deleted: the group then ends when its last pod stops;
- a pod the operator deletes while it still runs (a PS at the end, every pod on suspension) or
  deletes to recreate it under the same name (a restart) loses Kueue's finalizer first: Kueue
  would hold a failed pod until its replacement exists, and the replacement has the same name.
  Without the finalizer the pod still goes only when its kubelet has stopped it.

The group is one per job incarnation: the job's uid and its status.startTime (set when its pods
are first created, and anew when it resumes from suspension). Kueue fixes a group's size, so the
replicas of a queued job change through suspend, edit, resume: the resumed job is a new group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Any

from tfps.api import naming, semantics
from tfps.api.spec import TrainingJob

from .config import OperatorConfig
from .status import FINISHED, SUSPENDED

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
# What Kueue's webhook adds to the pods it manages (read, never written, by the operator).
FINALIZER = "kueue.x-k8s.io/managed"
SCHEDULING_GATE = "kueue.x-k8s.io/admission"
KUEUE = "kueue"
# Job phases after which no pod of the group will be replaced.
ENDING = (*FINISHED, SUSPENDED)
_TERMINAL = ("Succeeded", "Failed")
_SUFFIX = 10  # hex digits of the incarnation's digest in the group's name


def enabled(config: OperatorConfig) -> bool:
    return config.scheduling.queueing == KUEUE


def queue_name(job: TrainingJob) -> str | None:
    """spec.runPolicy.schedulingPolicy.queue, else the job's own `kueue.x-k8s.io/queue-name` label."""
    policy = job.spec.run_policy.scheduling_policy
    if policy is not None and policy.queue:
        return policy.queue
    return (job.metadata.get("labels") or {}).get(QUEUE_LABEL) or None


def group_name(job: TrainingJob, start_time: str) -> str:
    """`<job>-<digest of uid and start time>`: a label value (63 characters at most) and the name
    of Kueue's Workload (a DNS subdomain), unique to this incarnation of this job."""
    digest = hashlib.sha256(f"{job.metadata.get('uid', '')}/{start_time}".encode()).hexdigest()[:_SUFFIX]
    prefix = job.name[: naming.DNS_LABEL_MAX - _SUFFIX - 1].rstrip("-.")
    return f"{prefix}-{digest}"


def pod_metadata(job: TrainingJob, config: OperatorConfig, start_time: str) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations each pod of the job gets; none when queueing is off or the job
    names no queue (then Kueue leaves its pods alone)."""
    queue = queue_name(job) if enabled(config) else None
    if not queue:
        return {}, {}
    labels = {QUEUE_LABEL: queue, GROUP_LABEL: group_name(job, start_time)}
    return labels, {TOTAL_COUNT: str(len(semantics.replicas(job.spec)))}


def label_pods(
    pods: list[dict[str, Any]], job: TrainingJob, config: OperatorConfig, start_time: str
) -> list[dict[str, Any]]:
    """The built pods with pod_metadata added (the operator's labels win over none of Kueue's)."""
    labels, annotations = pod_metadata(job, config, start_time)
    if not labels:
        return pods
    for pod in pods:
        meta = pod["metadata"]
        meta["labels"] = {**meta.get("labels", {}), **labels}
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    return pods


def _owned(pod: dict[str, Any], job_uid: str) -> bool:
    return any(o.get("uid") == job_uid for o in pod["metadata"].get("ownerReferences") or [])


def release_patches(
    pods: list[dict[str, Any]],
    job_uid: str,
    *,
    ending: bool,
    restart: Collection[str] = (),
    delete: Collection[str] = (),
) -> list[tuple[str, dict[str, Any]]]:
    """(pod name, merge patch) to send before the pods in `restart` and `delete` are deleted.
    `ending`: the job finished, is suspended or is deleted, so no pod of its group comes back."""
    patches = []
    for pod in pods:
        meta = pod["metadata"]
        if GROUP_LABEL not in (meta.get("labels") or {}) or not _owned(pod, job_uid):
            continue
        patch: dict[str, Any] = {}
        if ending and (meta.get("annotations") or {}).get(RETRIABLE) != "false":
            patch["annotations"] = {RETRIABLE: "false"}
        finalizers = meta.get("finalizers") or []
        still_running = (pod.get("status") or {}).get("phase") not in _TERMINAL
        if FINALIZER in finalizers and (meta["name"] in restart or (meta["name"] in delete and still_running)):
            # A merge patch replaces the whole list: the resourceVersion makes it fail (and the
            # pass retry) rather than drop a finalizer someone added meanwhile.
            patch["finalizers"] = [f for f in finalizers if f != FINALIZER]
            patch["resourceVersion"] = meta.get("resourceVersion")
        if patch:
            patches.append((meta["name"], {"metadata": patch}))
    return patches


def ending(phase: str | None) -> bool:
    return phase in ENDING
