"""Carrying out a reconcile Plan with the API: read job and pods, decide, write.

Blocking code, run in the operator's worker threads, one job at a time per job.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from tfps.api import naming
from tfps.api.spec import ReplicaType, TrainingJob

from . import builders, gang, kueue, progress, security
from .calls import CREATE, OTHER, Key, PriorityPool, job_key
from .config import OperatorConfig
from .kube import Kube
from .metrics import OperatorMetrics
from .podcache import PodCache, version
from .reconcile import Plan, plan
from .status import counts_only, merge_patch, timestamp

log = logging.getLogger(__name__)

# A job's pods are listed again at least this often, whatever the pod watch brought (kopf
# re-establishes its watches as often: settings.watching.server_timeout).
RELIST_SECONDS = 300.0
# A change of the pod counts alone is written this long after it is first seen, together with
# whatever changed meanwhile: pods of a job start and finish in bursts, and each status write is
# an API call and a watch event for every client of the job. Phase, conditions and restarts are
# written at once.
COUNTS_DELAY_SECONDS = 1.0


def _own_status(body: dict) -> dict:
    """The watch's job with a status of its own: a pass changes only the status it plans from,
    and metadata (managedFields) and spec are most of a job's bytes, so they are not copied."""
    return {**body, "status": copy.deepcopy(body.get("status"))} if "status" in body else dict(body)


class CountsDelay:
    """When a status patch that changes only pod counts is written (COUNTS_DELAY_SECONDS)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = seconds, clock
        self._seen: dict[tuple[str, str], float] = {}  # when a count change not yet written was first seen

    def wait(self, job: tuple[str, str], patch: dict) -> float:
        """Seconds before this patch is written; 0: now (or nothing to write)."""
        if not counts_only(patch):
            self._seen.pop(job, None)
            return 0.0
        now = self.clock()
        left = self._seen.setdefault(job, now) + self.seconds - now
        if left <= 0:
            self._seen.pop(job, None)
        return max(left, 0.0)

    def forget(self, job: tuple[str, str]) -> None:
        self._seen.pop(job, None)


@dataclass
class Outcome:
    body: dict  # the job as read before acting (for Events)
    plan: Plan


class Controller:
    def __init__(self, kube: Kube, config: OperatorConfig, metrics: OperatorMetrics):
        self.kube, self.config, self.metrics = kube, config, metrics
        # Every API call of a pass goes through this pool: a job's creations go out in
        # parallel (a 2 PS + 8 worker job is 13 calls), creations before other calls, and
        # older jobs' before newer ones' (calls.py).
        self._calls = PriorityPool(config.reconcile_workers, "tfps-api")
        self.pods = PodCache()
        self._written: dict[tuple[str, str], dict] = {}  # each job as our last status write returned it
        self._counts = CountsDelay(COUNTS_DELAY_SECONDS)

    def _newest(self, job: tuple[str, str], live: dict) -> dict:
        """The watch's view of the job, unless our own last status write is newer than it."""
        written = self._written.get(job)
        return written if written is not None and version(written) > version(live) else live

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone: nothing kept about it."""
        self.pods.drop((namespace, name))
        self._written.pop((namespace, name), None)
        self._counts.forget((namespace, name))

    def reconcile(
        self,
        namespace: str,
        name: str,
        created: str | None = None,
        new_body: dict | None = None,
        live_body: dict | None = None,
    ) -> Outcome | None:
        """One level-based pass; None when the job is gone or being deleted. `created`: the
        job's creationTimestamp, which orders its calls among other jobs'. `new_body`: a job
        never reconciled (no status), as the watch just brought it. `live_body`: the job as the
        watch last brought it: the pass then reads nothing when the pod cache has the job's pods
        (listed within RELIST_SECONDS); without it, or without them, the pass reads both."""
        started = time.perf_counter()
        age = job_key(created, namespace, name)
        key = (OTHER, *age)
        job = (namespace, name)
        body, pods = self._read(key, job, new_body, live_body)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        result = plan(body, pods, datetime.now(UTC))

        if result.create:  # first: the time to all pods created is what users wait for
            created_all = self._create((CREATE, *age), body, result)
            if not created_all:  # some existed that this pass did not see: the next one reads them
                self.pods.drop(job)
                if new_body is not None:
                    result.requeue(0)
        old = {k: v for k, v in (body.get("status") or {}).items() if k != "progress"}
        patch = merge_patch(old, result.status)
        wait = self._counts.wait(job, patch)
        if wait:  # the pass that writes it
            result.requeue(wait)
        elif patch:  # before the deletions, so a restart is counted even if we die right after
            self._written[job] = self._calls.submit(key, self.kube.patch_job_status, namespace, name, patch).result()
        if kueue.enabled(self.config):  # Kueue's pod group first (operator/kueue.py)
            self._release_kueue_group(key, namespace, pods, body, result)
        self._delete_pods(key, job, result)
        if result.delete_job:
            self._calls.submit(key, self.kube.delete_job, namespace, name).result()
            log.info("%s/%s: deleted after ttlSecondsAfterFinished", namespace, name)
        self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        return Outcome(body=body, plan=result)

    def _read(
        self, key: Key, job: tuple[str, str], new_body: dict | None, live_body: dict | None
    ) -> tuple[dict | None, list[dict]]:
        """The job and its pods for one pass (see reconcile)."""
        if new_body is not None:
            # No reads: a new job has no pods, unless an operator died while creating them; those
            # answer 409 (no duplicate), and then the next pass reads everything.
            self.pods.replace(job, [], None)
            return new_body, []
        if live_body is not None:
            cached = self.pods.pods(job, RELIST_SECONDS)
            if cached is not None:
                return self._newest(job, _own_status(live_body)), cached
        # Both reads at once: they are independent, and the previous pass's writes are done.
        job_read = self._calls.submit(key, self.kube.get_job, *job)
        pods_read = self._calls.submit(key, self.kube.pod_list, *job)
        body = job_read.result()
        pods, version_ = pods_read.result()
        self.pods.replace(job, pods, version_)
        return body, pods

    def _delete_pods(self, key: Key, job: tuple[str, str], result: Plan) -> None:
        """The pods the plan restarts (deleted to be recreated) and those it deletes."""
        namespace = job[0]
        for pod_name in result.restart:
            # Its containers have exited: no grace period to wait for.
            if self._calls.submit(key, self.kube.delete_pod, namespace, pod_name, 0).result():
                self.pods.mark_deleting(job, pod_name)
                self.metrics.pods_restarted.inc()
                self.metrics.pods_deleted.inc()
                log.info("%s/%s: restarting pod %s", *job, pod_name)
        # (name, grace seconds): None keeps the pod's own grace period.
        grace = self.config.finished_pod_grace_seconds
        calls = [(n, None) for n in result.delete] + [(n, grace) for n in result.stop]
        results = self._calls.map(key, lambda call: self.kube.delete_pod(namespace, *call), calls)
        deleted = [name for (name, _), ok in zip(calls, results, strict=True) if ok]
        for pod_name in deleted:
            self.pods.mark_deleting(job, pod_name)
        self.metrics.pods_deleted.inc(len(deleted))
        if deleted:
            log.info("%s/%s: deleted pods %s", *job, ", ".join(deleted))

    def _create(self, key: Key, body: dict, result: Plan) -> bool:
        """Create the missing pods (and the Service, and on a job's first pods its Secret and
        NetworkPolicy); False when some already existed."""
        job = TrainingJob.model_validate(body)
        if security.creates_every_pod(job, result.create):  # the Secret must exist before any pod
            self._calls.map(key, self.kube.create, security.job_objects(job, self.config))
        pods = [builders.build_pod(job, rtype, index, self.config) for rtype, index in result.create]
        pods = kueue.label_pods(pods, job, self.config, result.status["startTime"])
        service = builders.build_service(job, self.config)
        group = gang.group_object(job, gang.backend_for(job, self.config.scheduling))
        if group is not None:  # before its pods: the scheduler holds a pod until its group exists
            self._calls.submit(key, self.kube.create, group).result()
        answers = self._calls.map(key, self.kube.create, [service, *pods])[1:]
        for answer in answers:
            if answer is not None:
                self.pods.observe(answer)
        created = sum(answer is not None for answer in answers)
        self.metrics.pods_created.inc(created)
        if created:
            log.info("%s/%s: created %d pods", job.namespace, job.name, created)
        return created == len(pods)

    def _release_kueue_group(self, key: Key, namespace: str, pods: list[dict], body: dict, result: Plan) -> None:
        """Before pods go: the whole group marked unretriable once the job ends, and Kueue's
        finalizer off the pods deleted while running or to be recreated."""
        patches = kueue.release_patches(
            pods,
            body["metadata"].get("uid", ""),
            ending=kueue.ending(result.status.get("phase")),
            restart=result.restart,
            delete=[*result.delete, *result.stop],
        )
        self._calls.map(key, lambda item: self.kube.patch_pod(namespace, *item), patches)

    def update_progress(self, namespace: str, name: str, previous: progress.Sample | None) -> progress.Sample | None:
        """Write status.progress from the PS pods' metrics, when they answer; the sample to
        compare with next time."""
        new, sample = self.read_progress(namespace, name, previous)
        if new:
            self._written[(namespace, name)] = self.kube.patch_job_status(namespace, name, {"progress": new})
        return sample

    def read_progress(
        self, namespace: str, name: str, previous: progress.Sample | None
    ) -> tuple[dict | None, progress.Sample | None]:
        """status.progress from the PS pods' metrics, and the sample to compare with next time."""
        pods = self.pods.pods((namespace, name))
        if pods is None:  # only the PS pods: less to read and decode
            pods = self.kube.list_pods(namespace, name, ReplicaType.PS)
        pods = [p for p in pods if p["metadata"]["labels"].get(naming.LABEL_TYPE) == ReplicaType.PS.task_type]
        ips = [
            p["status"]["podIP"]
            for p in pods
            if (p.get("status") or {}).get("podIP") and p["status"].get("phase") == "Running"
        ]
        pages = [page for page in (progress.scrape(ip, self.config.ports.metrics) for ip in ips) if page]
        sample = progress.combine(pages, time.monotonic())
        if sample is None:
            return None, previous
        return progress.to_status(sample, previous, timestamp(datetime.now(UTC))), sample

    def delete_children(self, namespace: str, name: str, uid: str, created: str | None = None) -> None:
        self.forget(namespace, name)
        key = (OTHER, *job_key(created, namespace, name))
        if kueue.enabled(self.config):  # the job is going: its Kueue pod group ends with it
            pods = self.kube.list_pods(namespace, name)
            patches = kueue.release_patches(pods, uid, ending=True, delete=[p["metadata"]["name"] for p in pods])
            self._calls.map(key, lambda item: self.kube.patch_pod(namespace, *item), patches)
        deleted = self.kube.delete_children(namespace, name, uid, lambda fn, items: self._calls.map(key, fn, items))
        self.metrics.pods_deleted.inc(deleted)
