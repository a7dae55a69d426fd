"""The controller's decisions, as a pure function: job + its pods + now -> a Plan.

Level-based: every call looks at the whole state, so running it twice, or after an
operator restart, gives the same answer. The controller (operator/controller.py) carries
the Plan out. `plan()` goes through the job's life in phases, each a function below; the
TFJob rules themselves (success, which exits are retried) are tfps.api.semantics', the
same ones `tfps local` follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from tfps.api import naming, semantics
from tfps.api.spec import CleanPodPolicy, ReplicaType, TrainingJob

from . import kueue
from .status import (
    CREATED,
    FAILED,
    FINISHED,
    PENDING,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    SUSPENDED,
    PodView,
    Reason,
    condition_true,
    get_condition,
    owned_pods,
    parse_time,
    ready_column,
    replica_statuses,
    set_condition,
    timestamp,
)

NORMAL, WARNING = "Normal", "Warning"


@dataclass
class Plan:
    status: dict[str, Any]
    create: list[tuple[ReplicaType, int]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)  # pod names, graceful
    # Pods of a finished job: its work is done, so they go after a short grace whatever their program does.
    stop: list[str] = field(default_factory=list)
    restart: list[str] = field(default_factory=list)  # pod names deleted to be recreated
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    delete_job: bool = False
    requeue_after: float | None = None  # seconds until a time-based transition (deadline, TTL)

    def event(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def _completed(pods: list[PodView]) -> set[semantics.Replica]:
    return {(p.rtype, p.index) for p in pods if p.phase == "Succeeded" and not p.deleting}


def final_result(job: TrainingJob, pods: list[PodView]) -> dict[str, Any] | None:
    """What the runtime's reporting replica (the Chief, else worker 0) left in its termination
    message: the final step, loss, test accuracy and (binary models) AUC. None when it left nothing
    readable."""
    reporter = semantics.reporting_replica(job.spec)
    pod = next((p for p in pods if (p.rtype, p.index) == reporter and p.phase == "Succeeded"), None)
    try:
        message = json.loads(pod.message) if pod and pod.message else None
    except ValueError:
        return None
    if not isinstance(message, dict):
        return None
    fields = {
        "steps": ("step", 0),
        "loss": ("loss", 6),
        "accuracy": ("accuracy", 4),  # digits kept, as the timer does
        "auc": ("auc", 4),
    }
    return {
        ours: round(message[theirs], digits) if digits else int(message[theirs])
        for theirs, (ours, digits) in fields.items()
        if isinstance(message.get(theirs), (int, float))
    }


def _record_result(plan: Plan, job: TrainingJob, pods: list[PodView], progress: dict[str, Any]) -> None:
    """On success, the final figures replace the last metrics reading, which the progress timer
    may have taken a few seconds before the end."""
    result = final_result(job, pods)
    if result:
        plan.status["progress"] = {**progress, **result}


def _explain_waiting(plan: Plan, job: TrainingJob, conds: list[dict], pods: list[PodView], now: datetime) -> list[dict]:
    """Pods held back by a scheduling gate (Kueue's, until the job's queue admits it), or that no
    node can take (e.g. more nvidia.com/gpu than any node has), leave the job waiting: say so in
    the Running condition and an Event, instead of a silent Pending. Not a failure: the queue may
    admit it, a cluster autoscaler may add a node, and activeDeadlineSeconds bounds the wait."""
    pending = [p for p in pods if p.phase == "Pending"]
    gated = [p for p in pending if p.gated]
    stuck = [p for p in pending if p.unschedulable and not p.gated]
    if gated:
        queue = kueue.queue_name(job)
        reason, kind = Reason.SCHEDULING_GATED, NORMAL
        message = f"{len(gated)} pods wait behind a scheduling gate" + (
            f" until Kueue's queue {queue!r} admits the job" if queue else ""
        )
    elif stuck:
        reason, kind = Reason.UNSCHEDULABLE, WARNING
        message = "; ".join(f"pod {p.name} cannot be scheduled: {p.unschedulable}" for p in stuck[:3])
        if len(stuck) > 3:
            message += f" (and {len(stuck) - 3} more pods)"
    else:
        return conds
    before = get_condition(conds, RUNNING) or {}
    if before.get("reason") != reason:
        plan.event(kind, reason, message)
    return set_condition(conds, RUNNING, False, reason, message, now, list_false=True)


def _count_in_place_restarts(status: dict, pods: list[PodView]) -> tuple[int, dict[str, str], list[PodView]]:
    """New kubelet restarts since the last reconcile, remembered per pod uid so that a
    recreated pod or an operator restart neither loses nor double-counts one."""
    seen = status.get("podRestarts") or {}
    new_seen, added, restarted = {}, 0, []
    for pod in pods:
        if pod.deleting:
            continue
        uid, _, count = (seen.get(pod.name) or "::").partition(":")
        before = int(count) if uid == pod.uid and count else 0
        if pod.restarts > before:
            added += pod.restarts - before
            restarted.append(pod)
        if max(pod.restarts, before) > 0:
            new_seen[pod.name] = f"{pod.uid}:{max(pod.restarts, before)}"
    return added, new_seen, restarted


def _finish(
    plan: Plan,
    job: TrainingJob,
    pods: list[PodView],
    phase: str,
    reason: str,
    message: str,
    now: datetime,
    delete_all: bool = False,
) -> None:
    st = plan.status
    conds = st.get("conditions") or []
    conds = set_condition(conds, RUNNING, False, reason, message, now)
    conds = set_condition(conds, RESTARTING, False, reason, message, now)
    conds = set_condition(conds, phase, True, reason, message, now)
    st["conditions"] = conds
    st["phase"] = phase
    st["completionTime"] = timestamp(now)
    plan.event(NORMAL if phase == SUCCEEDED else WARNING, reason, message)
    _clean_pods(plan, job, pods, delete_all)


def _clean_pods(plan: Plan, job: TrainingJob, pods: list[PodView], delete_all: bool) -> None:
    policy = job.spec.run_policy.clean_pod_policy
    for pod in pods:
        if pod.deleting or pod.name in plan.delete or pod.name in plan.stop:
            continue
        if (
            delete_all
            or policy is CleanPodPolicy.ALL
            or (policy is CleanPodPolicy.RUNNING and pod.phase in ("Running", "Pending", "Unknown"))
        ):
            plan.stop.append(pod.name)


def plan(body: dict[str, Any], pods: list[dict[str, Any]], now: datetime) -> Plan:
    meta = body.get("metadata") or {}
    old = body.get("status") or {}
    status: dict[str, Any] = {k: v for k, v in old.items() if k != "progress"}  # progress is the timer's
    result = Plan(status=status)
    status["observedGeneration"] = meta.get("generation")
    try:
        job = TrainingJob.model_validate(body)
    except ValidationError as err:
        _invalid_spec(result, str(err), now)
        return result

    views = owned_pods(pods, meta.get("uid", ""))
    _observe(result, job, views, old)
    if old.get("phase") in FINISHED:
        _finished(result, job, views, old, now)
    elif not _suspended(result, job, views, now):
        _run(result, job, views, old, now)
    return result


def _run(result: Plan, job: TrainingJob, views: list[PodView], old: dict[str, Any], now: datetime) -> None:
    """A job that is neither finished nor suspended: start, deadline, success, failures, scale, phase."""
    _started(result, job, now)
    if _deadline_passed(result, job, views, now):
        return
    done = semantics.success(job.spec, _completed(views))
    if done:
        _record_result(result, job, views, old.get("progress") or {})
        _finish(result, job, views, SUCCEEDED, Reason.SUCCEEDED, f"TrainingJob {job.name} succeeded: {done}", now)
        return
    if _model_load_failed(result, job, views, now):
        return
    restarted = _restart_failed(result, job, views, now)
    if restarted is None:
        return
    _scale(result, job, views, old)
    _set_phase(result, job, views, old, restarted, now)


def _invalid_spec(result: Plan, error: str, now: datetime) -> None:
    """The CRD's schema rejects these; only reachable with a CRD older than the operator."""
    status = result.status
    if status.get("phase") != FAILED:
        status.update(
            phase=FAILED,
            completionTime=timestamp(now),
            conditions=set_condition(status.get("conditions") or [], FAILED, True, Reason.INVALID_SPEC, error, now),
        )
        result.event(WARNING, Reason.INVALID_SPEC, error)


def _observe(result: Plan, job: TrainingJob, views: list[PodView], old: dict[str, Any]) -> None:
    """What the pods say: restarts in place since the last reconcile, counts by replica type."""
    status, spec = result.status, job.spec
    live = [p for p in views if not p.deleting]
    status["workerSelector"] = naming.label_selector(
        {naming.LABEL_JOB: job.name, naming.LABEL_TYPE: ReplicaType.WORKER.task_type}
    )
    added, status["podRestarts"], restarted_in_place = _count_in_place_restarts(old, live)
    status["restartCount"] = int(old.get("restartCount") or 0) + added
    for pod in restarted_in_place:
        result.event(WARNING, Reason.POD_RESTARTED, f"pod {pod.name} restarted in place (restart count {pod.restarts})")
    status["replicaStatuses"] = replica_statuses(spec, views)
    status["psReady"] = ready_column(status["replicaStatuses"], spec, ReplicaType.PS)
    status["workersReady"] = ready_column(status["replicaStatuses"], spec, ReplicaType.WORKER)


def _finished(result: Plan, job: TrainingJob, views: list[PodView], old: dict[str, Any], now: datetime) -> None:
    """A finished job only cleans up (again, after an operator restart) and waits for its TTL."""
    deadline_failure = any(
        c.get("type") == FAILED and c.get("reason") == Reason.DEADLINE_EXCEEDED for c in old.get("conditions") or []
    )
    _clean_pods(result, job, views, delete_all=deadline_failure)
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    finished_at = parse_time(old.get("completionTime"))
    if ttl is None or finished_at is None:
        return
    left = ttl - (now - finished_at).total_seconds()
    if left <= 0:
        result.delete_job = True
        result.event(NORMAL, Reason.TTL_EXPIRED, f"deleted {ttl}s after it finished")
    else:
        result.requeue(left)


def _suspended(result: Plan, job: TrainingJob, views: list[PodView], now: datetime) -> bool:
    """Suspend deletes every pod; resuming restarts the deadline's clock, as in TFJob."""
    status = result.status
    conds = status.get("conditions") or []
    if job.spec.run_policy.suspend:
        result.delete.extend(p.name for p in views if not p.deleting)
        if not condition_true(conds, SUSPENDED):
            msg = "suspended: its pods are deleted until spec.runPolicy.suspend is false"
            for ctype in (RUNNING, RESTARTING):
                conds = set_condition(conds, ctype, False, Reason.SUSPENDED, msg, now)
            conds = set_condition(conds, SUSPENDED, True, Reason.SUSPENDED, msg, now)
            result.event(NORMAL, Reason.SUSPENDED, msg)
        status["conditions"], status["phase"] = conds, SUSPENDED
        return True
    if condition_true(conds, SUSPENDED):
        msg = "resumed: pods are recreated"
        status["conditions"] = set_condition(conds, SUSPENDED, False, Reason.RESUMED, msg, now)
        status["startTime"] = timestamp(now)
        result.event(NORMAL, Reason.RESUMED, msg)
    return False


def _started(result: Plan, job: TrainingJob, now: datetime) -> None:
    status = result.status
    conds = status.get("conditions") or []
    if not status.get("startTime"):
        status["startTime"] = timestamp(now)
    if not condition_true(conds, CREATED):
        msg = f"created the Service and {len(semantics.replicas(job.spec))} pods"
        conds = set_condition(conds, CREATED, True, Reason.CREATED, msg, now)
        result.event(NORMAL, Reason.CREATED_EVENT, msg)
    status["conditions"] = conds


def _deadline_passed(result: Plan, job: TrainingJob, views: list[PodView], now: datetime) -> bool:
    deadline = job.spec.run_policy.active_deadline_seconds
    if deadline is None:
        return False
    started = parse_time(result.status.get("startTime")) or now  # _started sets it before this runs
    left = deadline - (now - started).total_seconds()
    if left > 0:
        result.requeue(left)
        return False
    _finish(
        result,
        job,
        views,
        FAILED,
        Reason.DEADLINE_EXCEEDED,
        f"ran longer than activeDeadlineSeconds ({deadline}s)",
        now,
        delete_all=True,
    )
    return True


def model_load_failure(pods: list[PodView]) -> str | None:
    """The condition's message when a replica could not load the user's model, quoting the error
    its termination message holds; None when none failed so. The kubelet may already be
    restarting the container in place (restartPolicy OnFailure): its last state says so too."""
    pod = next((p for p in pods if not p.deleting and semantics.user_code_failed(p.exit_code)), None)
    if pod is None:
        return None
    error = (pod.message or "").strip() or f"no message: see kubectl logs {pod.name}"
    return f"pod {pod.name} could not load the model (exit code {pod.exit_code}): {error}"


def _model_load_failed(result: Plan, job: TrainingJob, views: list[PodView], now: datetime) -> bool:
    message = model_load_failure(views)
    if message is None:
        return False
    _finish(result, job, views, FAILED, Reason.MODEL_LOAD_FAILED, message, now)
    return True


def _restart_failed(result: Plan, job: TrainingJob, views: list[PodView], now: datetime) -> list[PodView] | None:
    """Failed pods are recreated within the restart budget; the pods restarted now, or None
    when the job failed instead."""
    spec, status = job.spec, result.status
    backoff = spec.run_policy.backoff_limit
    restarted: list[PodView] = []

    def fail(reason: str, message: str) -> None:
        _finish(result, job, views, FAILED, reason, message, now)

    for pod in sorted(
        (p for p in views if not p.deleting and p.phase == "Failed"), key=lambda p: (p.rtype.value, p.index)
    ):
        if pod.index >= spec.replicas(pod.rtype):
            result.delete.append(pod.name)  # scaled away while failing: just gone
            continue
        policy = spec.replica_specs[pod.rtype].restart_policy
        if not semantics.retryable(policy, pod.exit_code):
            fail(
                Reason.replica_failed(pod.rtype),
                f"{pod.describe_exit()}; restartPolicy {policy.value} does not retry it",
            )
            return None
        if status["restartCount"] >= backoff:
            fail(Reason.BACKOFF_LIMIT_EXCEEDED, f"{pod.describe_exit()}; backoffLimit {backoff} restarts already used")
            return None
        status["restartCount"] += 1
        result.restart.append(pod.name)
        restarted.append(pod)
        result.event(
            WARNING,
            Reason.POD_RESTARTING,
            f"{pod.describe_exit()}; recreating it (restart {status['restartCount']} of {backoff})",
        )
    if status["restartCount"] > backoff:
        fail(Reason.BACKOFF_LIMIT_EXCEEDED, f"{status['restartCount']} restarts exceed backoffLimit {backoff}")
        return None
    return restarted


def _scale(result: Plan, job: TrainingJob, views: list[PodView], old: dict[str, Any]) -> None:
    """Create what is missing, delete indices beyond the wanted replicas."""
    spec, status = job.spec, result.status
    existing = {(p.rtype, p.index) for p in views}
    result.create.extend(r for r in semantics.replicas(spec) if r not in existing)
    for rtype, _ in result.create:  # the status describes the pods as they will be
        status["replicaStatuses"][rtype.value]["pending"] += 1
    if result.create and condition_true(old.get("conditions") or [], CREATED):
        names = [naming.pod_name(job.name, t, i) for t, i in result.create]
        result.event(NORMAL, Reason.CREATED_PODS, "created pods " + ", ".join(names))  # scale-up, restarts
    extra = [p for p in views if not p.deleting and p.index >= spec.replicas(p.rtype) and p.name not in result.delete]
    result.delete.extend(p.name for p in extra)
    if extra:
        result.event(NORMAL, Reason.SCALED_DOWN, "deleted pods " + ", ".join(p.name for p in extra))


def _set_phase(
    result: Plan, job: TrainingJob, views: list[PodView], old: dict[str, Any], restarted: list[PodView], now: datetime
) -> None:
    """All wanted pods running -> Running; a restart in progress -> Restarting."""
    status = result.status
    conds = status.get("conditions") or []
    live = [p for p in views if not p.deleting]
    up = {(p.rtype, p.index) for p in live if p.phase in ("Running", "Succeeded") and p.name not in result.restart}
    all_up = set(semantics.replicas(job.spec)) <= up
    if restarted:
        msg = "restarting " + ", ".join(p.name for p in restarted)
        conds = set_condition(conds, RESTARTING, True, Reason.POD_RESTARTING, msg, now)
        conds = set_condition(conds, RUNNING, False, Reason.POD_RESTARTING, msg, now)
        phase = RESTARTING
    elif condition_true(conds, RESTARTING) and not all_up:
        phase = RESTARTING
    elif all_up:
        msg = f"TrainingJob {job.name} is running"
        conds = set_condition(conds, RESTARTING, False, Reason.ALL_PODS_RUNNING, msg, now)
        conds = set_condition(conds, RUNNING, True, Reason.RUNNING, msg, now)
        phase = RUNNING
    elif condition_true(conds, RUNNING):
        phase = RUNNING  # e.g. workers being added by a scale-up
    else:
        phase = PENDING
    if phase in (PENDING, RESTARTING):
        conds = _explain_waiting(result, job, conds, live, now)
    if phase != old.get("phase") and phase in (RUNNING, RESTARTING):
        cond = get_condition(conds, phase) or {}
        result.event(NORMAL if phase == RUNNING else WARNING, phase, cond.get("message", phase))
    status["conditions"], status["phase"] = conds, phase
