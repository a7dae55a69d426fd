"""A real `tfps ps` process on loopback: PS 0 of a job of one PS and `workers` workers, with the job's
token (and no TLS), for tests that talk to it as workers and attackers do. Import as
`from support.ps_process import PSProcess`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import sample, scrape, wait_for


def spawn_ps(
    log: Path, job: str, address: str, workers: list[str], training: dict, token_file: Path, metrics_port: int
) -> subprocess.Popen:
    """`tfps ps` as PS 0 of a job of one PS and these workers, its output in `log`."""
    from tfps.api.naming import ENV_AUTH_TOKEN_FILE

    env = {
        **os.environ,
        "TF_CONFIG": json.dumps({"cluster": {"ps": [address], "worker": workers}, "task": {"type": "ps", "index": 0}}),
        "TFPS_JOB_NAME": job,
        "TFPS_NAMESPACE": "default",
        "TFPS_TRAINING": json.dumps(training),
        "TFPS_BIND_ADDRESS": "127.0.0.1",
        "TFPS_METRICS_PORT": str(metrics_port),
        ENV_AUTH_TOKEN_FILE: str(token_file),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tfps.cli.main", "ps"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def stop_ps(proc: subprocess.Popen) -> None:
    """SIGTERM (the PS checkpoints and exits), SIGKILL when it does not within 20 s."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class PSProcess:
    def __init__(self, tmp: Path, training: dict, token: str, workers: int = 1, job: str = "ps-process"):
        from tfps.api.naming import ENV_AUTH_TOKEN_FILE
        from tfps.runtime import auth
        from tfps.runtime.auth import ClientSecurity
        from tfps.runtime.ports import free_port

        self.job = job
        self.token_file = auth.write_material(tmp / "auth", token)
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tmp / "ps.log"
        worker_addresses = [f"127.0.0.1:{free_port()}" for _ in range(workers)]
        self.proc = spawn_ps(
            self.log, job, self.address, worker_addresses, training, self.token_file, self.metrics_port
        )
        self.security = ClientSecurity.from_env(False, {ENV_AUTH_TOKEN_FILE: str(self.token_file)})
        wait_for("the PS serving", self.serving, timeout=90, interval=0.3)

    def serving(self) -> bool:
        """The PS's health service (no token: probes get through) says SERVING."""
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        with grpc.insecure_channel(self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def metrics(self) -> str:
        return scrape(self.metrics_port)

    def rejected(self, reason: str, text: str | None = None) -> float:
        """tfps_ps_rejected_requests_total{reason}, from the PS's /metrics (or its text, when given)."""
        return sample(text or self.metrics(), "tfps_ps_rejected_requests_total", reason=reason) or 0.0

    def stop(self) -> None:
        stop_ps(self.proc)
