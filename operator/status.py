"""Pure status helpers: what the pods say, counts by replica type, TFJob-style conditions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tfps.api import naming
from tfps.api.spec import ReplicaType, TrainingJobSpec

# Phases (status.phase) and condition types (TFJob's).
PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED = (
    "Pending",
    "Running",
    "Restarting",
    "Succeeded",
    "Failed",
    "Suspended",
)
CREATED = "Created"
PHASES = (PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED)
FINISHED = (SUCCEEDED, FAILED)


class Reason:
    """The reasons of conditions and Events, in one place (TFJob's names where it has them)."""

    INVALID_SPEC = "InvalidSpec"
    CREATED = "TrainingJobCreated"
    CREATED_EVENT = "Created"
    CREATED_PODS = "CreatedPods"
    RUNNING = "TrainingJobRunning"
    ALL_PODS_RUNNING = "AllPodsRunning"
    SUCCEEDED = "TrainingJobSucceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    POD_RESTARTING = "PodRestarting"
    POD_RESTARTED = "PodRestarted"
    SCALED_DOWN = "ScaledDown"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    TTL_EXPIRED = "TTLExpired"
    UNSCHEDULABLE = "Unschedulable"
    MODEL_LOAD_FAILED = "ModelLoadFailed"  # the user's model did not import or build: no restart fixes it
    SCHEDULING_GATED = "SchedulingGated"  # the pods' own PodScheduled reason: e.g. Kueue has not admitted them

    @staticmethod
    def replica_failed(rtype: ReplicaType) -> str:
        """`WorkerFailed`, `PSFailed`, ...: a replica failed in a way its restartPolicy does not retry."""
        return f"{rtype.value}Failed"


def timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def unschedulable_reason(status: dict[str, Any]) -> str | None:
    """The scheduler's message while it cannot place the pod whose `status` this is, else None."""
    return next(
        (
            c.get("message") or "no node fits"
            for c in status.get("conditions") or []
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        ),
        None,
    )


def scheduling_gated(status: dict[str, Any]) -> bool:
    """Whether a scheduling gate holds the pod whose `status` this is back from the scheduler."""
    return any(
        c.get("type") == "PodScheduled" and c.get("reason") == Reason.SCHEDULING_GATED
        for c in status.get("conditions") or []
    )


@dataclass(frozen=True)
class PodView:
    """The facts about one child pod that decisions need."""

    name: str
    uid: str
    rtype: ReplicaType
    index: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    deleting: bool
    restarts: int  # in-place container restarts (kubelet)
    exit_code: int | None
    reason: str | None
    pod_ip: str | None
    message: str | None = None  # the main container's termination message
    unschedulable: str | None = None  # the scheduler's reason while it cannot place the pod
    gated: bool = False  # held back from the scheduler by a scheduling gate

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> PodView:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        containers = status.get("containerStatuses") or []
        main = next(
            (c for c in containers if c.get("name") == naming.CONTAINER_NAME), containers[0] if containers else {}
        )
        terminated = (
            (main.get("state") or {}).get("terminated") or (main.get("lastState") or {}).get("terminated") or {}
        )
        exit_code = terminated.get("exitCode")
        return cls(
            name=meta["name"],
            uid=meta.get("uid", ""),
            rtype=naming.replica_type_of(labels[naming.LABEL_TYPE]),
            index=int(labels[naming.LABEL_INDEX]),
            phase=status.get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")),
            restarts=sum(int(c.get("restartCount") or 0) for c in containers),
            exit_code=int(exit_code) if exit_code is not None else None,
            reason=terminated.get("reason") or status.get("reason"),
            pod_ip=status.get("podIP"),
            message=terminated.get("message"),
            unschedulable=unschedulable_reason(status),
            gated=scheduling_gated(status),
        )

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting

    def describe_exit(self) -> str:
        code = f"exit code {self.exit_code}" if self.exit_code is not None else "no exit code"
        return f"pod {self.name} failed ({code}{', ' + self.reason if self.reason else ''})"


def owned_pods(pods: list[dict[str, Any]], job_uid: str) -> list[PodView]:
    """Pods labelled for the job and controlled by this very TrainingJob (not a deleted namesake)."""
    views = []
    for pod in pods:
        owners = (pod.get("metadata") or {}).get("ownerReferences") or []
        if any(o.get("uid") == job_uid and o.get("controller") for o in owners):
            views.append(PodView.from_pod(pod))
    return views


def replica_statuses(spec: TrainingJobSpec, pods: list[PodView]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for rtype in ReplicaType:
        if rtype not in spec.replica_specs:
            continue
        mine = [p for p in pods if p.rtype is rtype and not p.deleting]
        out[rtype.value] = {
            "active": sum(p.phase == "Running" for p in mine),
            "pending": sum(p.phase in ("Pending", "Unknown") for p in mine),
            "succeeded": sum(p.phase == "Succeeded" for p in mine),
            "failed": sum(p.phase == "Failed" for p in mine),
        }
    return out


def ready_column(counts: dict[str, dict[str, int]], spec: TrainingJobSpec, rtype: ReplicaType) -> str:
    return f"{counts.get(rtype.value, {}).get('active', 0)}/{spec.replicas(rtype)}"


def get_condition(conditions: list[dict], ctype: str) -> dict | None:
    return next((c for c in conditions if c.get("type") == ctype), None)


def condition_true(conditions: list[dict], ctype: str) -> bool:
    cond = get_condition(conditions, ctype)
    return bool(cond and cond.get("status") == "True")


def set_condition(
    conditions: list[dict], ctype: str, true: bool, reason: str, message: str, now: datetime, list_false: bool = False
) -> list[dict]:
    """Return the conditions with `ctype` set; lastTransitionTime moves only when the status flips.
    A condition that never held is not listed, unless `list_false` (it explains a wait)."""
    status = "True" if true else "False"
    old = get_condition(conditions, ctype)
    if old is None and not true and not list_false:
        return conditions
    if old and old.get("status") == status and old.get("reason") == reason and old.get("message") == message:
        return conditions
    new = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastUpdateTime": timestamp(now),
        "lastTransitionTime": timestamp(now)
        if not old or old.get("status") != status
        else old.get("lastTransitionTime"),
    }
    return [new if c.get("type") == ctype else c for c in conditions] if old else [*conditions, new]


# The status fields that only count pods (they change as pods start one after another and
# workers finish); the controller writes a change of these alone with a short delay.
COUNT_FIELDS = frozenset({"replicaStatuses", "psReady", "workersReady"})


def counts_only(patch: dict[str, Any]) -> bool:
    """Whether a status patch changes nothing but the pod counts."""
    return bool(patch) and patch.keys() <= COUNT_FIELDS


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`; {} when equal."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif value != before or key not in old:
            patch[key] = value
    return patch
