"""The operator's security objects on the real API server (kube-apiserver + etcd +
controller-manager), and pods that use them on the node.

- each job gets its Secret (owned by the job, immutable, token + CA + certificate) and its
  NetworkPolicy, both before its pods; every pod mounts the Secret; a pod recreated after a
  failure finds the same Secret (never rotated under running pods); deleting the job
  removes both;
- a training job with spec.training.tls runs to Succeeded on the node: PS and worker
  processes read the mounted Secret, talk TLS over the pods' DNS names, the PS says so.
NetworkPolicies are not enforced here (no CNI runs on this machine): the test checks the
object the API server stored, not packets being dropped.
"""

from __future__ import annotations

import base64

import pytest
from conftest import job_manifest
from kubernetes.client.rest import ApiException
from support import serving_records, tls_training, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _secret(op, name):
    try:
        return op.core.read_namespaced_secret(name, op.namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _policy(op, name):
    from kubernetes import client

    try:
        return client.NetworkingV1Api(op.cluster.api).read_namespaced_network_policy(name, op.namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def test_job_gets_its_secret_and_network_policy_and_pods_mount_it(tfps_operator):
    op, ns = tfps_operator, tfps_operator.namespace
    job = op.create(job_manifest("sec", ps=1, workers=2))
    uid = job["metadata"]["uid"]
    pods = op.wait_pods("sec", {"sec-ps-0", "sec-worker-0", "sec-worker-1"})

    secret = _secret(op, "sec-tfps-auth")
    assert secret is not None and secret.immutable is True and secret.type == "Opaque"
    assert set(secret.data) == {"token", "ca.crt", "tls.crt", "tls.key"}
    assert len(base64.b64decode(secret.data["token"])) >= 32
    (owner,) = secret.metadata.owner_references
    assert (owner.kind, owner.name, owner.uid, owner.controller) == ("TrainingJob", "sec", uid, True)
    for pod in pods.values():  # created before the pods
        assert secret.metadata.creation_timestamp <= pod.metadata.creation_timestamp
        (volume,) = [v for v in pod.spec.volumes if v.name == "tfps-auth"]
        assert volume.secret.secret_name == "sec-tfps-auth"
        (c,) = pod.spec.containers
        assert any(
            m.name == "tfps-auth" and m.mount_path == "/var/run/tfps/auth" and m.read_only for m in c.volume_mounts
        )
        assert {e.name: e.value for e in c.env}["TFPS_AUTH_TOKEN_FILE"] == "/var/run/tfps/auth/token"
        assert pod.spec.automount_service_account_token is False
        assert pod.spec.security_context.run_as_non_root and pod.spec.security_context.run_as_user == 10001
        assert c.security_context.read_only_root_filesystem and c.security_context.capabilities.drop == ["ALL"]

    policy = _policy(op, "sec-tfps")
    assert policy is not None and policy.metadata.owner_references[0].uid == uid
    assert policy.spec.pod_selector.match_labels == {"tfps.io/job-name": "sec"}
    assert policy.spec.policy_types == ["Ingress"]
    grpc_rule, metrics_rule = policy.spec.ingress
    assert [(p.port, p.protocol) for p in grpc_rule.ports] == [(2222, "TCP"), (2223, "TCP")]  # gRPC and the data path
    assert [peer.pod_selector.match_labels for peer in grpc_rule._from] == [{"tfps.io/job-name": "sec"}]
    assert [(p.port, p.protocol) for p in metrics_rule.ports] == [(9090, "TCP")] and metrics_rule._from is None

    # A failed worker is recreated; the Secret stays the same object (no rotation).
    op.set_all("sec", "Running")
    old_uid = pods["sec-worker-1"].metadata.uid
    op.set_pod("sec-worker-1", "Failed", exit_code=1)
    wait_for("worker-1 recreated", lambda: (p := op.pods("sec").get("sec-worker-1")) and p.metadata.uid != old_uid)
    again = _secret(op, "sec-tfps-auth")
    assert (again.metadata.uid, again.data["token"]) == (secret.metadata.uid, secret.data["token"])

    op.cluster.kubectl("delete", "tj", "sec", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for("secret and policy gone", lambda: _secret(op, "sec-tfps-auth") is None and _policy(op, "sec-tfps") is None)


def test_two_jobs_get_different_tokens(tfps_operator):
    op = tfps_operator
    for name in ("a", "b"):
        op.create(job_manifest(name, ps=1, workers=1))
    tokens = wait_for(
        "two secrets",
        lambda: (
            all(_secret(op, f"{n}-tfps-auth") for n in "ab")
            and [_secret(op, f"{n}-tfps-auth").data["token"] for n in "ab"]
        ),
    )
    assert tokens[0] != tokens[1]


def test_tls_training_job_succeeds_on_the_node(tfps_operator):
    op, ns = tfps_operator, tfps_operator.namespace
    run_policy = {"activeDeadlineSeconds": 240, "cleanPodPolicy": "None"}
    op.create(job_manifest("tls", ps=1, workers=1, template={}, training=tls_training(40), run_policy=run_policy))
    status = op.wait_phase("tls", "Succeeded", timeout=240)
    assert status["phase"] == "Succeeded"
    log = op.cluster.pod_log(ns, "tls-ps-0")
    serving = serving_records(log)
    assert serving and serving[0]["tls"] is True and serving[0]["auth"] is True, log[-2000:]
    # The worker dialled the PS by its pod DNS name (what the certificate names).
    assert f"tls-ps-0.tls.{ns}.svc:2222" in op.cluster.pod_log(ns, "tls-worker-0")
