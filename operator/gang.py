"""Gang scheduling: a job's pods are bound all together or not at all, so two jobs that each
need most of the cluster never both start half-way and wait on each other for ever.

Pure builders for the three backends the chart can choose (`scheduling.gang`):
- `workload`: Kubernetes' own Workload API (scheduling.k8s.io/v1alpha1, alpha in 1.35, feature
  gates GenericWorkload and GangScheduling). One Workload per job; each gang pod points at it
  with `spec.workloadRef`. The default scheduler does the rest; no CRD, no other scheduler.
- `coscheduling`: scheduler-plugins' PodGroup (scheduling.x-k8s.io/v1alpha1) and its scheduler.
- `volcano`: Volcano's PodGroup (scheduling.volcano.sh/v1beta1) and the `volcano` scheduler.

The gang is every PS, worker and Chief; an Evaluator is not needed for training to go on and
is scheduled on its own. `minAvailable` defaults to the whole gang. A live scale-up adds pods to
the same group: the scheduler counts the members already bound towards the minimum, so the new
ones are bound as they fit and nothing running is disturbed.
"""

from __future__ import annotations

from typing import Any

from tfps.api.spec import ReplicaType, TrainingJob

from .config import GangBackend, SchedulingSettings
from .meta import job_labels, object_meta

GANG_TYPES = (ReplicaType.PS, ReplicaType.CHIEF, ReplicaType.WORKER)
WORKLOAD_API = ("scheduling.k8s.io", "v1alpha1", "workloads")
WORKLOAD_POD_GROUP = "training"  # the Workload's one gang pod group
COSCHEDULING_API = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_API = ("scheduling.volcano.sh", "v1beta1", "podgroups")
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"


def backend_for(job: TrainingJob, settings: SchedulingSettings) -> GangBackend:
    """The backend that gang-schedules this job, NONE when it is not gang-scheduled. AUTO must
    have been resolved when the operator started (`resolve`); an unresolved one means none."""
    wanted = settings.all_jobs or job.spec.run_policy.scheduling_policy is not None
    if not wanted or settings.gang is GangBackend.AUTO:
        return GangBackend.NONE
    return settings.gang


def resolve(settings: SchedulingSettings, workload_api_served: bool) -> SchedulingSettings:
    """AUTO becomes WORKLOAD when the API server serves the Workload API, else NONE."""
    if settings.gang is not GangBackend.AUTO:
        return settings
    return settings.model_copy(update={"gang": GangBackend.WORKLOAD if workload_api_served else GangBackend.NONE})


def min_available(job: TrainingJob) -> int:
    policy = job.spec.run_policy.scheduling_policy
    if policy is not None and policy.min_available is not None:
        return policy.min_available
    return sum(job.spec.replicas(t) for t in GANG_TYPES)


def group_object(job: TrainingJob, backend: GangBackend) -> dict[str, Any] | None:
    """The Workload or PodGroup the job's pods name; None without gang scheduling."""
    policy = job.spec.run_policy.scheduling_policy
    meta = object_meta(job, job.name, job_labels(job))
    if backend is GangBackend.WORKLOAD:
        group, version, _ = WORKLOAD_API
        spec: dict[str, Any] = {
            "controllerRef": {"apiGroup": job.api_version.split("/")[0], "kind": job.kind, "name": job.name},
            "podGroups": [{"name": WORKLOAD_POD_GROUP, "policy": {"gang": {"minCount": min_available(job)}}}],
        }
        return {"apiVersion": f"{group}/{version}", "kind": "Workload", "metadata": meta, "spec": spec}
    if backend is GangBackend.COSCHEDULING:
        group, version, _ = COSCHEDULING_API
        spec = {"minMember": min_available(job)}
        if policy is not None and policy.schedule_timeout_seconds is not None:
            spec["scheduleTimeoutSeconds"] = policy.schedule_timeout_seconds
        return {"apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": meta, "spec": spec}
    if backend is GangBackend.VOLCANO:
        group, version, _ = VOLCANO_API
        spec = {"minMember": min_available(job)}
        if policy is not None and policy.queue:
            spec["queue"] = policy.queue
        if policy is not None and policy.priority_class:
            spec["priorityClassName"] = policy.priority_class
        return {"apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": meta, "spec": spec}
    return None


def apply_to_pod(
    pod: dict[str, Any], job: TrainingJob, rtype: ReplicaType, settings: SchedulingSettings
) -> dict[str, Any]:
    """The pod with its gang membership, scheduler and priority class filled in (in place)."""
    policy = job.spec.run_policy.scheduling_policy
    spec = pod["spec"]
    if policy is not None and policy.priority_class:
        spec.setdefault("priorityClassName", policy.priority_class)
    backend = backend_for(job, settings)
    if backend is GangBackend.NONE or rtype not in GANG_TYPES:
        return pod
    if backend is GangBackend.WORKLOAD:
        spec["workloadRef"] = {"name": job.name, "podGroup": WORKLOAD_POD_GROUP}
        return pod
    spec.setdefault("schedulerName", settings.scheduler_for(backend))
    if backend is GangBackend.COSCHEDULING:
        pod["metadata"]["labels"][COSCHEDULING_LABEL] = job.name
    else:
        pod["metadata"].setdefault("annotations", {})[VOLCANO_ANNOTATION] = job.name
    return pod
