"""The controller's decisions, as a pure function: job + its pods + now -> a Plan.

Level-based: every call looks at the whole state, so running it twice, or after an
operator restart, gives the same answer. The handlers carry the Plan out.
"""
from __future__ import annotations

import json

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from tfps.api import naming
from tfps.api.spec import CleanPodPolicy, ReplicaType, RestartPolicy, SuccessPolicy, TrainingJob

from .status import (
    CREATED, FAILED, FINISHED, PENDING, RESTARTING, RUNNING, SUCCEEDED, SUSPENDED,
    PodView, condition_true, get_condition, owned_pods, parse_time, ready_column, replica_statuses, set_condition, timestamp,
)

RETRYABLE_EXIT_CODE = 128  # TFJob: >= 128 means killed by a signal (OOM, preemption): worth a retry
NORMAL, WARNING = "Normal", "Warning"


@dataclass
class Plan:
    status: dict[str, Any]
    create: list[tuple[ReplicaType, int]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)  # pod names, graceful
    restart: list[str] = field(default_factory=list)  # pod names deleted to be recreated
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    delete_job: bool = False
    requeue_after: float | None = None  # seconds until a time-based transition (deadline, TTL)

    def event(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def _retryable(policy: RestartPolicy, pod: PodView) -> bool:
    if policy in (RestartPolicy.ALWAYS, RestartPolicy.ON_FAILURE):
        return True
    if policy is RestartPolicy.EXIT_CODE:
        # No exit code (evicted, node lost) is not the program's fault either.
        return pod.exit_code is None or pod.exit_code >= RETRYABLE_EXIT_CODE
    return False


def _success(job: TrainingJob, pods: list[PodView]) -> str | None:
    """The success message when the success policy is met, else None."""
    spec = job.spec
    done = {(p.rtype, p.index) for p in pods if p.phase == "Succeeded" and not p.deleting}
    if spec.replicas(ReplicaType.CHIEF) > 0:
        return "the Chief completed" if (ReplicaType.CHIEF, 0) in done else None
    workers = spec.replicas(ReplicaType.WORKER)
    if workers == 0:
        return None
    if spec.success_policy is SuccessPolicy.ALL_WORKERS:
        return f"all {workers} workers completed" if all((ReplicaType.WORKER, i) in done for i in range(workers)) else None
    return "worker 0 completed" if (ReplicaType.WORKER, 0) in done else None


def final_result(job: TrainingJob, pods: list[PodView]) -> dict[str, Any] | None:
    """What the runtime's reporting replica (the Chief, else worker 0) left in its termination
    message: the final step, loss and test accuracy. None when it left nothing readable."""
    rtype = ReplicaType.CHIEF if job.spec.replicas(ReplicaType.CHIEF) > 0 else ReplicaType.WORKER
    pod = next((p for p in pods if p.rtype is rtype and p.index == 0 and p.phase == "Succeeded"), None)
    try:
        message = json.loads(pod.message) if pod and pod.message else None
    except ValueError:
        return None
    if not isinstance(message, dict):
        return None
    fields = {"steps": ("step", 0), "loss": ("loss", 6), "accuracy": ("accuracy", 4)}  # digits kept, as the timer does
    return {ours: round(message[theirs], digits) if digits else int(message[theirs])
            for theirs, (ours, digits) in fields.items() if isinstance(message.get(theirs), (int, float))}


def _record_result(plan: Plan, job: TrainingJob, pods: list[PodView], progress: dict[str, Any]) -> None:
    """On success, the final figures replace the last metrics reading, which the progress timer
    may have taken a few seconds before the end."""
    result = final_result(job, pods)
    if result:
        plan.status["progress"] = {**progress, **result}


def _explain_unschedulable(plan: Plan, conds: list[dict], pods: list[PodView], now: datetime) -> list[dict]:
    """A pod no node can take (e.g. more nvidia.com/gpu than any node has) leaves the job waiting:
    say so in the Running condition and an Event, instead of a silent Pending. Not a failure: a
    cluster autoscaler may still add a node, and activeDeadlineSeconds bounds the wait."""
    stuck = [p for p in pods if p.unschedulable and p.phase == "Pending"]
    if not stuck:
        return conds
    message = "; ".join(f"pod {p.name} cannot be scheduled: {p.unschedulable}" for p in stuck[:3])
    if len(stuck) > 3:
        message += f" (and {len(stuck) - 3} more pods)"
    before = get_condition(conds, RUNNING) or {}
    if before.get("reason") != "Unschedulable":
        plan.event(WARNING, "Unschedulable", message)
    return set_condition(conds, RUNNING, False, "Unschedulable", message, now, list_false=True)


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


def _finish(plan: Plan, job: TrainingJob, pods: list[PodView], phase: str, reason: str, message: str,
            now: datetime, delete_all: bool = False) -> None:
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
        if pod.deleting or pod.name in plan.delete:
            continue
        if delete_all or policy is CleanPodPolicy.ALL or (
                policy is CleanPodPolicy.RUNNING and pod.phase in ("Running", "Pending", "Unknown")):
            plan.delete.append(pod.name)


def plan(body: dict[str, Any], pods: list[dict[str, Any]], now: datetime) -> Plan:
    meta = body.get("metadata") or {}
    old = body.get("status") or {}
    status: dict[str, Any] = {k: v for k, v in old.items() if k != "progress"}  # progress is the timer's
    result = Plan(status=status)
    status["observedGeneration"] = meta.get("generation")
    try:
        job = TrainingJob.model_validate(body)
    except ValidationError as err:
        # The CRD's schema rejects these; only reachable with a CRD older than the operator.
        if status.get("phase") != FAILED:
            status.update(phase=FAILED, completionTime=timestamp(now),
                          conditions=set_condition(status.get("conditions") or [], FAILED, True, "InvalidSpec", str(err), now))
            result.event(WARNING, "InvalidSpec", str(err))
        return result

    spec, run_policy = job.spec, job.spec.run_policy
    views = owned_pods(pods, meta.get("uid", ""))
    live = [p for p in views if not p.deleting]
    status["workerSelector"] = naming.label_selector(
        {naming.LABEL_JOB: job.name, naming.LABEL_TYPE: ReplicaType.WORKER.task_type})
    conds = status.get("conditions") or []

    added, status["podRestarts"], restarted_in_place = _count_in_place_restarts(old, live)
    status["restartCount"] = int(old.get("restartCount") or 0) + added
    for pod in restarted_in_place:
        result.event(WARNING, "PodRestarted", f"pod {pod.name} restarted in place (restart count {pod.restarts})")

    def counts() -> None:
        status["replicaStatuses"] = replica_statuses(spec, views)
        status["psReady"] = ready_column(status["replicaStatuses"], spec, ReplicaType.PS)
        status["workersReady"] = ready_column(status["replicaStatuses"], spec, ReplicaType.WORKER)

    counts()

    # A finished job only cleans up (again, after an operator restart) and waits for its TTL.
    if old.get("phase") in FINISHED:
        deadline_failure = (old.get("conditions") and any(
            c.get("type") == FAILED and c.get("reason") == "DeadlineExceeded" for c in old["conditions"]))
        _clean_pods(result, job, views, delete_all=bool(deadline_failure))
        ttl = run_policy.ttl_seconds_after_finished
        finished_at = parse_time(old.get("completionTime"))
        if ttl is not None and finished_at is not None:
            left = ttl - (now - finished_at).total_seconds()
            if left <= 0:
                result.delete_job = True
                result.event(NORMAL, "TTLExpired", f"deleted {ttl}s after it finished")
            else:
                result.requeue(left)
        return result

    if run_policy.suspend:
        result.delete.extend(p.name for p in live)
        if not condition_true(conds, SUSPENDED):
            msg = "suspended: its pods are deleted until spec.runPolicy.suspend is false"
            conds = set_condition(conds, RUNNING, False, "Suspended", msg, now)
            conds = set_condition(conds, RESTARTING, False, "Suspended", msg, now)
            conds = set_condition(conds, SUSPENDED, True, "Suspended", msg, now)
            result.event(NORMAL, "Suspended", msg)
        status["conditions"], status["phase"] = conds, SUSPENDED
        return result
    if condition_true(conds, SUSPENDED):
        conds = set_condition(conds, SUSPENDED, False, "Resumed", "resumed: pods are recreated", now)
        status["startTime"] = timestamp(now)  # the deadline counts from the resume, as in TFJob
        result.event(NORMAL, "Resumed", "resumed: pods are recreated")

    if not status.get("startTime"):
        status["startTime"] = timestamp(now)
    if not condition_true(conds, CREATED):
        msg = f"created the Service and {sum(spec.replicas(t) for t in ReplicaType)} pods"
        conds = set_condition(conds, CREATED, True, "TrainingJobCreated", msg, now)
        result.event(NORMAL, "Created", msg)
    status["conditions"] = conds

    deadline = run_policy.active_deadline_seconds
    if deadline is not None:
        left = deadline - (now - parse_time(status["startTime"])).total_seconds()
        if left <= 0:
            _finish(result, job, views, FAILED, "DeadlineExceeded",
                    f"ran longer than activeDeadlineSeconds ({deadline}s)", now, delete_all=True)
            return result
        result.requeue(left)

    done = _success(job, views)
    if done:
        _record_result(result, job, views, old.get("progress") or {})
        _finish(result, job, views, SUCCEEDED, "TrainingJobSucceeded", f"TrainingJob {job.name} succeeded: {done}", now)
        return result

    # Failed pods: restart within the budget, or fail the job.
    restarted_now: list[PodView] = []
    for pod in sorted(live, key=lambda p: (p.rtype.value, p.index)):
        if pod.phase != "Failed":
            continue
        if pod.index >= spec.replicas(pod.rtype):
            result.delete.append(pod.name)  # scaled away while failing: just gone
            continue
        policy = spec.replica_specs[pod.rtype].restart_policy
        if not _retryable(policy, pod):
            _finish(result, job, views, FAILED, f"{pod.rtype.value}Failed",
                    f"{pod.describe_exit()}; restartPolicy {policy.value} does not retry it", now)
            return result
        if status["restartCount"] >= run_policy.backoff_limit:
            _finish(result, job, views, FAILED, "BackoffLimitExceeded",
                    f"{pod.describe_exit()}; backoffLimit {run_policy.backoff_limit} restarts already used", now)
            return result
        status["restartCount"] += 1
        result.restart.append(pod.name)
        restarted_now.append(pod)
        result.event(WARNING, "PodRestarting", f"{pod.describe_exit()}; recreating it "
                     f"(restart {status['restartCount']} of {run_policy.backoff_limit})")
    if status["restartCount"] > run_policy.backoff_limit:
        _finish(result, job, views, FAILED, "BackoffLimitExceeded",
                f"{status['restartCount']} restarts exceed backoffLimit {run_policy.backoff_limit}", now)
        return result

    # Scale: create what is missing, delete indices beyond the wanted replicas.
    existing = {(p.rtype, p.index) for p in views}
    for rtype in (ReplicaType.PS, ReplicaType.CHIEF, ReplicaType.WORKER, ReplicaType.EVALUATOR):
        for i in range(spec.replicas(rtype)):
            if (rtype, i) not in existing:
                result.create.append((rtype, i))
    for rtype, _ in result.create:  # the status describes the pods as they will be
        status["replicaStatuses"][rtype.value]["pending"] += 1
    if result.create and condition_true(old.get("conditions") or [], CREATED):
        names = [naming.pod_name(job.name, t, i) for t, i in result.create]
        result.event(NORMAL, "CreatedPods", "created pods " + ", ".join(names))  # scale-up, restarts
    extra = [p for p in live if p.index >= spec.replicas(p.rtype) and p.name not in result.delete]
    result.delete.extend(p.name for p in extra)
    if extra:
        result.event(NORMAL, "ScaledDown", "deleted pods " + ", ".join(p.name for p in extra))

    # Phase: all wanted pods running -> Running; a restart in progress -> Restarting.
    wanted = {(t, i) for t in ReplicaType for i in range(spec.replicas(t))}
    up = {(p.rtype, p.index) for p in live if p.phase in ("Running", "Succeeded") and p.name not in result.restart}
    all_up = wanted <= up
    if restarted_now:
        msg = "restarting " + ", ".join(p.name for p in restarted_now)
        conds = set_condition(conds, RESTARTING, True, "PodRestarting", msg, now)
        conds = set_condition(conds, RUNNING, False, "PodRestarting", msg, now)
        phase = RESTARTING
    elif condition_true(conds, RESTARTING) and not all_up:
        phase = RESTARTING
    elif all_up:
        msg = f"TrainingJob {job.name} is running"
        conds = set_condition(conds, RESTARTING, False, "AllPodsRunning", msg, now)
        conds = set_condition(conds, RUNNING, True, "TrainingJobRunning", msg, now)
        phase = RUNNING
    elif condition_true(conds, RUNNING):
        phase = RUNNING  # e.g. workers being added by a scale-up
    else:
        phase = PENDING
    if phase in (PENDING, RESTARTING):
        conds = _explain_unschedulable(result, conds, live, now)
    if phase != old.get("phase") and phase in (RUNNING, RESTARTING):
        cond = get_condition(conds, phase) or {}
        result.event(NORMAL if phase == RUNNING else WARNING, phase, cond.get("message", phase))
    status["conditions"], status["phase"] = conds, phase
    return result
