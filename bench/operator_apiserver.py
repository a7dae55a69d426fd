"""The API server's own count of an operator's requests, for the operator benchmarks.

The operator under test runs as a ServiceAccount of its own (a token kubeconfig, bound to
cluster-admin), and a FlowSchema that matches only that account sends its requests to the
`exempt` priority level (never queued, so the count changes nothing). The API server then
counts exactly that client's requests, per flow schema, in
`apiserver_flowcontrol_dispatched_requests_total` (or, where a version leaves exempt requests
out of it, `apiserver_flowcontrol_request_execution_seconds_count`). Next to it,
`apiserver_request_total` gives every client's requests by verb and resource.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import yaml

ACCOUNT = "tfps-bench-operator"
FLOW_SCHEMA = "tfps-bench-operator"
FLOW_METRICS = (
    "apiserver_flowcontrol_dispatched_requests_total",
    "apiserver_flowcontrol_request_execution_seconds_count",
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\s+([0-9.eE+-]+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION")


def parse(text: str, names: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    """The samples of the named metrics in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line.startswith(names):
            continue
        m = _SAMPLE.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(2))), float(m.group(3))))
    return out


def flow_count(text: str) -> float | None:
    """Requests counted so far for the benchmark's flow schema (None: the server exposes neither metric)."""
    for name in FLOW_METRICS:
        values = [v for n, labels, v in parse(text, (name,)) if n == name and labels.get("flow_schema") == FLOW_SCHEMA]
        if values:
            return sum(values)
    return None


def requests_by(text: str) -> dict[str, float]:
    """`apiserver_request_total` summed per "VERB resource[/subresource]"."""
    out: dict[str, float] = defaultdict(float)
    for name, labels, value in parse(text, ("apiserver_request_total",)):
        if name != "apiserver_request_total":
            continue
        resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        out[f"{labels.get('verb', '')} {resource}"] += value
    return dict(out)


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def writes(counts: dict[str, float]) -> float:
    return sum(v for k, v in counts.items() if k.split(" ", 1)[0] in WRITE_VERBS)


def raw_get(api, path: str, query: list[tuple[str, str]] | None = None, timeout: float = 90):
    """GET `path` with the client's credentials; the urllib3 response, unread (a watch streams)."""
    method, url, headers, body, post = api.param_serialize(
        "GET", path, query_params=query or [], auth_settings=["BearerToken"]
    )
    resp = api.call_api(method, url, header_params=headers, body=body, post_params=post, _request_timeout=timeout)
    if resp.status >= 300:
        raise RuntimeError(f"GET {path}: {resp.status} {resp.read()[:200]!r}")
    return resp.response


def scrape(api) -> str:
    """GET /metrics on the API server with the benchmark's (admin) client."""
    return raw_get(api, "/metrics", timeout=60).data.decode()


def flow_schema(namespace: str) -> dict:
    everything = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "clusterScope": True, "namespaces": ["*"]}
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": FLOW_SCHEMA},
        "spec": {
            "priorityLevelConfiguration": {"name": "exempt"},
            "matchingPrecedence": 100,
            "rules": [
                {
                    "subjects": [
                        {"kind": "ServiceAccount", "serviceAccount": {"name": ACCOUNT, "namespace": namespace}}
                    ],
                    "resourceRules": [everything],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                }
            ],
        },
    }


def setup_identity(api, namespace: str, admin_kubeconfig: str) -> Path:
    """The ServiceAccount, its cluster-admin binding and the flow schema; a kubeconfig with
    its token (valid two hours), in a temporary file."""
    from kubernetes import client

    core, rbac, custom = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api), client.CustomObjectsApi(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": ACCOUNT}})
    binding = {
        "metadata": {"name": f"{ACCOUNT}-{namespace}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}],
    }
    _replace(
        lambda: rbac.delete_cluster_role_binding(binding["metadata"]["name"]),
        lambda: rbac.create_cluster_role_binding(binding),
    )
    _replace(
        lambda: custom.delete_cluster_custom_object("flowcontrol.apiserver.k8s.io", "v1", "flowschemas", FLOW_SCHEMA),
        lambda: custom.create_cluster_custom_object(
            "flowcontrol.apiserver.k8s.io", "v1", "flowschemas", flow_schema(namespace)
        ),
    )
    token = core.create_namespaced_service_account_token(
        ACCOUNT, namespace, {"spec": {"expirationSeconds": 7200}}
    ).status.token
    admin = yaml.safe_load(Path(admin_kubeconfig).read_text())
    context = (
        next(c for c in admin["contexts"] if c["name"] == admin.get("current-context"))
        if admin.get("current-context")
        else admin["contexts"][0]
    )
    cluster = next(c for c in admin["clusters"] if c["name"] == context["context"]["cluster"])
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": ACCOUNT, "context": {"cluster": cluster["name"], "user": ACCOUNT}}],
        "current-context": ACCOUNT,
    }
    with tempfile.NamedTemporaryFile("w", prefix="tfps-bench-operator-", suffix=".kubeconfig", delete=False) as out:
        yaml.safe_dump(kubeconfig, out)
    return Path(out.name)


def teardown_identity(api, namespace: str) -> None:
    from kubernetes import client

    for call in (
        lambda: client.RbacAuthorizationV1Api(api).delete_cluster_role_binding(f"{ACCOUNT}-{namespace}"),
        lambda: client.CustomObjectsApi(api).delete_cluster_custom_object(
            "flowcontrol.apiserver.k8s.io", "v1", "flowschemas", FLOW_SCHEMA
        ),
    ):
        with contextlib.suppress(client.ApiException):
            call()


def _replace(delete, create) -> None:
    from kubernetes import client

    with contextlib.suppress(client.ApiException):
        delete()
    create()
