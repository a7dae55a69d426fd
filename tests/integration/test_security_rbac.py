"""The operator, run with the chart's ServiceAccount token against the real API server, can do
all it needs and is refused what it does not need.

The chart's RBAC (`helm template`, applied as rendered: ServiceAccount, ClusterRole, Role,
bindings, the peering object and the operator's ConfigMap) is installed into the test's
namespace; a token for the chart's ServiceAccount comes from the TokenRequest API; a
kubeconfig built from it runs the real `tfps operator` process through a job's lifecycle
(Secret, NetworkPolicy, Service, pods, Events, status, pod restarts, deletion), and the
same token is refused (403) what the operator never does. Writes that must be refused are
sent as server-side dry runs, so a wrongly allowed one changes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from conftest import REPO, OperatorHarness, job_manifest
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from support import samples, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(540)]

CHART = REPO / "charts" / "tfps"
APPLIED = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "KopfPeering",
    "ClusterKopfPeering",
    "ConfigMap",
}


class ChartIdentity:
    """The chart's RBAC applied for one release; `kubeconfig` authenticates as its ServiceAccount."""

    def __init__(self, cluster, namespace: str, tmp: Path, namespaced: bool):
        self.cluster, self.namespace = cluster, namespace
        self.release = f"rbac-{namespace[-6:]}"
        sets = ["--set", f"operator.watchNamespaces={{{namespace}}}"] if namespaced else []
        out = subprocess.run(
            ["helm", "template", self.release, str(CHART), "--namespace", namespace, *sets],
            env=cluster.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        self.docs = [
            d
            for d in yaml.safe_load_all(out)
            if d and d["kind"] in APPLIED and (d["kind"] != "ConfigMap" or d["metadata"]["name"].endswith("-config"))
        ]
        self.cluster_scoped = [
            d for d in self.docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering")
        ]
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(self.docs))
        (sa,) = [d for d in self.docs if d["kind"] == "ServiceAccount"]
        self.service_account = sa["metadata"]["name"]
        core = client.CoreV1Api(cluster.api)
        token = core.create_namespaced_service_account_token(
            self.service_account, namespace, {"spec": {"expirationSeconds": 3600}}
        ).status.token
        admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
        self.kubeconfig = tmp / "operator-kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": admin["clusters"],
                    "users": [{"name": "operator", "user": {"token": token}}],
                    "contexts": [
                        {
                            "name": "operator",
                            "context": {
                                "cluster": admin["clusters"][0]["name"],
                                "user": "operator",
                                "namespace": namespace,
                            },
                        }
                    ],
                    "current-context": "operator",
                }
            )
        )
        self.api = config.new_client_from_config(config_file=str(self.kubeconfig))
        (cm,) = [d for d in self.docs if d["kind"] == "ConfigMap"]
        self.operator_config = yaml.safe_load(cm["data"]["config.yaml"])

    def peering(self) -> str:
        return next(d["metadata"]["name"] for d in self.docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering"))

    def close(self) -> None:
        self.api.close()
        for doc in self.cluster_scoped:
            self.cluster.kubectl("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", check=False)


@pytest.fixture
def namespaced_identity(crds, namespace, tmp_path):
    identity = ChartIdentity(crds, namespace, tmp_path, namespaced=True)
    yield identity
    identity.close()


@pytest.fixture
def clusterwide_identity(crds, namespace, tmp_path):
    identity = ChartIdentity(crds, namespace, tmp_path, namespaced=False)
    yield identity
    identity.close()


def test_operator_with_the_chart_token_runs_a_job_lifecycle(namespaced_identity, namespace, tmp_path):
    ident = namespaced_identity
    as_operator = dataclasses.replace(ident.cluster, env={**ident.cluster.env, "KUBECONFIG": str(ident.kubeconfig)})
    op = OperatorHarness(as_operator, namespace, tmp_path)  # the test's own calls stay admin (cluster.api)
    # The count below is the API server's, for every client: first let the namespaces that earlier
    # tests deleted finish terminating (the controller-manager is refused writes into them).
    core = client.CoreV1Api(ident.cluster.api)

    def recently_deleted() -> list[str]:  # (an older one stuck on a finalizer is nobody's churn now)
        now = datetime.now(UTC)
        return [
            n.metadata.name
            for n in core.list_namespace().items
            if n.status.phase == "Terminating"
            and n.metadata.deletion_timestamp
            and (now - n.metadata.deletion_timestamp).total_seconds() < 600
        ]

    wait_for("namespaces deleted by earlier tests gone", lambda: not recently_deleted(), timeout=240, interval=1)
    refused_before = _refused_requests(ident.cluster.api)
    op.start(f"--peering={ident.peering()}", config=ident.operator_config)
    try:
        # Gang-scheduled: the chart's default (`auto`) lets the operator create the job's Workload.
        job = op.create(job_manifest("rbac", ps=1, workers=2, run_policy={"schedulingPolicy": {}}))
        pods = op.wait_pods("rbac", {"rbac-ps-0", "rbac-worker-0", "rbac-worker-1"}, timeout=60)
        raw = json.loads(op.core.read_namespaced_pod("rbac-ps-0", namespace, _preload_content=False).data)
        assert raw["spec"]["workloadRef"] == {"name": "rbac", "podGroup": "training"}
        assert (
            op.core.read_namespaced_secret("rbac-tfps-auth", namespace).metadata.owner_references[0].uid
            == job["metadata"]["uid"]
        )
        networking = client.NetworkingV1Api(op.cluster.api)
        assert networking.read_namespaced_network_policy("rbac-tfps", namespace)
        assert op.core.read_namespaced_service("rbac", namespace)
        op.set_all("rbac", "Running")
        op.wait_phase("rbac", "Running")  # status subresource patched
        old = pods["rbac-worker-1"].metadata.uid
        op.set_pod("rbac-worker-1", "Failed", exit_code=1)  # the operator deletes and recreates it
        wait_for("worker-1 recreated", lambda: (p := op.pods("rbac").get("rbac-worker-1")) and p.metadata.uid != old)
        wait_for("events posted", lambda: {"Created", "Running", "PodRestarting"} <= {r for r, _ in op.events("rbac")})
        op.cluster.kubectl("delete", "tj", "rbac", "-n", namespace, "--wait=true", "--timeout=60s")  # kopf's finalizer
        wait_for(
            "children gone",
            lambda: (
                not op.core.list_namespaced_pod(namespace, label_selector="tfps.io/job-name=rbac").items
                and not op.core.list_namespaced_secret(namespace, field_selector="metadata.name=rbac-tfps-auth").items
                and not networking.list_namespaced_network_policy(namespace).items
            ),
        )
    finally:
        op.cleanup()
    # The API server's own count of the requests it answered 403: the operator made none.
    refused = _refused_requests(ident.cluster.api) - refused_before
    assert not refused, (refused, op.logs()[-4000:])


def _refused_requests(admin: client.ApiClient) -> Counter:
    """Requests the API server has answered 403 so far, by verb and resource (its
    apiserver_request_total metric, read as an admin)."""
    text = admin.call_api("GET", admin.configuration.host + "/metrics").read().decode()
    counts: Counter = Counter()
    for (name, labels), value in samples(text).items():
        labels = dict(labels)
        if name == "apiserver_request_total" and labels.get("code") == "403":
            counts[(labels.get("verb"), labels.get("resource"))] += value
    return counts


def _status(call) -> int:
    """The HTTP status of a call; a 403 counts only when RBAC refused it ("... cannot ..."),
    not an admission plugin."""
    try:
        call()
    except ApiException as err:
        if err.status == 403 and "cannot" not in str(err.body or ""):
            return -403
        return err.status
    return 200


DRY = {"dry_run": "All"}


def _raw(api: client.ApiClient, method: str, path: str, headers: dict | None = None) -> None:
    """A request the typed client has no method for, with the same token and CA."""
    cfg = api.configuration
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
    req = urllib.request.Request(
        cfg.host + path,
        method=method,
        headers={"Authorization": cfg.auth_settings()["BearerToken"]["value"], **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10):
            return
    except urllib.error.HTTPError as err:
        exc = ApiException(status=err.code, reason=err.reason)
        exc.body = err.read().decode(errors="replace")
        raise exc from err


def _refusals(api: client.ApiClient, ns: str) -> dict[str, object]:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    custom = client.CustomObjectsApi(api)
    secret = {"metadata": {"name": "stolen"}, "stringData": {"x": "y"}}
    pod = {"metadata": {"name": "intruder"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    return {
        "list secrets in its namespace": lambda: core.list_namespaced_secret(ns),
        "read a job's secret": lambda: core.read_namespaced_secret("any-tfps-auth", ns),
        "watch secrets": lambda: core.list_namespaced_secret(ns, watch=True, timeout_seconds=1, _preload_content=False),
        "list secrets cluster-wide": lambda: core.list_secret_for_all_namespaces(),
        "list secrets in another namespace": lambda: core.list_namespaced_secret("kube-system"),
        "create a secret in another namespace": lambda: core.create_namespaced_secret("default", secret, **DRY),
        "create a pod in another namespace": lambda: core.create_namespaced_pod("default", pod, **DRY),
        "list pods cluster-wide": lambda: core.list_pod_for_all_namespaces(),
        "list trainingjobs in another namespace": lambda: custom.list_namespaced_custom_object(
            "tfps.io", "v1alpha1", "default", "trainingjobs"
        ),
        "delete a namespace": lambda: core.delete_namespace(ns, **DRY),
        "create a namespace": lambda: core.create_namespace({"metadata": {"name": "intruder"}}, **DRY),
        "create a ClusterRole": lambda: rbac.create_cluster_role(
            {
                "metadata": {"name": "intruder"},
                "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}],
            },
            **DRY,
        ),
        "create a RoleBinding": lambda: rbac.create_namespaced_role_binding(
            ns,
            {
                "metadata": {"name": "intruder"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
                "subjects": [{"kind": "User", "name": "intruder"}],
            },
            **DRY,
        ),
        "exec into a pod": lambda: _raw(
            api, "POST", f"/api/v1/namespaces/{ns}/pods/rbac-ps-0/exec?command=id&stdout=true"
        ),
        "update a pod": lambda: core.patch_namespaced_pod("rbac-ps-0", ns, {"metadata": {"labels": {"x": "y"}}}, **DRY),
        "update a node": lambda: core.patch_node("tfps-local", {"metadata": {"labels": {"x": "y"}}}, **DRY),
        "list nodes": lambda: core.list_node(),
        "read configmaps": lambda: core.list_namespaced_config_map(ns),
        "create a CRD": lambda: client.ApiextensionsV1Api(api).delete_custom_resource_definition(
            "trainingjobs.tfps.io", **DRY
        ),
        "impersonate": lambda: _raw(api, "GET", "/api/v1/namespaces", {"Impersonate-User": "admin"}),
    }


def test_chart_token_is_refused_what_the_operator_does_not_need(namespaced_identity, namespace):
    results = {what: _status(call) for what, call in _refusals(namespaced_identity.api, namespace).items()}
    assert {what: code for what, code in results.items() if code != 403} == {}
    # ...while what it needs is allowed (dry runs, in its namespace).
    core = client.CoreV1Api(namespaced_identity.api)
    assert (
        _status(
            lambda: core.create_namespaced_secret(
                namespace, {"metadata": {"name": "ok"}, "stringData": {"a": "b"}}, **DRY
            )
        )
        == 200
    )
    assert _status(lambda: core.list_namespaced_pod(namespace)) == 200


CLUSTERWIDE_REFUSED = (
    "list secrets in its namespace",
    "read a job's secret",
    "watch secrets",
    "list secrets cluster-wide",
    "list secrets in another namespace",
    "delete a namespace",
    "create a namespace",
    "create a ClusterRole",
    "create a RoleBinding",
    "exec into a pod",
    "update a pod",
    "update a node",
    "list nodes",
    "read configmaps",
    "create a CRD",
    "impersonate",
)


def test_clusterwide_chart_token_still_cannot_read_secrets_or_escalate(clusterwide_identity, namespace):
    """Serving all namespaces, the operator may create pods and Secrets anywhere (it must), but
    still reads no Secret anywhere and cannot grant itself more."""
    refusals = _refusals(clusterwide_identity.api, namespace)
    results = {what: _status(refusals[what]) for what in CLUSTERWIDE_REFUSED}
    assert {what: code for what, code in results.items() if code != 403} == {}
