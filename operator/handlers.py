"""Thin kopf handlers: settings, one reconcile loop (daemon) per TrainingJob, which also reads
its progress, wake-ups on spec changes and (from the operator's own pod watch, podwatch.py) on
pod changes, and cleanup on deletion.

The handlers are plain module-level functions; what they share (the controller, the wake-up
flag of each job, ...) is one `Shared` object in kopf's memo (`kopf.run(memo=...)`, see
operator/main.py). `register()` only binds them to a registry, so nothing happens at import
time.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypedDict

import kopf

from tfps.api import naming
from tfps.api.spec import API_GROUP, API_VERSION, PLURAL

from .config import OperatorConfig
from .controller import RELIST_SECONDS, Controller
from .metrics import OperatorMetrics
from .podwatch import PodWatch
from .status import scheduling_gated, unschedulable_reason

POD_SELECTOR = f"{naming.LABEL_MANAGED_BY}={naming.MANAGED_BY},{naming.LABEL_JOB}"
RETRY_SECONDS = 2.0  # after an API error, before the next attempt
# Pod events come in bursts (10 pods created, then scheduled, then started): one pass
# shortly after the first event sees them all instead of one pass per event.
COALESCE_SECONDS = 0.1
PROGRESS_PHASES = ("Running", "Restarting")  # when a job's PS pods have metrics to read


@dataclass
class Peering:
    """Leader election among operator replicas (kopf's peering)."""

    name: str
    priority: int = 0
    lifetime: int = 30
    standalone: bool = False


class PodState(NamedTuple):
    """What of a pod can change a job's status: a change of any of these wakes the job."""

    phase: str
    deleting: bool  # it has a deletionTimestamp
    restarts: int  # over its containers
    unschedulable: bool  # the scheduler said why it cannot place it
    gated: bool  # held by a scheduling gate (Kueue)


# A pod its job's own pass just created: seeing it ADDED is no news to that job.
NEW_POD = PodState(phase="Pending", deleting=False, restarts=0, unschedulable=False, gated=False)


@dataclass
class Shared:
    """What the handlers share, in kopf's memo: the controller and a wake-up flag per job."""

    controller: Controller
    executor: ThreadPoolExecutor
    config: OperatorConfig
    metrics: OperatorMetrics
    peering: Peering
    namespaces: list[str] = field(default_factory=list)  # served; none: the whole cluster
    pod_watch: PodWatch | None = None
    wake: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    seen_generation: dict[tuple[str, str], int] = field(default_factory=dict)
    pod_state: dict[str, PodState] = field(default_factory=dict)  # by pod uid

    def wake_job(self, namespace: str, name: str) -> None:
        event = self.wake.get((namespace, name))
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in self.wake.values():
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


def pod_state(pod: dict) -> PodState:
    """What of a pod can change a job's status."""
    status = pod.get("status") or {}
    return PodState(
        phase=status.get("phase") or "Pending",
        deleting=bool(pod.get("metadata", {}).get("deletionTimestamp")),
        restarts=sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []),
        unschedulable=unschedulable_reason(status) is not None,
        gated=scheduling_gated(status),
    )


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


async def _reconcile_once(
    shared: Shared, key: tuple[str, str], meta: kopf.Meta, first: dict | None, live: dict | None, logger: kopf.Logger
) -> tuple[float | None, str | None]:
    """One pass: the seconds until the next one (None when the job is gone), and the phase."""
    namespace, name = key
    delay = shared.config.resync_seconds
    try:
        outcome = await asyncio.get_running_loop().run_in_executor(
            shared.executor, shared.controller.reconcile, namespace, name, meta.get("creationTimestamp"), first, live
        )
    except Exception as err:  # API unavailable, conflict...: retried, never fatal
        shared.controller.pods.drop(key)  # and the retry reads everything again
        shared.metrics.reconcile_errors.inc()
        logger.warning("reconcile failed, retrying in %.0fs: %s", RETRY_SECONDS, err)
        return RETRY_SECONDS, None
    if outcome is None:
        return None, None  # gone or being deleted: the deletion handler takes over
    shared.seen_generation[key] = outcome.body["metadata"].get("generation", 0)
    phase = outcome.plan.status.get("phase")
    shared.metrics.job_phase(key, phase)
    _post_events(outcome.body, outcome.plan.events)
    if outcome.plan.requeue_after is not None:
        delay = min(delay, outcome.plan.requeue_after + 0.05)
    return delay, phase


@dataclass
class _Progress:
    """When a job's status.progress is due next, and the last sample (for examples per second)."""

    every: float
    due: float = 0.0
    sample: Any = None

    def __post_init__(self) -> None:  # the first read one period after the loop starts
        self.due = asyncio.get_running_loop().time() + self.every

    async def update(self, shared: Shared, key: tuple[str, str], logger: kopf.Logger) -> None:
        loop = asyncio.get_running_loop()
        self.due = loop.time() + self.every
        try:
            self.sample = await loop.run_in_executor(
                shared.executor, shared.controller.update_progress, *key, self.sample
            )
        except Exception as err:  # the next read tries again
            logger.warning("progress not written: %s", err)

    def seconds_left(self) -> float:
        return max(0.0, self.due - asyncio.get_running_loop().time())


def _job_key(namespace: str | None, name: str) -> tuple[str, str]:
    # kopf types the namespace optional for cluster-scoped resources; a TrainingJob is namespaced.
    assert namespace is not None, f"TrainingJob {name} without a namespace"
    return namespace, name


async def job_loop(
    name: str,
    namespace: str | None,
    meta: kopf.Meta,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Reconcile the job whenever something changes, and at least every resyncSeconds."""
    shared: Shared = memo.shared
    key = _job_key(namespace, name)
    wake = shared.wake.setdefault(key, asyncio.Event())
    # A job never reconciled: its first pass starts from the body the event brought.
    new = None if body.get("status") else copy.deepcopy(dict(body))
    # status.progress, from the PS pods' metrics, every progressSeconds while the job trains
    # (here rather than in a kopf timer: no second task per job, and a plain status patch).
    progress = _Progress(shared.config.progress_seconds)
    clock = asyncio.get_running_loop().time
    next_pass, phase = 0.0, None
    try:
        while not stopped:
            if clock() >= next_pass:
                wake.clear()
                first, new = new, None
                # Later passes start from what the watches brought: `body` is kopf's live view of
                # the job (a shallow copy: the next event replaces it whole), the pods are cached.
                delay, phase = await _reconcile_once(shared, key, meta, first, dict(body), logger)
                if delay is None:
                    return
                next_pass = clock() + delay
            training = phase in PROGRESS_PHASES
            if training and progress.seconds_left() == 0:
                await progress.update(shared, key, logger)
            until = next_pass - clock()
            if training:  # a wake-up for the progress alone does not run a pass
                until = min(until, progress.seconds_left())
            if await _sleep(wake, stopped, max(0.0, until)):
                await _sleep(asyncio.Event(), stopped, COALESCE_SECONDS)
                next_pass = 0.0
    finally:
        if shared.wake.get(key) is wake:
            del shared.wake[key]


# The event handler is a coroutine: it only looks at the event and sets an asyncio.Event,
# which must happen on the loop (a sync handler would run in a thread, once per job event).
async def job_event(name: str, namespace: str | None, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    # Spec changes (scale, suspend) bump the generation; our own status writes do not.
    shared: Shared = memo.shared
    key = _job_key(namespace, name)
    if meta.get("generation") != shared.seen_generation.get(key):
        shared.wake_job(*key)


def pod_changed(shared: Shared, type: str, pod: dict) -> tuple[str, str] | None:
    """A pod event (in the pod watch's thread): into the pod cache; the job to wake, when
    something a decision depends on changed (not the scheduler's conditions, not the ADDED of
    a pending pod the job's own pass just created)."""
    meta = pod.get("metadata") or {}
    uid = meta.get("uid", "")
    if type == "DELETED":
        shared.pod_state.pop(uid, None)
        shared.controller.pods.forget(pod)
    else:
        shared.controller.pods.observe(pod)
        state = pod_state(pod)
        before = shared.pod_state.get(uid)
        shared.pod_state[uid] = state
        if state == before or (before is None and state == NEW_POD):
            return None
    job = (meta.get("labels") or {}).get(naming.LABEL_JOB)
    return (meta.get("namespace", ""), job) if job else None


async def start_pod_watch(memo: kopf.Memo, **_: Any) -> None:
    shared: Shared = memo.shared
    loop = asyncio.get_running_loop()

    def on_event(type: str, pod: dict) -> None:
        job = pod_changed(shared, type, pod)
        if job is not None:
            loop.call_soon_threadsafe(shared.wake_job, *job)

    def on_gap() -> None:  # events may have been missed: every pass lists its pods again
        shared.controller.pods.clear()
        loop.call_soon_threadsafe(shared.wake_all)

    shared.pod_watch = PodWatch(
        shared.controller.kube, shared.namespaces, POD_SELECTOR, int(RELIST_SECONDS), on_event, on_gap
    )
    shared.pod_watch.start()


async def stop_pod_watch(memo: kopf.Memo, **_: Any) -> None:
    if memo.shared.pod_watch is not None:
        memo.shared.pod_watch.stop()


async def delete_children(
    name: str, namespace: str | None, uid: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    # Owner references would do it too, but the garbage collector may take a while.
    shared: Shared = memo.shared
    key = _job_key(namespace, name)
    shared.metrics.job_phase(key, None)
    shared.seen_generation.pop(key, None)
    await asyncio.get_running_loop().run_in_executor(
        shared.executor, shared.controller.delete_children, *key, uid, meta.get("creationTimestamp")
    )


class _Resource(TypedDict):
    """The TrainingJob resource and the registry, as kopf's decorators take them."""

    group: str
    version: str
    plural: str
    registry: kopf.OperatorRegistry


def register(registry: kopf.OperatorRegistry) -> None:
    """Bind the handlers above to `registry`."""
    resource = _Resource(group=API_GROUP, version=API_VERSION, plural=PLURAL, registry=registry)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.startup(registry=registry)(start_pod_watch)
    kopf.on.cleanup(registry=registry)(stop_pod_watch)
    kopf.on.login(registry=registry)(login)
    # On deletion or pause the loop is told to stop and gets cancellation_backoff seconds to
    # finish its pass before it is cancelled.
    kopf.daemon(**resource, cancellation_backoff=1.0, cancellation_timeout=5.0)(job_loop)
    kopf.on.event(**resource)(job_event)
    # optional: this handler asks for no finalizer of its own. (The daemon does:
    # kopf holds a job with tfps.io/operator until it has stopped them, so a job deleted while
    # no operator runs waits for one; owner references remove its children either way.)
    kopf.on.delete(**resource, optional=True)(delete_children)
