"""The standard gRPC health service (`grpc.health.v1.Health`, Check and Watch) without protobuf.

A PS answers kubelet's gRPC probes and `grpc_health_probe` with it. grpcio-health-checking's
servicer would bring protobuf's resident memory into a process whose whole overhead beyond its
shard is a goal (PS peak RSS ≤ 1.3× its parameters and slots), for two messages of one field
each. Their encodings are written here: the request is
`HealthCheckRequest{string service = 1}`, the reply `HealthCheckResponse{ServingStatus status = 1}`
(the tests ask with grpcio-health-checking's own client).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import grpc

HEALTH_SERVICE = "grpc.health.v1.Health"

# HealthCheckResponse.ServingStatus
SERVING = 1
SERVICE_UNKNOWN = 3  # Watch of a service this server does not know

_SERVICE_FIELD = 1
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


class MalformedRequest(ValueError):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise MalformedRequest("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def requested_service(request: bytes) -> str:
    """The `service` of an encoded HealthCheckRequest ("" when absent); fields it does not
    know are skipped, as protobuf does."""
    service, pos = "", 0
    while pos < len(request):
        key, pos = _varint(request, pos)
        field, kind = key >> 3, key & 7
        if kind == _VARINT:
            _, pos = _varint(request, pos)
        elif kind == _LENGTH_DELIMITED:
            size, pos = _varint(request, pos)
            if pos + size > len(request):
                raise MalformedRequest("truncated field")
            if field == _SERVICE_FIELD:
                try:
                    service = request[pos : pos + size].decode()
                except UnicodeDecodeError as err:
                    raise MalformedRequest("service name is not UTF-8") from err
            pos += size
        elif kind in (_FIXED64, _FIXED32):
            pos += 8 if kind == _FIXED64 else 4
        else:
            raise MalformedRequest(f"wire type {kind}")
    if pos > len(request):
        raise MalformedRequest("truncated field")
    return service


def response(status: int) -> bytes:
    """An encoded HealthCheckResponse (statuses are below 128: one byte)."""
    return bytes((_SERVICE_FIELD << 3 | _VARINT, status))


def handler(services: Iterable[str]) -> grpc.GenericRpcHandler:
    """Check and Watch, reporting SERVING for each of `services` ("" is the whole server)."""
    known = frozenset(services)

    def service_of(request: bytes, context: grpc.ServicerContext) -> str:
        try:
            return requested_service(request)
        except MalformedRequest as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed HealthCheckRequest: {err}")

    def check(request: bytes, context: grpc.ServicerContext) -> bytes:
        service = service_of(request, context)
        if service not in known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return response(SERVING)

    def watch(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        # A status never changes while the server runs: send it once, then hold the stream
        # open until the client leaves or the server stops (both end the RPC).
        ended = threading.Event()
        if not context.add_callback(ended.set):  # the RPC has ended already
            return
        yield response(SERVING if service_of(request, context) in known else SERVICE_UNKNOWN)
        ended.wait()

    return grpc.method_handlers_generic_handler(
        HEALTH_SERVICE,
        {
            "Check": grpc.unary_unary_rpc_method_handler(check),
            "Watch": grpc.unary_stream_rpc_method_handler(watch),
        },
    )
