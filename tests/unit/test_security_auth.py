"""runtime/auth.py without sockets: reading a pod's security material, and the server
interceptor's decision (a real grpc.ServerInterceptor called the way grpcio calls it)."""

from __future__ import annotations

from collections import namedtuple

import grpc
import pytest

from tfps.api.naming import ENV_AUTH_TOKEN_FILE
from tfps.runtime import auth, pki, wire

Details = namedtuple("Details", "method invocation_metadata")


def test_no_token_file_means_open_and_a_missing_file_is_an_error(tmp_path):
    assert auth.Material.from_env(False, {}) is None
    with pytest.raises(auth.SecurityError):
        auth.Material.from_env(True, {})  # TLS asked for, nothing to serve it with
    with pytest.raises(auth.SecurityError):
        auth.Material.from_env(False, {ENV_AUTH_TOKEN_FILE: str(tmp_path / "absent")})


def test_material_reads_what_the_secret_volume_holds(tmp_path):
    tls = pki.issue("j.local", ["localhost"], ["127.0.0.1"])
    token_file = auth.write_material(tmp_path / "auth", "s3cret", tls)
    assert (token_file.stat().st_mode & 0o777) == 0o600
    env = {ENV_AUTH_TOKEN_FILE: str(token_file)}
    plain = auth.Material.from_env(False, env)
    assert plain.token == b"s3cret" and not plain.tls
    full = auth.Material.from_env(True, env)
    assert full.tls and full.ca_crt == tls.ca_crt and full.tls_key == tls.tls_key
    only_token = auth.write_material(tmp_path / "only", "s3cret")
    with pytest.raises(auth.SecurityError):
        auth.Material.from_env(True, {ENV_AUTH_TOKEN_FILE: str(only_token)})


STEP = wire.method_path("Step")


def _decide(metadata, method=STEP):
    rejected = []
    interceptor = auth.TokenInterceptor(b"s3cret", lambda: rejected.append(1))
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"ok")
    chosen = interceptor.intercept_service(lambda details: handler, Details(method, metadata))
    return chosen is handler, chosen


@pytest.mark.parametrize(
    "metadata, admitted",
    [
        ((("authorization", "Bearer s3cret"),), True),
        ((), False),
        ((("authorization", "Bearer wrong"),), False),
        ((("authorization", "s3cret"),), False),
        ((("authorization", "Bearer s3cret2"),), False),
        ((("x-other", "Bearer s3cret"),), False),
    ],
)
def test_interceptor_admits_only_the_job_token(metadata, admitted):
    assert _decide(metadata)[0] is admitted


def test_refusal_keeps_the_call_shape_and_health_is_open():
    interceptor = auth.TokenInterceptor(b"s3cret", lambda: None)
    stream = grpc.stream_stream_rpc_method_handler(lambda it, ctx: iter(()))
    denied = interceptor.intercept_service(lambda d: stream, Details(wire.method_path("StepStream"), ()))
    assert denied is not stream and denied.request_streaming and denied.response_streaming
    health = grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"")
    assert interceptor.intercept_service(lambda d: health, Details("/grpc.health.v1.Health/Check", ())) is health


@pytest.mark.parametrize("role", ["ps", "worker"])
def test_entry_point_refuses_to_start_without_its_named_token(role, tmp_path):
    """`tfps ps`/`tfps worker` whose token file is named but unreadable exit 2 at once, saying
    why, instead of serving open (exits before opening any socket)."""
    import json
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "TF_CONFIG": json.dumps(
            {"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "task": {"type": role, "index": 0}}
        ),
        "TFPS_TRAINING": json.dumps({"steps": 1}),
        ENV_AUTH_TOKEN_FILE: str(tmp_path / "missing" / "token"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tfps.cli.main", role], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot read" in proc.stderr and "token" in proc.stderr
