"""The PS admits only its own job: real `tfps ps` processes on loopback, real gRPC clients.

- a call without the job's token, or with a wrong one (another job's), is refused with
  UNAUTHENTICATED and counted in tfps_ps_rejected_requests_total{reason="unauthenticated"};
  a push with another job's token leaves the parameters unchanged; the health service
  stays open for probes;
- with spec.training.tls the PS serves TLS with the job's certificate: a client that trusts
  the job's CA and sends the token gets through, a plaintext client and a client trusting
  another CA are refused; a whole `tfps local` run with tls: true succeeds.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import sample, scrape, serving_records, tls_training, wait_for
from support.ps_process import spawn_ps, stop_ps

from tfps.api.naming import ENV_AUTH_TOKEN_FILE
from tfps.api.spec import TrainingJob, TrainingSpec, manifest_for
from tfps.runtime import auth, pki, wire
from tfps.runtime.auth import ClientSecurity, Material
from tfps.runtime.client import CLIENT_OPTIONS, ShardClient
from tfps.runtime.local import LocalRun, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRAINING = {
    "model": "digits-mlp",
    "modelArgs": {"hidden": [16]},
    "steps": 1000,
    "consistency": {"mode": "async"},
    "optimizer": {"name": "sgd", "learningRate": 0.1},
}


class PSProcess:
    """One `tfps ps` (PS 0 of a 1 PS + 1 worker job) with the job's auth folder."""

    def __init__(self, tmp: Path, tls: bool):
        self.tls = tls
        self.material = pki.issue("sec.local", ["localhost"], ["127.0.0.1"]) if tls else None
        self.token_file = auth.write_material(tmp / "auth", pki.new_token(), self.material)
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        training = {**TRAINING, "tls": tls, "checkpoint": {"path": str(tmp / "ckpt")}}
        self.log = tmp / "ps.log"
        self.proc = spawn_ps(
            self.log, "sec", self.address, ["127.0.0.1:1"], training, self.token_file, self.metrics_port
        )
        self.own = ClientSecurity.from_env(tls, {ENV_AUTH_TOKEN_FILE: str(self.token_file)})
        self._wait_serving()

    def _health_channel(self) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(self.address, grpc.ssl_channel_credentials(self.material.ca_crt))
        return grpc.insecure_channel(self.address)

    def _wait_serving(self, timeout: float = 90) -> None:
        def serving() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with self._health_channel() as channel:  # no token: probes must get through
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_for("the PS serving", serving, timeout=timeout, interval=0.3)

    def client(self, security: ClientSecurity | None) -> ShardClient:
        return ShardClient(self.address, 0, retry_seconds=0, security=security)

    def rejected(self) -> float:
        return sample(scrape(self.metrics_port), "tfps_ps_rejected_requests_total", reason="unauthenticated") or 0.0

    def stop(self) -> None:
        stop_ps(self.proc)


@pytest.fixture(scope="module")
def plain_ps(tmp_path_factory):
    ps = PSProcess(tmp_path_factory.mktemp("plain"), tls=False)
    yield ps
    ps.stop()


@pytest.fixture(scope="module")
def tls_ps(tmp_path_factory):
    ps = PSProcess(tmp_path_factory.mktemp("tls"), tls=True)
    yield ps
    ps.stop()


def _other_job(tmp: Path, tls: bool) -> ClientSecurity:
    """What a pod of another job holds: its own token (and its own job's CA)."""
    material = pki.issue("other.local", ["localhost"], ["127.0.0.1"]) if tls else None
    return ClientSecurity.from_env(tls, {ENV_AUTH_TOKEN_FILE: str(auth.write_material(tmp, pki.new_token(), material))})


def _push(client: ShardClient, version: int, grads: dict) -> wire.Message:
    return client.step({"worker": 0, "tag": version, "pull": True, "batch": 1}, grads, large=False)


@pytest.mark.parametrize("who", ["no token", "wrong token"])
def test_call_without_the_right_token_is_refused_and_counted(plain_ps, who):
    security = None if who == "no token" else ClientSecurity(Material(b"not-the-token"))
    before = plain_ps.rejected()
    client = plain_ps.client(security)
    try:
        for call in (client.status, client.finish, client.pull_full):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        client.close()
    assert plain_ps.rejected() == before + 3


def test_a_pod_of_another_job_cannot_push_gradients(plain_ps, tmp_path):
    own = plain_ps.client(plain_ps.own)
    intruder = plain_ps.client(_other_job(tmp_path, tls=False))
    try:
        params = own.pull_full()
        version = own.status()["version"]
        grads = {name: np.ones_like(value) for name, value in params.tensors.items()}
        before = plain_ps.rejected()
        with pytest.raises(grpc.RpcError) as err:
            _push(intruder, version, grads)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert plain_ps.rejected() == before + 1
        after = own.pull_full()
        assert own.status()["version"] == version
        for name, value in params.tensors.items():
            np.testing.assert_array_equal(after.tensors[name], value, err_msg=name)
        # The same push with the job's own token is applied: it was refused for who sent it.
        reply = _push(own, version, grads)
        assert reply.meta["version"] == version + 1
    finally:
        own.close()
        intruder.close()


def test_health_service_stays_open_for_probes(plain_ps):
    with grpc.insecure_channel(plain_ps.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=wire.SERVICE), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_with_the_job_ca_and_token_gets_through(tls_ps):
    client = tls_ps.client(tls_ps.own)
    try:
        assert client.status()["version"] >= 0
    finally:
        client.close()


def test_tls_refuses_plaintext_and_other_cas(tls_ps, tmp_path):
    # Plaintext (even with the right token) never completes a call: the port speaks TLS only.
    plaintext = ClientSecurity(Material(tls_ps.own.material.token))
    other_ca = _other_job(tmp_path, tls=True)
    # The right CA without a token: TLS alone does not admit a caller.
    no_token = grpc.secure_channel(
        tls_ps.address, grpc.ssl_channel_credentials(tls_ps.material.ca_crt), options=CLIENT_OPTIONS
    )
    for security in (plaintext, other_ca):
        client = tls_ps.client(security)
        try:
            with pytest.raises(grpc.RpcError) as err:
                client.status(timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            client.close()
    before = tls_ps.rejected()
    with pytest.raises(grpc.RpcError) as err:
        no_token.unary_unary(wire.method_path("Status"))(b"", timeout=5)
    no_token.close()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert tls_ps.rejected() == before + 1


def test_tls_training_run_succeeds_end_to_end(tmp_path):
    replicas = {"PS": {"replicas": 2}, "Worker": {"replicas": 2}}
    spec = {"replicaSpecs": replicas, "training": tls_training(60), "runPolicy": {"activeDeadlineSeconds": 240}}
    job = TrainingJob.model_validate(manifest_for("tls", spec))
    run = LocalRun(job, workdir=tmp_path, keep_workdir=True)
    result = run.run()
    assert result["succeeded"], result.get("logs")
    assert result["steps"] == 60
    assert result["accuracy"] > 0.5
    for name in ("ps-0", "ps-1"):
        serving = serving_records((tmp_path / f"{name}.log").read_text())
        assert serving and serving[0]["tls"] is True and serving[0]["auth"] is True
    assert TrainingSpec.model_validate(job.spec.training.to_manifest()).tls is True
