"""The Kubernetes API calls the operator makes (blocking; run in worker threads).

Objects go in and come out as plain dicts in the API's own (camelCase) shape, the shape
the builders produce and the reconcile plan reads.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypedDict, Unpack
from urllib.parse import urlencode

import urllib3
from kubernetes import client
from kubernetes import config as kube_config
from kubernetes.client.rest import ApiException

from tfps.api import naming
from tfps.api.spec import API_GROUP, API_VERSION, PLURAL, ReplicaType

log = logging.getLogger(__name__)


# The client asks its config loader for the credentials again before every request, and the
# loaders (in-cluster and kubeconfig alike) then rewrite the whole configuration, host and
# proxy settings included, a CPU cost paid on every request. A token is re-read at most this
# often instead (the in-cluster loader itself re-reads its file only once a minute).
CREDENTIALS_REFRESH_SECONDS = 5.0


def throttled(
    hook: Callable[[Any], None], seconds: float, clock: Callable[[], float] = time.monotonic
) -> Callable[[Any], None]:
    """`hook`, run at most once every `seconds`; the calls in between do nothing. The loaders'
    hook installs itself on the configuration again each time it runs: the one it installs is
    called from then on, and this one stays in front of it."""
    lock, last = threading.Lock(), [-math.inf]

    def refresh(configuration: Any) -> None:
        nonlocal hook
        with lock:
            now = clock()
            if now - last[0] < seconds:
                return
            last[0] = now
        hook(configuration)
        installed = getattr(configuration, "refresh_api_key_hook", None)
        if installed is not None and installed is not refresh:
            hook, configuration.refresh_api_key_hook = installed, refresh

    return refresh


def api_client(pool_size: int = 16) -> client.ApiClient:
    """An API client from the pod's service account, else from KUBECONFIG."""
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = pool_size
    if configuration.refresh_api_key_hook is not None:
        configuration.refresh_api_key_hook = throttled(configuration.refresh_api_key_hook, CREDENTIALS_REFRESH_SECONDS)
    return client.ApiClient(configuration)


# Resource names of the kinds the operator creates, where not the kind's name + "s".
PLURALS = {"NetworkPolicy": "networkpolicies"}

# No call may hang a job's loop: an overloaded API server gets this long, then the pass is retried.
TIMEOUT = (5, 30)  # seconds: connect, read


MERGE_PATCH = "application/merge-patch+json"


def _unless_gone(call, *args, **kwargs) -> bool:
    """Make a call about one object; False when the object does not exist (404)."""
    try:
        call(*args, **kwargs)
        return True
    except ApiException as err:
        if err.status == 404:
            return False
        raise


class _Options(TypedDict, total=False):
    """A request's options past its method, path and body (ApiCalls._request's keywords)."""

    content_type: str
    query: dict[str, Any] | None
    timeout: tuple[float, float]


def _path(api_version: str, kind: str, namespace: str, name: str = "") -> str:
    """The API path of a namespaced kind's collection, or of one object in it."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS.get(kind, kind.lower() + 's')}"
    return f"{path}/{name}" if name else path


def _pods_path(namespace: str | None) -> str:
    return f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"


def _job_path(namespace: str, name: str) -> str:
    return f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}"


class Kube:
    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def get_job(self, namespace: str, name: str) -> dict | None:
        try:
            return self._raw("GET", _job_path(namespace, name))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def patch_job_status(self, namespace: str, name: str, patch: dict) -> dict:
        """The job as the API server stored it after the patch."""
        return self._raw("PATCH", _job_path(namespace, name) + "/status", {"status": patch}, content_type=MERGE_PATCH)

    def delete_job(self, namespace: str, name: str) -> None:
        _unless_gone(self._raw, "DELETE", _job_path(namespace, name), query={"propagationPolicy": "Foreground"})

    def list_pods(self, namespace: str, job: str, rtype: ReplicaType | None = None) -> list[dict]:
        """The job's pods (of one replica type only, when given: less to read and decode)."""
        return self.pod_list(namespace, job, rtype)[0]

    def pod_list(self, namespace: str, job: str, rtype: ReplicaType | None = None) -> tuple[list[dict], str | None]:
        """The job's pods and the resourceVersion the list was read at."""
        selector = naming.job_selector(job) | ({naming.LABEL_TYPE: rtype.task_type} if rtype else {})
        resp = self._raw("GET", _pods_path(namespace), query={"labelSelector": naming.label_selector(selector)})
        return resp["items"], (resp.get("metadata") or {}).get("resourceVersion")

    def create(self, body: dict) -> dict | None:
        """Create a Pod, Service, Secret, NetworkPolicy, or a gang's Workload or PodGroup: the
        object as stored, or None when it already exists (creating twice is harmless). Sent as
        the JSON it is: the client's typed models would refuse fields of another Kubernetes
        version (a 1.35 pod's workloadRef)."""
        try:
            return self._raw("POST", _path(body["apiVersion"], body["kind"], body["metadata"]["namespace"]), body)
        except ApiException as err:
            if err.status == 409:
                return None
            raise

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves this resource (an alpha API may be off)."""
        try:
            found = self._raw("GET", f"/apis/{group}/{version}")
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources", []))

    def _raw(self, method: str, path: str, body: dict | None = None, **options: Unpack[_Options]) -> dict:
        """One request with the client's connection and credentials; the answer's JSON. The
        operator's frequent calls all come here: the generated methods validate every argument
        with pydantic and build typed models of the answer, several times the cost of the call."""
        data = self._request(method, path, body, **options).read()
        return json.loads(data) if data else {}

    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        content_type: str = "application/json",
        query: dict[str, Any] | None = None,
        timeout: tuple[float, float] = TIMEOUT,
    ) -> urllib3.BaseHTTPResponse:
        """urllib3's response (its body not yet read) to one request, on the client's connection
        pool and with its credentials; ApiException unless 2xx. The body goes out as the JSON it
        is: the client's own request path first walks every object to sanitise it, which for a
        pod costs more than encoding it."""
        api = self.core.api_client
        if query:
            path = f"{path}?{urlencode(query)}"
        method, url, headers, _, _ = api.param_serialize(
            method,
            path,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        resp = api.rest_client.pool_manager.request(
            method,
            url,
            body=data,
            headers=headers,
            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
            preload_content=False,
        )
        if not 200 <= resp.status < 300:
            raise ApiException(
                status=resp.status, reason=f"{resp.reason}: {resp.read()[:500].decode(errors='replace')}"
            )
        return resp

    def pods_version(self, namespace: str | None, selector: str) -> str:
        """The resourceVersion the API server is at now, to watch pods from."""
        query = {"labelSelector": selector, "limit": 1}
        return self._raw("GET", _pods_path(namespace), query=query)["metadata"]["resourceVersion"]

    def watch_pods(self, namespace: str | None, selector: str, version: str, seconds: int) -> Iterator[dict]:
        """Pod events ({"type", "object"} as the API sends them, BOOKMARKs included) after
        `version`, until the API server ends the watch after `seconds`. An ERROR event (410
        when `version` is too old) is raised as ApiException."""
        query = {
            "watch": "true",
            "labelSelector": selector,
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": seconds,
        }
        resp = self._request("GET", _pods_path(namespace), query=query, timeout=(TIMEOUT[0], seconds + TIMEOUT[1]))
        try:
            tail = b""
            for chunk in resp.stream(amt=None, decode_content=False):
                *lines, tail = (tail + chunk).split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise ApiException(status=status.get("code"), reason=status.get("message"))
                    yield event
        finally:
            resp.release_conn()

    def patch_pod(self, namespace: str, name: str, patch: dict) -> bool:
        """A JSON merge patch (lists replaced whole: a pod's finalizers); False when the pod is gone."""
        return _unless_gone(self._raw, "PATCH", _path("v1", "Pod", namespace, name), patch, content_type=MERGE_PATCH)

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> bool:
        """False when the pod was already gone."""
        query = {"gracePeriodSeconds": grace_seconds} if grace_seconds is not None else None
        return _unless_gone(self._raw, "DELETE", _path("v1", "Pod", namespace, name), query=query)

    def delete_children(self, namespace: str, job: str, job_uid: str, map_=map) -> int:
        """Delete the pods and the Service of a job being deleted (only those it owns)."""
        names = [
            pod["metadata"]["name"]
            for pod in self.list_pods(namespace, job)
            if any(o.get("uid") == job_uid for o in pod["metadata"].get("ownerReferences") or [])
        ]
        deleted = sum(map_(lambda n: self.delete_pod(namespace, n), names))
        self._delete_if_owned(_path("v1", "Service", namespace, naming.service_name(job)), job_uid)
        # The NetworkPolicy (if the job owns it) and the Secret go before the job does, so a new
        # job of the same name never finds the old ones. The operator may create and delete
        # Secrets but never read one, so the Secret goes by its name (the operator's own).
        self._delete_if_owned(
            _path("networking.k8s.io/v1", "NetworkPolicy", namespace, naming.network_policy_name(job)), job_uid
        )
        _unless_gone(self._raw, "DELETE", _path("v1", "Secret", namespace, naming.auth_secret_name(job)))
        return deleted

    def _delete_if_owned(self, path: str, job_uid: str) -> None:
        """Delete one object only when the job owns it; already gone is fine."""
        try:
            owners = self._raw("GET", path)["metadata"].get("ownerReferences") or []
        except ApiException as err:
            if err.status == 404:
                return
            raise
        if any(o.get("uid") == job_uid for o in owners):
            _unless_gone(self._raw, "DELETE", path)

    def ensure_peering(self, name: str, namespace: str | None) -> bool:
        """Create kopf's peering object if missing (without it replicas cannot see each
        other); False when kopf's peering CRDs are not installed."""
        body = {"apiVersion": "kopf.dev/v1", "metadata": {"name": name}}
        try:
            if namespace is None:
                self.custom.create_cluster_custom_object(
                    "kopf.dev", "v1", "clusterkopfpeerings", {**body, "kind": "ClusterKopfPeering"}
                )
            else:
                self.custom.create_namespaced_custom_object(
                    "kopf.dev", "v1", namespace, "kopfpeerings", {**body, "kind": "KopfPeering"}
                )
        except ApiException as err:
            if err.status == 409:
                return True
            if err.status == 404:
                return False
            if err.status == 403:
                log.warning(
                    "not allowed to create kopf peering %r in %s: it must exist for leader election",
                    name,
                    namespace or "the cluster",
                )
                return True
            raise
        return True
