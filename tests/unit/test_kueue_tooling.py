"""hack/kueue.py without a cluster: the webhooks and the Configuration it gives Kueue, read from
Kueue's own module (KUEUE_VERSION), must reach only pods of labelled namespaces and Kueue's own
objects, and only 127.0.0.1."""

from __future__ import annotations

import shutil

import pytest
from support import hack_module

kueue = hack_module("kueue")


@pytest.fixture(scope="module")
def module():
    if not shutil.which("go"):
        pytest.skip("no Go toolchain: Kueue's module cannot be read")
    return kueue.module_dir()


def test_webhooks_reach_127_0_0_1_and_pods_only_in_labelled_namespaces(module):
    configs = kueue.webhooks(module, 9443, b"-----BEGIN CERTIFICATE-----\n")
    assert {c["kind"]: c["metadata"]["name"] for c in configs} == kueue.WEBHOOK_NAMES
    hooks = [h for c in configs for h in c["webhooks"]]
    names = {h["name"] for h in hooks}
    assert {"mpod.kb.io", "vpod.kb.io", "mworkload.kb.io", "vclusterqueue.kb.io"} <= names
    assert not names & {"mjob.kb.io", "mdeployment.kb.io", "vstatefulset.kb.io"}  # integrations left off
    for hook in hooks:
        assert hook["clientConfig"]["url"].startswith("https://127.0.0.1:9443/")
        assert "service" not in hook["clientConfig"] and hook["clientConfig"]["caBundle"]
        groups = {g for rule in hook["rules"] for g in rule["apiGroups"]}
        if "" in groups:  # pods: a dead Kueue blocks pod creation only where it was asked to queue
            assert hook["namespaceSelector"] == {"matchLabels": {"tfps.io/kueue": "on"}}
        else:
            assert groups == {"kueue.x-k8s.io"}
    assert all(c["metadata"]["labels"][kueue.OWNER_LABEL[0]] == kueue.OWNER_LABEL[1] for c in configs)


def test_crds_come_from_the_module_and_are_marked_for_removal(module):
    crds = kueue.crds(module)
    names = {c["metadata"]["name"] for c in crds}
    assert {
        "workloads.kueue.x-k8s.io",
        "clusterqueues.kueue.x-k8s.io",
        "localqueues.kueue.x-k8s.io",
        "resourceflavors.kueue.x-k8s.io",
    } <= names
    assert all(c["metadata"]["labels"][kueue.OWNER_LABEL[0]] == kueue.OWNER_LABEL[1] for c in crds)


def test_configuration_manages_pods_of_labelled_namespaces_and_listens_on_loopback(tmp_path):
    cfg = kueue.configuration(9443, 9444, 9445, tmp_path)
    assert cfg["integrations"] == {"frameworks": ["pod"]}
    assert cfg["managedJobsNamespaceSelector"] == {"matchLabels": {"tfps.io/kueue": "on"}}
    assert cfg["leaderElection"] == {"leaderElect": False} and cfg["internalCertManagement"] == {"enable": False}
    assert cfg["metrics"]["bindAddress"].startswith("127.0.0.1:") and cfg["health"][
        "healthProbeBindAddress"
    ].startswith("127.0.0.1:")
    assert cfg["webhook"] == {"port": 9443, "host": "127.0.0.1", "certDir": str(tmp_path)}
