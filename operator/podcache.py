"""The operator's view of each job's pods, kept from the pod watch.

kopf already receives and decodes every event of the pods the operator labels; a reconcile
pass that lists the job's pods again decodes them a second time, and at a few thousand pods
that listing was most of the operator's CPU. So passes read the pods from here. A job's first
pass, a pass after an error, and any pass once the job's entry is older than the relist period
list instead and replace the entry: whatever a watch may have missed lives at most that long.

Only the fields decisions read are kept (status.PodView, kueue.release_patches), not whole pods.
Each pod is kept by name, and the newest resourceVersion wins, so an event that arrives late or
the answer to our own create or delete never overwrites a newer state.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

from tfps.api import naming

Key = tuple[str, str]  # namespace, job name

_META = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "labels",
    "annotations",
    "ownerReferences",
    "deletionTimestamp",
    "finalizers",
)
_STATUS = ("phase", "reason", "podIP")
_CONTAINER = ("name", "restartCount", "state", "lastState")


def slim(pod: dict[str, Any]) -> dict[str, Any]:
    """The part of a pod the decisions read."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    out_status = {k: status[k] for k in _STATUS if k in status}
    scheduled = [c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"]
    if scheduled:
        out_status["conditions"] = scheduled
    if status.get("containerStatuses"):
        out_status["containerStatuses"] = [{k: c[k] for k in _CONTAINER if k in c} for c in status["containerStatuses"]]
    return {"metadata": {k: meta[k] for k in _META if k in meta}, "status": out_status}


def version(obj: dict[str, Any]) -> int:
    # resourceVersions are etcd revisions; the API asks clients not to order them, but a cache
    # that mixes a watch with its own writes' answers must, and every release so far allows it.
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:
        return 0


def job_of(pod: dict[str, Any]) -> Key | None:
    meta = pod.get("metadata") or {}
    job = (meta.get("labels") or {}).get(naming.LABEL_JOB)
    return (meta.get("namespace", ""), job) if job else None


class PodCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[Key, dict[str, dict[str, Any]]] = {}
        self._gone: dict[Key, dict[str, int]] = {}  # uid -> resourceVersion of its deletion
        self._listed: dict[Key, float] = {}  # monotonic time of the last replace

    def observe(self, pod: dict[str, Any]) -> None:
        """A pod as a watch event or one of our writes brought it (created or changed)."""
        key, kept = job_of(pod), slim(pod)
        if key is None:
            return
        with self._lock:
            self._put(key, kept)

    def _put(self, key: Key, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if meta.get("uid") in self._gone.get(key, {}):
            return  # our create's answer after the pod's deletion event
        pods = self._jobs.get(key)
        if pods is None:
            return  # a job no pass has listed yet: its first pass lists
        before = pods.get(meta["name"])
        if before is None or version(pod) >= version(before):
            pods[meta["name"]] = pod

    def forget(self, pod: dict[str, Any]) -> None:
        """A pod's deletion event."""
        key = job_of(pod)
        if key is None:
            return
        meta = pod["metadata"]
        with self._lock:
            self._gone.setdefault(key, {})[meta.get("uid", "")] = version(pod)
            pods = self._jobs.get(key, {})
            if (pods.get(meta["name"]) or {}).get("metadata", {}).get("uid") == meta.get("uid"):
                del pods[meta["name"]]

    def mark_deleting(self, key: Key, name: str) -> None:
        """Our delete call succeeded: the pod counts as being deleted until its events say more."""
        with self._lock:
            pod = (self._jobs.get(key) or {}).get(name)
            if pod is not None and not pod["metadata"].get("deletionTimestamp"):
                stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                self._jobs[key][name] = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": stamp}}

    def replace(self, key: Key, pods: list[dict[str, Any]], list_version: str | None) -> None:
        """The job's pods as a list at `list_version` returned them. Pods the watch brought after
        that list are kept; pods it did not return and no later event saw are dropped."""
        try:
            at = int(list_version or 0)
        except ValueError:
            at = 0
        with self._lock:
            before = self._jobs.get(key, {})
            fresh = {p["metadata"]["name"]: slim(p) for p in pods}
            for name, pod in before.items():
                if version(pod) > at and (name not in fresh or version(pod) >= version(fresh[name])):
                    fresh[name] = pod
            self._jobs[key] = fresh
            self._listed[key] = time.monotonic()
            self._gone[key] = {uid: rv for uid, rv in self._gone.get(key, {}).items() if rv > at}

    def pods(self, key: Key, max_age: float | None = None) -> list[dict[str, Any]] | None:
        """The job's pods; None when no pass has listed them, or not in the last `max_age` seconds."""
        with self._lock:
            pods = self._jobs.get(key)
            if pods is None or (max_age is not None and time.monotonic() - self._listed[key] > max_age):
                return None
            return list(pods.values())

    def clear(self) -> None:
        """Every job's pods, after events may have been missed: the next passes list them."""
        with self._lock:
            self._jobs.clear()
            self._gone.clear()
            self._listed.clear()

    def drop(self, key: Key) -> None:
        """The job is gone."""
        with self._lock:
            self._jobs.pop(key, None)
            self._gone.pop(key, None)
            self._listed.pop(key, None)
