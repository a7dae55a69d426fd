"""Carrying out a reconcile Plan with the API: read job and pods, decide, write.

Blocking code, run in the operator's worker threads, one job at a time per job.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from tfps.runtime.spec import ReplicaType, TrainingJob

from . import builders, naming, progress, security
from .config import OperatorConfig
from .kube import Kube
from .metrics import OperatorMetrics
from .reconcile import Plan, plan
from .status import merge_patch, timestamp

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    body: dict  # the job as read before acting (for Events)
    plan: Plan


class Controller:
    def __init__(self, kube: Kube, config: OperatorConfig, metrics: OperatorMetrics):
        self.kube, self.config, self.metrics = kube, config, metrics
        # Pod creations of one job go out in parallel: a 2 PS + 8 worker job is 11 calls.
        self._fanout = ThreadPoolExecutor(max_workers=config.reconcile_workers, thread_name_prefix="tfps-create")

    def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """One level-based pass; None when the job is gone or being deleted."""
        started = time.perf_counter()
        body = self.kube.get_job(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        pods = self.kube.list_pods(namespace, name)
        result = plan(body, pods, datetime.now(timezone.utc))
        ctx = f"{namespace}/{name}"

        if result.create:  # first: the time to all pods created is what users wait for
            self._create(body, result)
        old = {k: v for k, v in (body.get("status") or {}).items() if k != "progress"}
        patch = merge_patch(old, result.status)
        if patch:  # before the deletions, so a restart is counted even if we die right after
            self.kube.patch_job_status(namespace, name, patch)
        for pod_name in result.restart:
            # Its containers have exited: no grace period to wait for.
            if self.kube.delete_pod(namespace, pod_name, grace_seconds=0):
                self.metrics.pods_restarted.inc()
                self.metrics.pods_deleted.inc()
                log.info("%s: restarting pod %s", ctx, pod_name)
        deleted = [n for n, ok in zip(result.delete, self._fanout.map(
            lambda n: self.kube.delete_pod(namespace, n), result.delete)) if ok]
        self.metrics.pods_deleted.inc(len(deleted))
        if deleted:
            log.info("%s: deleted pods %s", ctx, ", ".join(deleted))
        if result.delete_job:
            self.kube.delete_job(namespace, name)
            log.info("%s: deleted after ttlSecondsAfterFinished", ctx)
        self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        return Outcome(body=body, plan=result)

    def _create(self, body: dict, result: Plan) -> None:
        job = TrainingJob.model_validate(body)
        if security.creates_every_pod(job, result.create):  # the Secret must exist before any pod
            list(self._fanout.map(self.kube.create, security.job_objects(job, self.config)))
        pods = [builders.build_pod(job, rtype, index, self.config) for rtype, index in result.create]
        service = builders.build_service(job, self.config)
        created = sum(list(self._fanout.map(self.kube.create, [service, *pods]))[1:])
        self.metrics.pods_created.inc(created)
        if created:
            log.info("%s/%s: created %d pods", job.namespace, job.name, created)

    def read_progress(self, namespace: str, name: str, previous: progress.Sample | None) -> tuple[dict | None, progress.Sample | None]:
        """status.progress from the PS pods' metrics, and the sample to compare with next time."""
        pods = self.kube.list_pods(namespace, name)
        ips = [p["status"]["podIP"] for p in pods
               if p["metadata"]["labels"].get(naming.LABEL_TYPE) == ReplicaType.PS.task_type
               and (p.get("status") or {}).get("podIP") and p["status"].get("phase") == "Running"]
        pages = [page for page in (progress.scrape(ip, self.config.ports.metrics) for ip in ips) if page]
        sample = progress.combine(pages, time.monotonic())
        if sample is None:
            return None, previous
        return progress.to_status(sample, previous, timestamp(datetime.now(timezone.utc))), sample

    def delete_children(self, namespace: str, name: str, uid: str) -> None:
        deleted = self.kube.delete_children(namespace, name, uid, self._fanout.map)
        self.metrics.pods_deleted.inc(deleted)
