"""Thin kopf handlers: settings, one reconcile loop (daemon) per TrainingJob, wake-ups on
pod and spec changes, a progress timer, and cleanup on deletion.

The handlers are plain module-level functions; what they share (the controller, the wake-up
flag of each job, ...) is one `Shared` object in kopf's memo (`kopf.run(memo=...)`, see
operator/main.py). `register()` only binds them to a registry, so nothing happens at import
time and the timer's interval comes from the configuration.
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
from .controller import RELIST_SECONDS, Controller
from .metrics import OperatorMetrics
from .status import scheduling_gated, unschedulable_reason

POD_SELECTOR = f"{naming.LABEL_MANAGED_BY}={naming.MANAGED_BY},{naming.LABEL_JOB}"
RETRY_SECONDS = 2.0  # after an API error, before the next attempt
# Pod events come in bursts (10 pods created, then scheduled, then started): one pass
# shortly after the first event sees them all instead of one pass per event.
COALESCE_SECONDS = 0.1


@dataclass
class Peering:
    """Leader election among operator replicas (kopf's peering)."""

    name: str
    priority: int = 0
    lifetime: int = 30
    standalone: bool = False


@dataclass
class Shared:
    """What the handlers share, in kopf's memo: the controller and a wake-up flag per job."""

    controller: Controller
    executor: ThreadPoolExecutor
    config: OperatorConfig
    metrics: OperatorMetrics
    peering: Peering
    wake: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    seen_generation: dict[tuple[str, str], int] = field(default_factory=dict)
    pod_state: dict[str, tuple[str, bool, int, bool, bool]] = field(default_factory=dict)  # by pod uid

    def wake_job(self, namespace: str, name: str) -> None:
        event = self.wake.get((namespace, name))
        if event is not None:
            event.set()


def memo_for(shared: Shared) -> kopf.Memo:
    return kopf.Memo(shared=shared)


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


def _pod_state(pod: kopf.Body) -> tuple[str, bool, int, bool, bool]:
    """What of a pod can change a job's status: phase, deletion, restarts, unschedulable, gated."""
    status = pod.get("status") or {}
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
    return (status.get("phase") or "Pending", bool(pod.get("metadata", {}).get("deletionTimestamp")), restarts,
            unschedulable_reason(status) is not None, scheduling_gated(status))


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    peering: Peering = memo.shared.peering
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
    settings.peering.standalone = peering.standalone
    settings.peering.mandatory = not peering.standalone
    settings.peering.name = peering.name
    settings.peering.priority = peering.priority
    settings.peering.lifetime = peering.lifetime
    settings.peering.stealth = True
    # Only our pods come down the pod watch (the handler's own filter is client-side: without
    # this, every pod of the cluster would be sent, decoded and dropped).
    settings.watching.label_selectors["v1", "pods"] = POD_SELECTOR
    # Watches are re-established every few minutes, so a silently dropped connection
    # never leaves a job without events for long.
    settings.watching.server_timeout = int(RELIST_SECONDS)
    settings.watching.client_timeout = int(RELIST_SECONDS) + 30
    settings.watching.connect_timeout = 10
    # For the few sync handlers left (login, startup).
    settings.execution.max_workers = memo.shared.config.reconcile_workers
    # A hung API call must not stall a job's loop forever.
    settings.networking.request_timeout = 60


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # The same credentials as our own API client (in-cluster, else KUBECONFIG).
    return kopf.login_via_client(**kwargs)


async def _reconcile_once(shared: Shared, key: tuple[str, str], meta: kopf.Meta, first: dict | None,
                          live: dict | None, logger: logging.Logger) -> float | None:
    """One pass; the seconds until the next one, or None when the job is gone."""
    namespace, name = key
    delay = shared.config.resync_seconds
    try:
        outcome = await asyncio.get_running_loop().run_in_executor(
            shared.executor, shared.controller.reconcile, namespace, name, meta.get("creationTimestamp"), first, live)
    except Exception as err:  # API unavailable, conflict...: retried, never fatal
        shared.controller.pods.drop(key)  # and the retry reads everything again
        shared.metrics.reconcile_errors.inc()
        logger.warning("reconcile failed, retrying in %.0fs: %s", RETRY_SECONDS, err)
        return RETRY_SECONDS
    if outcome is None:
        return None  # gone or being deleted: the deletion handler takes over
    shared.seen_generation[key] = outcome.body["metadata"].get("generation", 0)
    shared.metrics.job_phase(key, outcome.plan.status.get("phase"))
    _post_events(outcome.body, outcome.plan.events)
    if outcome.plan.requeue_after is not None:
        delay = min(delay, outcome.plan.requeue_after + 0.05)
    return delay


async def job_loop(name: str, namespace: str, meta: kopf.Meta, body: kopf.Body, stopped: kopf.DaemonStopped,
                   logger: logging.Logger, memo: kopf.Memo, **_: Any) -> None:
    """Reconcile the job whenever something changes, and at least every resyncSeconds."""
    shared: Shared = memo.shared
    key = (namespace, name)
    wake = shared.wake.setdefault(key, asyncio.Event())
    # A job never reconciled: its first pass starts from the body the event brought.
    new = None if body.get("status") else copy.deepcopy(dict(body))
    try:
        while not stopped:
            wake.clear()
            first, new = new, None
            # Later passes start from what the watches brought: `body` is kopf's live view of the
            # job (a shallow copy: the next event replaces it whole), the pods are cached.
            delay = await _reconcile_once(shared, key, meta, first, dict(body), logger)
            if delay is None:
                return
            if await _sleep(wake, stopped, delay):
                await _sleep(asyncio.Event(), stopped, COALESCE_SECONDS)
    finally:
        if shared.wake.get(key) is wake:
            del shared.wake[key]


# The event handlers are coroutines: they only look at the event and set an asyncio.Event,
# which must happen on the loop (a sync handler would run in a thread, once per pod event).
async def job_event(name: str, namespace: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    # Spec changes (scale, suspend) bump the generation; our own status writes do not.
    shared: Shared = memo.shared
    if meta.get("generation") != shared.seen_generation.get((namespace, name)):
        shared.wake_job(namespace, name)


async def pod_event(type: str, namespace: str, uid: str, labels: kopf.Labels, body: kopf.Body,
                    memo: kopf.Memo, **_: Any) -> None:
    # Only changes a decision can depend on wake the job (not the scheduler's conditions,
    # not the ADDED of a pending pod the job's own pass just created).
    shared: Shared = memo.shared
    if type == "DELETED":
        shared.pod_state.pop(uid, None)
        shared.controller.pods.forget(body)
    else:
        shared.controller.pods.observe(body)
        state = _pod_state(body)
        before = shared.pod_state.get(uid)
        shared.pod_state[uid] = state
        if state == before or (before is None and state == ("Pending", False, 0, False, False)):
            return
    shared.wake_job(namespace, labels[naming.LABEL_JOB])


async def read_progress(name: str, namespace: str, status: kopf.Status, memo: kopf.Memo,
                        patch: kopf.Patch, **_: Any) -> None:
    if status.get("phase") not in ("Running", "Restarting"):
        return
    shared: Shared = memo.shared
    new, memo.sample = await asyncio.get_running_loop().run_in_executor(
        shared.executor, shared.controller.read_progress, namespace, name, getattr(memo, "sample", None))
    if new:
        patch.status["progress"] = new


async def delete_children(name: str, namespace: str, uid: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    # Owner references would do it too, but the garbage collector may take a while.
    shared: Shared = memo.shared
    shared.metrics.job_phase((namespace, name), None)
    shared.seen_generation.pop((namespace, name), None)
    await asyncio.get_running_loop().run_in_executor(shared.executor, shared.controller.delete_children, namespace, name,
                                                     uid, meta.get("creationTimestamp"))


def register(registry: kopf.OperatorRegistry, progress_seconds: float) -> None:
    """Bind the handlers above to `registry`."""
    resource = dict(group=API_GROUP, version=API_VERSION, plural=PLURAL, registry=registry)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    # On deletion or pause the loop is told to stop and gets cancellation_backoff seconds to
    # finish its pass before it is cancelled.
    kopf.daemon(**resource, cancellation_backoff=1.0, cancellation_timeout=5.0)(job_loop)
    kopf.on.event(**resource)(job_event)
    kopf.on.event("", "v1", "pods", labels={naming.LABEL_MANAGED_BY: naming.MANAGED_BY, naming.LABEL_JOB: kopf.PRESENT},
                  registry=registry)(pod_event)
    kopf.timer(**resource, interval=progress_seconds, initial_delay=progress_seconds)(read_progress)
    # optional: this handler asks for no finalizer of its own. (The daemon and the timer do:
    # kopf holds a job with tfps.io/operator until it has stopped them, so a job deleted while
    # no operator runs waits for one; owner references remove its children either way.)
    kopf.on.delete(**resource, optional=True)(delete_children)
