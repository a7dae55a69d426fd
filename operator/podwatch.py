"""The operator's own watch of the pods it made: one stream per served namespace (or one for
the cluster), read in a thread of its own.

kopf would deliver these events too, but it takes each one through its whole machinery (a
worker task per object, cause detection, handler invocation, logging context): at 3,000 pods
that was a large part of the operator's CPU, for events of which the operator only keeps a few
fields (podcache.slim). Here each event is decoded and handed to `on_event` directly.

The stream resumes from the last resourceVersion it saw (BOOKMARKs keep it fresh). When it
cannot (410 Gone: too old, or on the first start) events may have been missed: `on_gap` runs,
and the watch starts again from the API server's current version.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kubernetes.client.rest import ApiException

from .kube import Kube

log = logging.getLogger(__name__)

RETRY_SECONDS = 2.0  # after an error, before watching again


class PodWatch:
    def __init__(
        self,
        kube: Kube,
        namespaces: list[str],
        selector: str,
        seconds: int,
        on_event: Callable[[str, dict], None],
        on_gap: Callable[[], None],
    ):
        self.kube, self.selector, self.seconds = kube, selector, seconds
        self.on_event, self.on_gap = on_event, on_gap
        self._stopped = threading.Event()
        watched: list[str | None] = list(namespaces) or [None]  # None: the whole cluster
        self._threads = [
            threading.Thread(target=self._run, args=(ns,), name=f"tfps-podwatch-{ns or 'all'}", daemon=True)
            for ns in watched
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """No more events after the current one (a stream in progress ends with the process)."""
        self._stopped.set()

    def _run(self, namespace: str | None) -> None:
        version: str | None = None
        while not self._stopped.is_set():
            try:
                if version is None:
                    version = self.kube.pods_version(namespace, self.selector)
                    self.on_gap()
                for event in self.kube.watch_pods(namespace, self.selector, version, self.seconds):
                    if self._stopped.is_set():
                        return
                    pod = event["object"]
                    version = pod["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self.on_event(event["type"], pod)
            except ApiException as err:
                if err.status == 410:  # our version is too old: start from now
                    log.info("pod watch of %s expired; starting again", namespace or "the cluster")
                    version = None
                    continue
                log.warning(
                    "pod watch of %s failed, again in %.0fs: %s", namespace or "the cluster", RETRY_SECONDS, err
                )
                self._stopped.wait(RETRY_SECONDS)
            except Exception as err:  # connection lost, API server restarting...: resume from `version`
                log.warning(
                    "pod watch of %s interrupted, again in %.0fs: %s", namespace or "the cluster", RETRY_SECONDS, err
                )
                self._stopped.wait(RETRY_SECONDS)
