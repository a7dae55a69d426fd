"""Who may talk to a PS: the job's bearer token, and optionally TLS with the job's CA.

Every pod of a job mounts the job's Secret (created by the operator; `tfps local` writes the
same files per run) at one folder: `token`, and `ca.crt`, `tls.crt`, `tls.key`. The folder is
named by $TFPS_AUTH_TOKEN_FILE (the token file; the TLS files lie next to it).

- PS: `ServerSecurity.interceptor` refuses every call whose metadata lacks
  `authorization: Bearer <token>` (constant-time compare) with UNAUTHENTICATED and counts it
  in tfps_ps_rejected_requests_total{reason="unauthenticated"}; the standard health service
  stays open for probes. With spec.training.tls the port serves TLS with the job's cert.
- Worker: `ClientSecurity.channel` sends the token on every call, over TLS (verifying the
  PS against the job's CA) when spec.training.tls is set.
Without $TFPS_AUTH_TOKEN_FILE a PS runs open (and says so): a PS started by hand or by a test
on loopback. The operator always sets it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tfps.api.naming import CA_KEY, CERT_KEY, ENV_AUTH_TOKEN_FILE, KEY_KEY, TOKEN_KEY
from tfps.api.settings import ProcessSettings

from .health import HEALTH_SERVICE

log = logging.getLogger("tfps.auth")

METADATA_KEY = "authorization"
SCHEME = "Bearer "
OPEN_SERVICES = (f"/{HEALTH_SERVICE}/",)  # probes carry no token
REJECT_REASON = "unauthenticated"
REJECT_DETAIL = "missing or wrong bearer token for this job"


class SecurityError(RuntimeError):
    """The pod's security material is missing or unreadable: the process must not start open."""


@dataclass(frozen=True)
class Material:
    token: bytes
    ca_crt: bytes | None = None
    tls_crt: bytes | None = None
    tls_key: bytes | None = None

    @classmethod
    def from_env(cls, tls: bool, env: dict[str, str] | None = None) -> Material | None:
        """The material named by $TFPS_AUTH_TOKEN_FILE; None when unset. TLS files are read
        (and required) only with `tls`."""
        path = ProcessSettings.from_env(env).auth_token_file
        if not path:
            if tls:
                raise SecurityError(f"spec.training.tls is set but {ENV_AUTH_TOKEN_FILE} is not: no certificate to use")
            return None
        folder = Path(path).parent

        def read(p: Path) -> bytes:
            try:
                data = p.read_bytes()
            except OSError as err:
                raise SecurityError(f"cannot read {p}: {err}") from err
            if not data.strip():
                raise SecurityError(f"{p} is empty")
            return data

        token = read(Path(path)).strip()
        if not tls:
            return cls(token)
        return cls(token, read(folder / CA_KEY), read(folder / CERT_KEY), read(folder / KEY_KEY))

    @property
    def tls(self) -> bool:
        return self.tls_crt is not None


def write_material(folder: Path, token: str, tls: Any = None) -> Path:
    """Write the files a pod would see in its Secret volume (for `tfps local`); returns the
    token file. `tls` is a pki.TlsMaterial or None."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = {TOKEN_KEY: token.encode()}
    if tls is not None:
        files.update({CA_KEY: tls.ca_crt, CERT_KEY: tls.tls_crt, KEY_KEY: tls.tls_key})
    for name, data in files.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    return folder / TOKEN_KEY


# --- the PS side ----------------------------------------------------------------------------


def _deny_like(handler: grpc.RpcMethodHandler | None, on_reject) -> grpc.RpcMethodHandler:
    def deny(request_or_iterator, context: grpc.ServicerContext):
        on_reject()
        context.abort(grpc.StatusCode.UNAUTHENTICATED, REJECT_DETAIL)

    streaming_in = bool(handler and handler.request_streaming)
    streaming_out = bool(handler and handler.response_streaming)
    if streaming_in and streaming_out:
        return grpc.stream_stream_rpc_method_handler(deny)
    if streaming_in:
        return grpc.stream_unary_rpc_method_handler(deny)
    if streaming_out:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: bytes, on_reject):
        self._expected = SCHEME.encode() + token
        self._on_reject = on_reject

    def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        sent = next((v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY), "")
        sent = sent.encode() if isinstance(sent, str) else bytes(sent)
        if hmac.compare_digest(sent, self._expected):
            return continuation(handler_call_details)
        return _deny_like(continuation(handler_call_details), self._on_reject)


@dataclass(frozen=True)
class ServerSecurity:
    material: Material | None

    @classmethod
    def from_env(cls, tls: bool, env: dict[str, str] | None = None) -> ServerSecurity:
        material = Material.from_env(tls, env)
        if material is None:
            log.warning(
                json.dumps(
                    {
                        "event": "open",
                        "detail": f"{ENV_AUTH_TOKEN_FILE} is not set: "
                        "this PS accepts calls from anyone who can reach it",
                    }
                )
            )
        return cls(material)

    def interceptors(self, metrics=None, ps_index: int | None = None) -> tuple[grpc.ServerInterceptor, ...]:
        if self.material is None:
            return ()

        def on_reject() -> None:
            if metrics is not None:
                metrics.rejected.labels(reason=REJECT_REASON).inc()
            log.warning(json.dumps({"event": "rejected", "ps": ps_index, "reason": REJECT_REASON}))

        return (TokenInterceptor(self.material.token, on_reject),)

    def add_port(self, server: grpc.Server, address: str) -> int:
        if self.material is None or not self.material.tls:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials([(self.material.tls_key, self.material.tls_crt)])
        return server.add_secure_port(address, creds)


# --- the worker side ------------------------------------------------------------------------


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]):
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = (
            getattr(base, "wait_for_ready", None),
            getattr(base, "compression", None),
        )
        self.metadata = metadata


class _TokenSender(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: bytes):
        self._header = (METADATA_KEY, SCHEME + token.decode())

    def _details(self, details):
        return _CallDetails(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


@dataclass(frozen=True)
class ClientSecurity:
    material: Material | None

    @classmethod
    def from_env(cls, tls: bool, env: dict[str, str] | None = None) -> ClientSecurity:
        return cls(Material.from_env(tls, env))

    def channel(self, address: str, options: list) -> grpc.Channel:
        m = self.material
        if m is None:
            return grpc.insecure_channel(address, options=options)
        if m.tls:
            channel = grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=m.ca_crt), options=options
            )
        else:
            channel = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(channel, _TokenSender(m.token))
