"""Malformed input to a real PS over gRPC is refused with INVALID_ARGUMENT, counted in
tfps_ps_rejected_requests_total{reason}, and leaves the parameters untouched."""
import grpc
import numpy as np
import pytest

from tfps.runtime import wire
from tfps.runtime.inprocess import InProcessCluster
from tfps.runtime.spec import TrainingSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    training = TrainingSpec.model_validate({"model": "wide-deep", "modelArgs": {"vocabSize": 1000, "fields": 4}, "steps": 100,
                                            "consistency": {"mode": "async"}, "optimizer": {"name": "sgd", "learningRate": 0.1}})
    with InProcessCluster(training, num_ps=1, num_workers=1) as c:
        yield c


def _step(cluster, data: bytes) -> bytes:
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        return channel.unary_unary(f"/{wire.SERVICE}/Step")(data, timeout=10)


def _good():
    return {"dense_0/kernel": np.zeros((4 * 16 + 8, 64), np.float32)}


def _rejected(cluster, reason):
    return cluster.shards[0].metrics.registry.get_sample_value(
        "tfps_ps_rejected_requests_total",
        {"job": "inprocess", "namespace": "default", "replica_type": "ps", "replica_index": "0", "reason": reason},
    ) or 0


def _bad_requests():
    meta = {"worker": 0, "tag": 0, "pull": False}
    good = _good()
    nan = np.zeros((4 * 16 + 8, 64), np.float32)
    nan[3, 5] = np.nan
    inf = np.zeros((4 * 16 + 8, 64), np.float32)
    inf[0, 0] = -np.inf
    return [
        ("wrong_shape", wire.encode(meta, {"dense_0/kernel": np.zeros((3, 3), np.float32)})),
        ("wrong_dtype", wire.encode(meta, {"dense_0/kernel": good["dense_0/kernel"].astype(np.int32)})),
        ("truncated", wire.encode(meta, good)[:-100]),
        ("malformed", b"\x05\x00\x00\x00{{{{{"),
        ("unknown_variable", wire.encode(meta, {**good, "no/such/variable": np.zeros(3, np.float32)})),
        ("non_finite", wire.encode(meta, {**good, "dense_0/bias": nan[3, :64].copy()})),
        ("non_finite", wire.encode(meta, {"dense_0/kernel": inf})),
        ("out_of_range", wire.encode(meta, {"embedding:indices": np.array([1, 10**6], np.int64),
                                             "embedding:values": np.zeros((2, 16), np.float32)})),
        ("malformed", wire.encode({**meta, "worker": 7}, good)),
    ]


@pytest.mark.parametrize("reason, data", _bad_requests(), ids=[r for r, _ in _bad_requests()])
def test_malformed_push_is_refused_and_changes_nothing(cluster, reason, data):
    before = cluster.parameters()
    version = cluster.shards[0].version
    count = _rejected(cluster, reason)
    with pytest.raises(grpc.RpcError) as err:
        _step(cluster, data)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in err.value.details()
    assert _rejected(cluster, reason) == count + 1
    assert cluster.shards[0].version == version
    after = cluster.parameters()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_a_good_push_is_applied(cluster):
    version = cluster.shards[0].version
    grad = np.ones((4 * 16 + 8, 64), np.float32)
    reply = wire.decode(_step(cluster, wire.encode({"worker": 0, "tag": version, "pull": True, "batch": 1}, {"dense_0/kernel": grad})))
    assert reply.meta["version"] == version + 1
    assert cluster.shards[0].version == version + 1


def test_health_service_reports_serving(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", wire.SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
