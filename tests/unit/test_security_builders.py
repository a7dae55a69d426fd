"""The operator's security builders: the job's Secret, its NetworkPolicy, and the hardened,
Secret-mounting pods (pure functions, no cluster)."""

from __future__ import annotations

import base64
import datetime
import ipaddress
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from tfps.api import naming
from tfps.api.naming import dns_name
from tfps.api.spec import ReplicaType, TrainingJob
from tfps.operator import builders, security
from tfps.operator.config import OperatorConfig
from tfps.runtime import pki


def _job(name="digits", namespace="team-a", uid="1234", template=None, training=True) -> TrainingJob:
    spec = {
        "replicaSpecs": {
            "PS": {"replicas": 2, **({"template": template} if template else {})},
            "Worker": {"replicas": 3, **({"template": template} if template else {})},
        }
    }
    if training:
        spec["training"] = {"steps": 10}
    meta = {"name": name, "namespace": namespace, **({"uid": uid} if uid else {})}
    return TrainingJob.model_validate(
        {"apiVersion": "tfps.io/v1alpha1", "kind": "TrainingJob", "metadata": meta, "spec": spec}
    )


def _secret_files(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def test_auth_secret_is_owned_immutable_and_holds_token_and_tls():
    job = _job()
    secret = security.new_auth_secret(job)
    assert secret["kind"] == "Secret" and secret["type"] == "Opaque" and secret["immutable"] is True
    meta = secret["metadata"]
    assert (meta["name"], meta["namespace"]) == ("digits-tfps-auth", "team-a")
    assert meta["labels"][naming.LABEL_JOB] == "digits"
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("TrainingJob", "digits", "1234", True)
    files = _secret_files(secret)
    assert set(files) == {naming.TOKEN_KEY, naming.CA_KEY, naming.CERT_KEY, naming.KEY_KEY}
    assert len(files[naming.TOKEN_KEY]) >= 32


def test_each_job_gets_its_own_random_token_and_ca():
    a, b = _secret_files(security.new_auth_secret(_job("a"))), _secret_files(security.new_auth_secret(_job("a")))
    assert a[naming.TOKEN_KEY] != b[naming.TOKEN_KEY]
    assert a[naming.CA_KEY] != b[naming.CA_KEY]


def test_job_certificate_names_every_pod_and_is_signed_by_the_job_ca():
    files = _secret_files(security.new_auth_secret(_job()))
    ca = x509.load_pem_x509_certificate(files[naming.CA_KEY])
    cert = x509.load_pem_x509_certificate(files[naming.CERT_KEY])
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == ["*.digits.team-a.svc", "*.digits.team-a.svc.cluster.local"]
    # The wildcard covers the DNS name the operator writes into TF_CONFIG for every replica.
    host = dns_name("digits", "team-a", ReplicaType.PS, 1)
    assert host.split(".", 1)[1] == names[0].split(".", 1)[1]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages
    now = datetime.datetime.now(datetime.UTC)
    assert cert.not_valid_before_utc < now < cert.not_valid_after_utc
    key = serialization.load_pem_private_key(files[naming.KEY_KEY], None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()


def test_loopback_certificate_has_ip_names():
    cert = x509.load_pem_x509_certificate(pki.issue("x.local", ["localhost"], ["127.0.0.1"]).tls_crt)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


def test_network_policy_admits_grpc_and_data_path_only_from_the_same_job_and_metrics_from_anyone():
    job, config = _job(), OperatorConfig()
    policy = security.build_network_policy(job, config)
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["name"] == "digits-tfps"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "1234"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {naming.LABEL_JOB: "digits"}}
    assert spec["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = spec["ingress"]
    assert grpc_rule["ports"] == [{"protocol": "TCP", "port": 2222}, {"protocol": "TCP", "port": 2223}]
    assert grpc_rule["from"] == [{"podSelector": {"matchLabels": {naming.LABEL_JOB: "digits"}}}]
    assert metrics_rule == {"ports": [{"protocol": "TCP", "port": 9090}]}  # no `from`: anyone


def test_network_policy_metrics_from_is_configurable_and_policy_can_be_off():
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    config = OperatorConfig.model_validate(
        {"networkPolicy": {"metricsFrom": peers}, "ports": {"grpc": 3000, "metrics": 9100}}
    )
    _, metrics_rule = security.build_network_policy(_job(), config)["spec"]["ingress"]
    assert metrics_rule == {"ports": [{"protocol": "TCP", "port": 9100}], "from": peers}
    kinds = [
        o["kind"]
        for o in security.job_objects(_job(), OperatorConfig.model_validate({"networkPolicy": {"enabled": False}}))
    ]
    assert kinds == ["Secret"]
    assert [o["kind"] for o in security.job_objects(_job(), OperatorConfig())] == ["Secret", "NetworkPolicy"]


def test_secret_is_created_only_when_no_pod_of_the_job_exists():
    job = _job()
    every = [(ReplicaType.PS, i) for i in range(2)] + [(ReplicaType.WORKER, i) for i in range(3)]
    assert security.creates_every_pod(job, every)
    assert not security.creates_every_pod(job, every[1:])  # a restart: pods hold the token already


@pytest.mark.parametrize("training", [True, False])
def test_every_pod_mounts_the_job_secret_and_names_the_token_file(training):
    job = _job(training=training)
    for pod in builders.desired_pods(job, OperatorConfig()):
        spec = pod["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == security.AUTH_VOLUME]
        assert volume["secret"] == {"secretName": "digits-tfps-auth", "defaultMode": 0o440}
        (c,) = spec["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == security.AUTH_VOLUME]
        assert mount == {"name": security.AUTH_VOLUME, "mountPath": "/var/run/tfps/auth", "readOnly": True}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[naming.ENV_AUTH_TOKEN_FILE] == "/var/run/tfps/auth/token"
        assert spec["automountServiceAccountToken"] is False


def test_pods_are_hardened_by_default():
    """Non-root as the images' USER (10001), read-only root with a writable /tmp, no
    capabilities, no privilege escalation, RuntimeDefault seccomp."""
    dockerfile_user = "USER 10001:10001"
    images = Path(__file__).resolve().parents[2] / "images"
    for name in ("ps", "worker"):
        assert dockerfile_user in (images / name / "Dockerfile").read_text()
    for pod in builders.desired_pods(_job(), OperatorConfig()):
        ctx = pod["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 10001 and ctx["runAsGroup"] == 10001
        assert ctx["fsGroup"] == 10001 and ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        (c,) = pod["spec"]["containers"]
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert {"name": "tmp", "emptyDir": {}} in pod["spec"]["volumes"]


def test_chart_defaults_match_the_operator_defaults():
    values = yaml.safe_load((Path(__file__).resolve().parents[2] / "charts" / "tfps" / "values.yaml").read_text())
    config = OperatorConfig()
    assert values["runtime"]["podSecurityContext"] == config.pod_security_context
    assert values["runtime"]["containerSecurityContext"] == config.container_security_context
    assert values["runtime"]["networkPolicy"] == config.network_policy.model_dump(by_alias=True)


def test_user_template_keeps_its_own_volumes_and_env():
    template = {
        "spec": {
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [
                {
                    "name": "tensorflow",
                    "env": [{"name": "X", "value": "1"}],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
        }
    }
    pod = builders.build_pod(_job(template=template), ReplicaType.WORKER, 0, OperatorConfig())
    names = {v["name"] for v in pod["spec"]["volumes"]}
    assert {"data", "tmp", security.AUTH_VOLUME} <= names
    (c,) = pod["spec"]["containers"]
    assert {"name": "X", "value": "1"} in c["env"]
    assert {m["name"] for m in c["volumeMounts"]} == {"data", "tmp", security.AUTH_VOLUME}
