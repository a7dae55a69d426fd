"""The local control plane built by hack/ is a real one: CRD validation, RBAC, garbage collection
and scheduling are done by the real kube-apiserver, controller-manager and scheduler."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.test.tfps.io}
spec:
  group: test.tfps.io
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            required: [size]
            properties:
              size: {type: integer, minimum: 1, maximum: 10}
"""


def widget(size) -> str:
    return f"apiVersion: test.tfps.io/v1\nkind: Widget\nmetadata: {{name: w{size}}}\nspec: {{size: {size}}}\n"


def test_crd_object_validated_by_api_server(cluster, namespace):
    cluster.kubectl("apply", "-f", "-", input=CRD)
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.test.tfps.io", "--timeout=60s")
    # The discovery cache of a fresh CRD can lag a moment behind Established.
    wait_for(
        "the new kind served (a widget applied)",
        lambda: cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget(3), check=False).returncode == 0,
        timeout=30,
        interval=1,
    )
    assert cluster.kubectl("get", "widget", "w3", "-n", namespace, "-o", "jsonpath={.spec.size}").stdout == "3"

    too_big = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget(11), check=False)
    assert too_big.returncode != 0
    assert "spec.size" in too_big.stderr and "less than or equal to 10" in too_big.stderr
    wrong_type = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget('"big"'), check=False)
    assert wrong_type.returncode != 0 and "spec.size" in wrong_type.stderr
    assert cluster.kubectl("get", "widget", "w11", "-n", namespace, check=False).returncode != 0


def token_client(cluster, namespace: str, sa: str) -> client.ApiClient:
    core = client.CoreV1Api(cluster.api)
    tr = core.create_namespaced_service_account_token(
        sa, namespace, {"spec": {"audiences": [], "expirationSeconds": 600}}
    )
    cfg = client.Configuration()
    cfg.host = cluster.apiserver_url
    cfg.ssl_ca_cert = str(cluster.state_dir / "pki" / "ca.crt")
    cfg.api_key = {"authorization": tr.status.token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(cfg)


def test_rbac_enforced_for_service_account_token(cluster, namespace):
    core = client.CoreV1Api(cluster.api)
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods", "configmaps"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )

    as_reader = client.CoreV1Api(token_client(cluster, namespace, "reader"))

    def may_list_pods():
        try:
            return as_reader.list_namespaced_pod(namespace) is not None
        except ApiException as e:
            if e.status != 403:
                raise
            return False

    # the authorizer's informer sees the new binding shortly
    wait_for("the new RoleBinding to take effect", may_list_pods, timeout=30, interval=0.5)
    as_reader.list_namespaced_config_map(namespace)

    for denied in (
        lambda: as_reader.create_namespaced_config_map(namespace, {"metadata": {"name": "x"}}),
        lambda: as_reader.list_namespaced_secret(namespace),
        lambda: as_reader.list_namespaced_pod("default"),
    ):
        with pytest.raises(ApiException) as err:
            denied()
        assert err.value.status == 403
        assert "system:serviceaccount:" + namespace + ":reader" in err.value.body


def test_owner_reference_garbage_collection(cluster, namespace):
    core = client.CoreV1Api(cluster.api)
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}, "data": {"a": "1"}})
    core.create_namespaced_config_map(
        namespace,
        {
            "metadata": {
                "name": "child",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
                ],
            },
            "data": {"b": "2"},
        },
    )
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "bystander"}})

    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    def names():
        return {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}

    wait_for("the child collected", lambda: "child" not in names(), timeout=90, interval=0.5)
    assert "bystander" in names()


def gpu_pod(name: str, gpus: int) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "tensorflow",
                    "image": "tfps/worker:0.1.0",
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", "print('fits')"],
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }


def test_scheduler_binds_only_pods_that_fit(cluster, namespace):
    core = client.CoreV1Api(cluster.api)
    node = core.read_node(cluster.node_name)
    gpus = int(node.status.allocatable["nvidia.com/gpu"])
    core.create_namespaced_pod(namespace, gpu_pod("fits", 1))
    core.create_namespaced_pod(namespace, gpu_pod("too-big", gpus + 1))

    done = cluster.wait_pod(namespace, "fits", lambda p: p.status.phase == "Succeeded", what="Succeeded")
    assert done.spec.node_name == cluster.node_name

    def unschedulable(p):
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in p.status.conditions or []
        )

    big = cluster.wait_pod(namespace, "too-big", unschedulable, what="PodScheduled=False")
    assert big.status.phase == "Pending" and big.spec.node_name is None
    assert "nvidia.com/gpu" in next(c.message for c in big.status.conditions if c.type == "PodScheduled")
    wait_for(
        "a FailedScheduling event",
        lambda: [
            e.reason
            for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=too-big").items
            if e.reason == "FailedScheduling"
        ],
        timeout=30,
        interval=0.5,
    )


def test_cluster_sh_up_reuses_a_healthy_cluster(cluster):
    cluster_sh = str(Path(__file__).resolve().parents[2] / "hack" / "cluster.sh")
    env = {**cluster.env, "TFPS_STATE": str(cluster.state_dir)}
    # as this test session, so the cluster stays the session's to stop
    up = subprocess.run(
        [cluster_sh, "up", "--json", f"--session={os.getpid()}"], env=env, capture_output=True, text=True, timeout=300
    )
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout.splitlines()[-1])["started"] == []
    status = subprocess.run([cluster_sh, "status"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "readyz=200" in status.stdout, status.stdout
    for comp in cluster.hack.COMPONENTS:
        assert (cluster.state_dir / "logs" / f"{comp}.log").stat().st_size > 0
    exports = subprocess.run([cluster_sh, "env"], env=env, capture_output=True, text=True, check=True).stdout
    assert f"export KUBECONFIG={cluster.kubeconfig}" in exports


def test_a_killed_kubelet_is_started_again_and_the_node_stays_ready(cluster):
    """SIGKILL the node's kubelet process: its supervisor (hack/supervise.py, systemd's part on a
    real machine) starts it again, and the new kubelet reports the node Ready."""
    hc, p = cluster.hack, cluster.hack.Paths(cluster.state_dir)
    supervisor = hc.recorded_pid(p, "kubelet")
    (kubelet,) = hc.children(supervisor)
    killed_at = time.time()
    os.kill(kubelet, signal.SIGKILL)
    wait_for(
        "a new kubelet process", lambda: [c for c in hc.children(supervisor) if c != kubelet], timeout=30, interval=0.2
    )
    wait_for(
        "the node Ready, reported by the new kubelet",
        lambda: hc.node_ready(p, cluster.apiserver_url, since=killed_at),
        timeout=120,
        interval=1,
    )
    assert hc.recorded_pid(p, "kubelet") == supervisor
    assert "kubelet: killed by SIGKILL; starting it again" in cluster.kubelet_log_tail(400)
