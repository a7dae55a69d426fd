"""The health service's encodings against protobuf's own (grpcio-health-checking's messages)."""

import pytest
from grpc_health.v1 import health_pb2

from tfps.runtime import health


@pytest.mark.parametrize("service", ["", "tfps.PS", "x" * 300, "dienst-ü"])
def test_requested_service_reads_protobuf_encoding(service):
    request = health_pb2.HealthCheckRequest(service=service).SerializeToString()
    assert health.requested_service(request) == service


def test_requested_service_skips_fields_it_does_not_know():
    known = health_pb2.HealthCheckRequest(service="tfps.PS").SerializeToString()
    # field 2 as a varint (300), field 3 length-delimited, field 4 fixed64, field 5 fixed32
    unknown = b"\x10\xac\x02" + b"\x1a\x03abc" + b"\x21" + bytes(8) + b"\x2d" + bytes(4)
    assert health.requested_service(unknown + known) == "tfps.PS"
    assert health.requested_service(known + unknown) == "tfps.PS"


@pytest.mark.parametrize("request_bytes", [b"\x0a\x05abc", b"\x0a", b"\x0f", b"\x0a\x02\xff\xfe", b"\x80"])
def test_requested_service_refuses_malformed_requests(request_bytes):
    with pytest.raises(health.MalformedRequest):
        health.requested_service(request_bytes)


@pytest.mark.parametrize("status", [health.SERVING, health.SERVICE_UNKNOWN])
def test_response_is_protobufs_encoding(status):
    assert health.response(status) == health_pb2.HealthCheckResponse(status=status).SerializeToString()
    assert health_pb2.HealthCheckResponse.FromString(health.response(status)).status == status
