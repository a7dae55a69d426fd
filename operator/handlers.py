"""Thin kopf handlers: settings, one reconcile loop (daemon) per TrainingJob, wake-ups on
pod and spec changes, a progress timer, and cleanup on deletion.

`register()` binds them to a registry with the operator's configuration, so nothing
happens at import time and the timer's interval comes from the configuration.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kopf

from tfps.api import naming
from tfps.api.spec import API_GROUP, API_VERSION, PLURAL

from .config import OperatorConfig
from .controller import Controller
from .metrics import OperatorMetrics
from .status import unschedulable_reason

RETRY_SECONDS = 2.0  # after an API error, before the next attempt
# Pod events come in bursts (10 pods created, then scheduled, then started): one pass
# shortly after the first event sees them all instead of one pass per event.
COALESCE_SECONDS = 0.1


@dataclass
class Runtime:
    """What the handlers share: the controller and a wake-up flag per job."""

    controller: Controller
    executor: ThreadPoolExecutor
    config: OperatorConfig
    metrics: OperatorMetrics
    peering_name: str
    peering_priority: int = 0
    peering_lifetime: int = 30
    standalone: bool = False
    wake: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    seen_generation: dict[tuple[str, str], int] = field(default_factory=dict)
    pod_state: dict[str, tuple[str, bool, int]] = field(default_factory=dict)  # by pod uid

    def wake_job(self, namespace: str, name: str) -> None:
        event = self.wake.get((namespace, name))
        if event is not None:
            event.set()


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's change detection serves on.create/on.update handlers, and this operator has none
    (its loop reads the whole state on every pass; deletion needs no diff). With the default
    storage kopf would still deep-copy every watched object on every event, pods included, and
    write an annotation on every new job: one more API write and watch event per job."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence:
        return kopf.BodyEssence()  # never None: no object looks new, so nothing is stored

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


def _post_events(body: dict, events: list[tuple[str, str, str]]) -> None:
    for kind, reason, message in events:
        kopf.event(body, type=kind, reason=reason, message=message[:1024])


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, delay: float) -> bool:
    """Until the job is woken (True), the daemon is stopped, or `delay` seconds pass."""
    async def until_stopped() -> None:
        await stopped.wait()

    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(until_stopped())]
    try:
        await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        return wake.is_set() and not stopped
    finally:
        for waiter in waiters:
            waiter.cancel()


def _pod_state(pod: kopf.Body) -> tuple[str, bool, int, bool]:
    """What of a pod can change a job's status: phase, deletion, restarts, unschedulable."""
    status = pod.get("status") or {}
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
    return (status.get("phase") or "Pending", bool(pod.get("metadata", {}).get("deletionTimestamp")), restarts,
            unschedulable_reason(status) is not None)


def register(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    resource = dict(group=API_GROUP, version=API_VERSION, plural=PLURAL, registry=registry)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own finalizer and annotation names, so that the objects say who holds them.
        settings.persistence.finalizer = f"{API_GROUP}/operator"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
        settings.persistence.diffbase_storage = NoDiffBase()
        # Events come from "tfps-operator"; kopf's own per-handler log events stay off the
        # jobs (ours say what happened in the user's words).
        settings.posting.reporting_component = naming.MANAGED_BY
        settings.posting.level = logging.WARNING
        # Leader election: replicas sharing the peering object pause unless they have the
        # highest priority (main.py gives each a distinct one); a dead leader's record
        # expires after `lifetime` seconds and a standby takes over.
        settings.peering.standalone = rt.standalone
        settings.peering.mandatory = not rt.standalone
        settings.peering.name = rt.peering_name
        settings.peering.priority = rt.peering_priority
        settings.peering.lifetime = rt.peering_lifetime
        settings.peering.stealth = True
        # Watches are re-established every few minutes, so a silently dropped connection
        # never leaves a job without events for long.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = 10
        # For the few sync handlers left (login, startup).
        settings.execution.max_workers = rt.config.reconcile_workers
        # A hung API call must not stall a job's loop forever.
        settings.networking.request_timeout = 60

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as our own API client (in-cluster, else KUBECONFIG).
        return kopf.login_via_client(**kwargs)

    # On deletion or pause the loop is told to stop and gets cancellation_backoff seconds to
    # finish its pass before it is cancelled.
    @kopf.daemon(**resource, cancellation_backoff=1.0, cancellation_timeout=5.0)
    async def job_loop(name: str, namespace: str, meta: kopf.Meta, body: kopf.Body, stopped: kopf.DaemonStopped,
                       logger: logging.Logger, **_: Any) -> None:
        """Reconcile the job whenever something changes, and at least every resyncSeconds."""
        key = (namespace, name)
        wake = rt.wake.setdefault(key, asyncio.Event())
        loop = asyncio.get_running_loop()
        # A job never reconciled: its first pass starts from the body the event brought (later
        # passes read it again: this live view may lag behind our own status writes).
        new = None if body.get("status") else copy.deepcopy(dict(body))
        try:
            while not stopped:
                wake.clear()
                delay = rt.config.resync_seconds
                first, new = new, None
                try:
                    outcome = await loop.run_in_executor(rt.executor, rt.controller.reconcile, namespace, name,
                                                         meta.get("creationTimestamp"), first)
                except Exception as err:  # API unavailable, conflict...: retried, never fatal
                    rt.metrics.reconcile_errors.inc()
                    logger.warning("reconcile failed, retrying in %.0fs: %s", RETRY_SECONDS, err)
                    outcome, delay = None, RETRY_SECONDS
                else:
                    if outcome is None:
                        return  # gone or being deleted: the deletion handler takes over
                    rt.seen_generation[key] = outcome.body["metadata"].get("generation", 0)
                    rt.metrics.job_phase(key, outcome.plan.status.get("phase"))
                    _post_events(outcome.body, outcome.plan.events)
                    if outcome.plan.requeue_after is not None:
                        delay = min(delay, outcome.plan.requeue_after + 0.05)
                if await _sleep(wake, stopped, delay):
                    await _sleep(asyncio.Event(), stopped, COALESCE_SECONDS)
        finally:
            if rt.wake.get(key) is wake:
                del rt.wake[key]

    # The event handlers are coroutines: they only look at the event and set an asyncio.Event,
    # which must happen on the loop (a sync handler would run in a thread, once per pod event).
    @kopf.on.event(**resource)
    async def job_event(name: str, namespace: str, meta: kopf.Meta, **_: Any) -> None:
        # Spec changes (scale, suspend) bump the generation; our own status writes do not.
        if meta.get("generation") != rt.seen_generation.get((namespace, name)):
            rt.wake_job(namespace, name)

    @kopf.on.event("", "v1", "pods", labels={naming.LABEL_MANAGED_BY: naming.MANAGED_BY, naming.LABEL_JOB: kopf.PRESENT},
                   registry=registry)
    async def pod_event(type: str, namespace: str, uid: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> None:
        # Only changes a decision can depend on wake the job (not the scheduler's conditions,
        # not the ADDED of a pending pod the job's own pass just created).
        if type == "DELETED":
            rt.pod_state.pop(uid, None)
        else:
            state = _pod_state(body)
            before = rt.pod_state.get(uid)
            rt.pod_state[uid] = state
            if state == before or (before is None and state == ("Pending", False, 0, False)):
                return
        rt.wake_job(namespace, labels[naming.LABEL_JOB])

    @kopf.timer(**resource, interval=rt.config.progress_seconds, initial_delay=rt.config.progress_seconds)
    async def read_progress(name: str, namespace: str, status: kopf.Status, memo: kopf.Memo,
                            patch: kopf.Patch, **_: Any) -> None:
        if status.get("phase") not in ("Running", "Restarting"):
            return
        new, memo.sample = await asyncio.get_running_loop().run_in_executor(
            rt.executor, rt.controller.read_progress, namespace, name, getattr(memo, "sample", None))
        if new:
            patch.status["progress"] = new

    # optional: this handler asks for no finalizer of its own. (The daemon and the timer do:
    # kopf holds a job with tfps.io/operator until it has stopped them, so a job deleted while
    # no operator runs waits for one; owner references remove its children either way.)
    @kopf.on.delete(**resource, optional=True)
    async def delete_children(name: str, namespace: str, uid: str, meta: kopf.Meta, **_: Any) -> None:
        # Owner references would do it too, but the garbage collector may take a while.
        rt.metrics.job_phase((namespace, name), None)
        rt.seen_generation.pop((namespace, name), None)
        await asyncio.get_running_loop().run_in_executor(rt.executor, rt.controller.delete_children, namespace, name, uid,
                                                         meta.get("creationTimestamp"))
