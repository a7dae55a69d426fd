"""Malformed input to a real PS, over gRPC or over its data path, is refused with
INVALID_ARGUMENT, counted in tfps_ps_rejected_requests_total{reason}, and leaves the
parameters untouched; so are oversize messages and a flood of bad pushes, after which the PS
still serves."""

import json
import time

import grpc
import numpy as np
import pytest

from tfps.api.spec import ConsistencyMode, TrainingSpec
from tfps.runtime import _rows, wire
from tfps.runtime.datapath import DataConnection
from tfps.runtime.inprocess import InProcessCluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    training = TrainingSpec.model_validate(
        {
            "model": "wide-deep",
            "modelArgs": {"vocabSize": 1000, "fields": 4},
            "steps": 100,
            "consistency": {"mode": "async"},
            "optimizer": {"name": "sgd", "learningRate": 0.1},
        }
    )
    with InProcessCluster(training, num_ps=1, num_workers=1) as c:
        yield c


def _step(cluster, data: bytes) -> bytes:
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        return channel.unary_unary(wire.method_path("Step"))(data, timeout=10)


def _data_step(cluster, data: bytes) -> bytes:
    """The same Step message as one frame on the PS's data port (runtime/datapath.py)."""
    conn = DataConnection("127.0.0.1", cluster.servers[0].data_port, None, timeout=10)
    try:
        reply = conn.call([data])
    finally:
        conn.close()
    return wire.encode(reply.meta, reply.tensors)


TRANSPORTS = {"grpc": _step, "data-path": _data_step}


def _good():
    return {"dense_0/kernel": np.zeros((4 * 16 + 8, 64), np.float32)}


def _rejected(cluster, reason):
    return (
        cluster.shards[0].metrics.registry.get_sample_value(
            "tfps_ps_rejected_requests_total",
            {"job": "inprocess", "namespace": "default", "replica_type": "ps", "replica_index": "0", "reason": reason},
        )
        or 0
    )


def _claims(header: dict, payload: bytes = b"\0" * 64, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(4, "little") + raw + payload


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
        ("non_finite", wire.encode(meta, {"dense_0/kernel": nan.astype(wire.dtype("bfloat16"))})),
        ("wrong_dtype", wire.encode(meta, {"dense_0/kernel": good["dense_0/kernel"].astype(np.float16)})),
        (
            "out_of_range",
            wire.encode(
                meta,
                {
                    "embedding:indices": np.array([1, 10**6], np.int64),
                    "embedding:values": np.zeros((2, 16), np.float32),
                },
            ),
        ),
        (
            "out_of_range",
            wire.encode(
                meta,
                {"embedding:indices": np.array([-1, 2], np.int64), "embedding:values": np.zeros((2, 16), np.float32)},
            ),
        ),
        ("out_of_range", wire.encode({**meta, "pull": True}, {"embedding:rows": np.array([0, -3], np.int64)})),
        ("malformed", wire.encode({**meta, "worker": 7}, good)),
        # each once escaped as another exception: UNKNOWN over gRPC, a dead connection on the data path
        *[("malformed", _named(meta, name)) for name in (["dense_0/kernel"], {"n": 1}, 7, "dense_0/kernel:")],
        (
            "wrong_shape",
            _claims(
                {"meta": meta, "tensors": [["w", "float32", [1] * 64 + [0], 0], ["b", "float32", [1], 4]]}, bytes(4)
            ),
        ),
    ]


def _named(meta: dict, name) -> bytes:
    """A push of the kernel's gradient under `name` (of any JSON type) in its header."""
    kernel = _good()["dense_0/kernel"]
    return _claims({"meta": meta, "tensors": [[name, "float32", list(kernel.shape), kernel.nbytes]]}, kernel.tobytes())


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("reason, data", _bad_requests(), ids=[r for r, _ in _bad_requests()])
def test_malformed_push_is_refused_and_changes_nothing(cluster, reason, data, transport):
    before = cluster.parameters()
    version = cluster.shards[0].version
    count = _rejected(cluster, reason)
    with pytest.raises(grpc.RpcError) as err:
        TRANSPORTS[transport](cluster, data)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in err.value.details()
    assert _rejected(cluster, reason) == count + 1
    assert cluster.shards[0].version == version
    after = cluster.parameters()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_good_push_is_applied(cluster, transport):
    _push_good(cluster, transport)


def test_an_error_of_the_ps_itself_is_answered_internal_counted_and_the_connection_goes_on(cluster, monkeypatch):
    """An exception of the PS's own (Shard.step made to raise one) is no fault of the request: it
    is answered INTERNAL on either transport and counted as reason "internal", and the data
    connection that carried it serves the next request."""
    shard = cluster.shards[0]
    count, version = _rejected(cluster, "internal"), shard.version
    grad = np.ones((4 * 16 + 8, 64), np.float32)
    conn = DataConnection("127.0.0.1", cluster.servers[0].data_port, None, timeout=10)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(shard, "step", lambda *args, **kwargs: {}["a bug of the PS's"])
            for step in (lambda: _step(cluster, wire.encode({"worker": 0}, {})), lambda: conn.step({"worker": 0}, {})):
                with pytest.raises(grpc.RpcError) as err:
                    step()
                assert err.value.code() == grpc.StatusCode.INTERNAL
        reply = conn.step({"worker": 0, "tag": version, "pull": True, "batch": 1}, {"dense_0/kernel": grad})
    finally:
        conn.close()
    assert reply.meta["version"] == shard.version == version + 1
    assert _rejected(cluster, "internal") == count + 2


def _push_good(cluster, transport: str = "grpc") -> None:
    version = cluster.shards[0].version
    grad = np.ones((4 * 16 + 8, 64), np.float32)
    reply = wire.decode(
        TRANSPORTS[transport](
            cluster, wire.encode({"worker": 0, "tag": version, "pull": True, "batch": 1}, {"dense_0/kernel": grad})
        )
    )
    assert reply.meta["version"] == version + 1
    assert cluster.shards[0].version == version + 1


def test_a_bfloat16_push_is_applied_in_float32(cluster):
    """spec.training.wireDtype bfloat16: the PS takes bfloat16 gradients and updates its
    float32 parameters with them."""
    version = cluster.shards[0].version
    before = cluster.parameters()["dense_0/kernel"]
    grad = np.full((4 * 16 + 8, 64), 0.5, np.float32).astype(wire.dtype("bfloat16"))
    _step(cluster, wire.encode({"worker": 0, "tag": version, "pull": False, "batch": 1}, {"dense_0/kernel": grad}))
    after = cluster.parameters()["dense_0/kernel"]
    assert cluster.shards[0].version == version + 1 and after.dtype == np.float32
    np.testing.assert_allclose(after, before - 0.1 * 0.5, rtol=1e-6)  # sgd, learning rate 0.1


def test_a_retried_push_is_applied_once(cluster):
    """A push whose reply was lost comes again with the same `seq`: the PS answers it with
    the parameters but does not apply the gradient a second time, and counts it."""
    shard = cluster.shards[0]
    seq, version = shard.clocks[0], shard.version
    labels = {"job": "inprocess", "namespace": "default", "replica_type": "ps", "replica_index": "0"}
    dups = shard.metrics.registry.get_sample_value("tfps_ps_duplicate_pushes_total", labels) or 0
    push = wire.encode(
        {"worker": 0, "tag": version, "seq": seq, "pull": True, "batch": 1},
        {"dense_0/kernel": np.ones((4 * 16 + 8, 64), np.float32)},
    )
    first = wire.decode(_step(cluster, push))
    after_first = cluster.parameters()["dense_0/kernel"]
    again = wire.decode(_step(cluster, push))  # the retry
    assert first.meta["version"] == again.meta["version"] == version + 1
    assert again.meta["clock"] == seq + 1
    np.testing.assert_array_equal(cluster.parameters()["dense_0/kernel"], after_first)
    assert shard.metrics.registry.get_sample_value("tfps_ps_duplicate_pushes_total", labels) == dups + 1
    # the next push, with the sequence number the reply gave, is applied
    _step(
        cluster,
        wire.encode(
            {"worker": 0, "tag": version + 1, "seq": seq + 1, "pull": False, "batch": 1},
            {"dense_0/kernel": np.ones((4 * 16 + 8, 64), np.float32)},
        ),
    )
    assert shard.version == version + 2


def test_health_service_reports_serving(cluster):
    """The PS's own health service (runtime/health.py), asked by grpcio-health-checking's client
    as kubelet's gRPC probe and grpc_health_probe ask."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", wire.SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        for service, status in (
            (wire.SERVICE, health_pb2.HealthCheckResponse.SERVING),
            ("no.such.Service", health_pb2.HealthCheckResponse.SERVICE_UNKNOWN),
        ):
            stream = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert next(stream).status == status
            stream.cancel()
        with pytest.raises(grpc.RpcError) as err:  # a field of wire type 7 does not exist
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"\x0f", timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _total_rejected(cluster) -> float:
    registry = cluster.shards[0].metrics.registry
    return sum(
        s.value
        for m in registry.collect()
        if m.name == "tfps_ps_rejected_requests"
        for s in m.samples
        if s.name.endswith("_total")
    )


def _assert_alive_and_unchanged(cluster, before, version):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert cluster.shards[0].version == version
    after = cluster.parameters()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=wire.SERVICE), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _oversize():
    meta = {"worker": 0, "tag": 0, "pull": False}
    kernel = (4 * 16 + 8, 64)
    return [
        # a header claiming a 1 TiB tensor: refused without allocating it
        (
            "huge-tensor-claim",
            "truncated",
            False,
            _claims({"meta": meta, "tensors": [["dense_0/kernel", "float32", [2**20, 2**18], 2**40]]}),
        ),
        # a length prefix claiming a 4 GiB header
        ("huge-header-claim", "truncated", False, _claims({"meta": meta, "tensors": []}, length=2**32 - 1)),
        # a gradient 64 times the variable's size, streamed in 4 MiB chunks (~75 MB)
        (
            "oversized-gradient-streamed",
            "wrong_shape",
            True,
            wire.encode(meta, {"dense_0/kernel": np.zeros((kernel[0] * 64 * 64, kernel[1]), np.float32)}),
        ),
    ]


@pytest.mark.parametrize("reason, streamed, data", [c[1:] for c in _oversize()], ids=[c[0] for c in _oversize()])
def test_oversize_message_is_refused(cluster, reason, streamed, data):
    before, version = cluster.parameters(), cluster.shards[0].version
    count = _rejected(cluster, reason)
    with (
        grpc.insecure_channel(cluster.addresses[0], options=wire.GRPC_OPTIONS) as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        if streamed:
            wire.join(channel.stream_stream(wire.method_path("StepStream"))(wire.iter_chunks(data), timeout=60))
        else:
            channel.unary_unary(wire.method_path("Step"))(data, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in err.value.details()
    assert _rejected(cluster, reason) == count + 1
    _assert_alive_and_unchanged(cluster, before, version)


FLOOD_REQUESTS, FLOOD_SECONDS = 2000, 10.0


def test_flood_of_bad_pushes_is_refused_and_ps_stays_up(cluster, record_property):
    """Up to 2000 bad pushes (or 10 s of them), 32 in flight at a time: every one is refused and
    counted, the parameters do not move, the PS stays SERVING and still applies a good push."""
    bad = [data for _, data in _bad_requests()]
    before, version = cluster.parameters(), cluster.shards[0].version
    rejected = _total_rejected(cluster)
    codes: dict = {}
    sent = 0
    deadline = time.monotonic() + FLOOD_SECONDS
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        step = channel.unary_unary(wire.method_path("Step"))
        while sent < FLOOD_REQUESTS and time.monotonic() < deadline:
            calls = [step.future(bad[(sent + i) % len(bad)], timeout=30) for i in range(min(32, FLOOD_REQUESTS - sent))]
            for call in calls:
                code = call.exception().code() if call.exception() else grpc.StatusCode.OK
                codes[code] = codes.get(code, 0) + 1
            sent += len(calls)
    record_property("reliability", {"count": sent})
    assert sent >= 100, sent
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT: sent}, codes
    assert _total_rejected(cluster) == rejected + sent
    _assert_alive_and_unchanged(cluster, before, version)
    _push_good(cluster)


def test_stream_over_the_size_limit_is_refused(cluster):
    """A streamed Step has no gRPC size limit: the PS stops reading at its own (lowered here to
    8 MiB, so the test need not send a GiB) and refuses the call, counted as oversize."""
    shard = cluster.shards[0]
    before, version = cluster.parameters(), shard.version
    count = _rejected(cluster, "oversize")
    limit, shard.max_request_bytes = shard.max_request_bytes, 8 << 20
    try:
        chunks = (b"\0" * (1 << 20) for _ in range(12))
        with (
            grpc.insecure_channel(cluster.addresses[0], options=wire.GRPC_OPTIONS) as channel,
            pytest.raises(grpc.RpcError) as err,
        ):
            wire.join(channel.stream_stream(wire.method_path("StepStream"))(chunks, timeout=30))
    finally:
        shard.max_request_bytes = limit
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "oversize" in err.value.details()
    assert _rejected(cluster, "oversize") == count + 1
    _assert_alive_and_unchanged(cluster, before, version)


def _worker_shaped(**changes) -> dict:
    """The tensors of a request as a worker sends them every step: dense gradients, a table's
    rows (sorted, each once) with their gradients, and the rows the next batch needs."""
    tensors = {
        "dense_0/kernel": np.full((4 * 16 + 8, 64), 0.25, np.float32),
        "embedding:indices": np.array([2, 5, 9], np.int64),
        "embedding:values": np.full((3, 16), 0.5, np.float32),
        "embedding:rows": np.array([9, 1, 4, 7], np.int64),
    }
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


def test_the_fast_decoding_of_a_worker_step_agrees_with_the_python_checks(cluster):
    """A worker's usual request is decoded and checked in one pass in C (_rows.parse_request):
    it finds the same fields and tensors as the Python checks, each a view of the message."""
    shard = cluster.shards[0]
    data = wire.encode({"worker": 0, "tag": 3, "seq": 2, "pull": True, "batch": 4, "loss": 0.5}, _worker_shaped())
    assert _rows.parse_request(data, shard._layout, False) is not None
    fast, slow = shard._decode(data), shard._parse(wire.decode(data))
    fields = lambda r: (
        r.push.worker,
        r.push.tag,
        r.push.seq,
        r.push.batch,
        r.push.loss,
        r.pull,
        r.min_version,
        r.want_dense,
    )  # noqa: E731
    assert fields(fast) == fields(slow) == (0, 3, 2, 4, 0.5, True, 0, True)
    assert fast.push.dense.keys() == slow.push.dense.keys() == {"dense_0/kernel"}
    np.testing.assert_array_equal(fast.push.dense["dense_0/kernel"], slow.push.dense["dense_0/kernel"])
    assert fast.push.dense["dense_0/kernel"].shape == (4 * 16 + 8, 64)
    for (fi, fv), (si, sv) in zip(fast.push.sparse.values(), slow.push.sparse.values(), strict=True):
        np.testing.assert_array_equal(fi, si)
        np.testing.assert_array_equal(fv, sv)
        assert fv.shape == (3, 16) and fv.dtype == np.float32 and fi.dtype == np.int64
    np.testing.assert_array_equal(fast.rows["embedding"], [9, 1, 4, 7])
    assert not fast.push.dense["dense_0/kernel"].flags.owndata  # a view of the message, not a copy


@pytest.mark.parametrize(
    "tensors",
    [
        _worker_shaped(
            **{"embedding:indices": np.array([5, 2, 9], np.int64)}
        ),  # unsorted: summed per row by the Python path
        _worker_shaped(**{"embedding:indices": np.array([2, 2, 9], np.int64)}),  # a row twice
        _worker_shaped(
            **{"dense_0/kernel": np.full((4 * 16 + 8, 64), 0.25, np.float32).astype(wire.dtype("bfloat16"))}
        ),
        {
            "embedding:values": np.full((3, 16), 0.5, np.float32),
            "embedding:indices": np.array([2, 5, 9], np.int64),
        },  # values first
    ],
    ids=["unsorted", "repeated", "bfloat16", "values-first"],
)
def test_requests_of_another_shape_are_left_to_the_python_checks(cluster, tensors):
    """Valid requests that are not the usual shape: the fast decoding declines them, and the
    Python checks take them as before."""
    shard = cluster.shards[0]
    data = wire.encode({"worker": 0, "tag": 0, "pull": False, "batch": 1}, tensors)
    assert _rows.parse_request(data, shard._layout, False) is None
    req = shard._decode(data)
    assert set(req.push.dense) | set(req.push.sparse) == {
        k.partition(":")[0] for k in tensors if not k.endswith(":rows")
    }


@pytest.mark.parametrize("reason, data", _bad_requests(), ids=[r for r, _ in _bad_requests()])
def test_the_fast_decoding_takes_no_malformed_tensor(cluster, reason, data):
    """Every malformed request either goes to the Python checks or, where only its fields are
    wrong, is refused by them with the same reason."""
    shard = cluster.shards[0]
    fast = _rows.parse_request(data, shard._layout, shard.mode is ConsistencyMode.SYNC)
    if fast is not None:  # its tensors are good: only the meta is wrong, or the update's own pass finds a NaN
        assert reason in ("malformed", "non_finite")
    with pytest.raises(wire.WireError) as err:
        req = shard._decode(data)
        shard._dense_updates(req.push.dense)
    assert err.value.reason == reason
