"""The fake GPU nodes the scheduling tests run on (hack/kwok.py), against the real control plane."""

from __future__ import annotations

from kubernetes import client
from support import hack_module, wait_for


def test_a_kwok_nodes_pods_go_with_it(cluster, namespace, tmp_path):
    """Nodes stopped at a test's end take their pods with them: the next test that makes nodes of
    the same names finds them empty, not holding the GPUs of the pods that ran there before."""
    kwok = hack_module("kwok")
    core = client.CoreV1Api(cluster.api)
    node = kwok.node_manifest("kwok-gone-0", cpu="8", memory="32Gi", gpus=4)
    pod = {
        "metadata": {"name": "holds-the-gpus"},
        "spec": {
            **kwok.placement(),
            "nodeName": "kwok-gone-0",
            "containers": [
                {"name": "c", "image": "tfps/worker:0.1.0", "resources": {"limits": {"nvidia.com/gpu": "4"}}}
            ],
        },
    }
    with kwok.running(cluster.kubeconfig, [node], tmp_path / "kwok.log"):
        core.create_namespaced_pod(namespace, pod)
        wait_for(
            "the pod running",
            lambda: core.read_namespaced_pod("holds-the-gpus", namespace).status.phase == "Running",
            60,
        )

    assert "kwok-gone-0" not in {n.metadata.name for n in core.list_node().items}
    left = [p.metadata.name for p in core.list_pod_for_all_namespaces(field_selector="spec.nodeName=kwok-gone-0").items]
    assert not left, f"pods still bound to the deleted node: {left}"
