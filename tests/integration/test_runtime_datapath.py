"""The PS data path (runtime/datapath.py): workers send their Steps over a plain socket when
the PS offers one, and over gRPC when it does not or when told not to; the port admits only
the job's token; frames it cannot read are refused, counted, and change nothing.
Real PS servers and workers in one process, real sockets on 127.0.0.1."""

import json
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from support import lone_shard, wait_for

from tfps.api.naming import ENV_DATA_PATH
from tfps.api.spec import TrainingSpec
from tfps.runtime import wire
from tfps.runtime.auth import Material, ServerSecurity
from tfps.runtime.datapath import FRAME, DataConnection, DataPathError, hello_body
from tfps.runtime.inprocess import InProcessCluster
from tfps.runtime.metrics import Identity, WorkerMetrics
from tfps.runtime.ps import serve
from tfps.runtime.worker import Worker

pytestmark = pytest.mark.integration

TRAINING = TrainingSpec.model_validate(
    {
        "model": "digits-mlp",
        "modelArgs": {"hidden": [16]},
        "steps": 1000,
        "consistency": {"mode": "async"},
        "optimizer": {"name": "sgd", "learningRate": 0.1},
    }
)
LABELS = {"job": "inprocess", "namespace": "default", "replica_type": "ps", "replica_index": "0"}


def _sample(shard, name: str, **labels) -> float:
    return shard.metrics.registry.get_sample_value(name, {**LABELS, **labels}) or 0


@pytest.fixture(scope="module")
def cluster():
    with InProcessCluster(TRAINING, num_ps=1, num_workers=2) as c:
        yield c


def _train_steps(cluster, index: int, steps: int = 3) -> Worker:
    worker = cluster.worker(index)
    worker.pull()
    for _ in range(steps):
        worker.train_step()
    return worker


def test_workers_step_over_the_data_path(cluster):
    shard = cluster.shards[0]
    status = cluster.worker(0).clients[0].status()
    assert status["data_port"] == cluster.servers[0].data_port > 0
    version = shard.version
    worker = _train_steps(cluster, 0)
    try:
        assert _sample(shard, "tfps_ps_data_connections") == 1
        assert shard.version == version + 3
        assert worker.versions[0] == shard.version
    finally:
        worker.close()
    wait_for("no data connections", lambda: _sample(shard, "tfps_ps_data_connections") == 0, timeout=5, interval=0.05)


def test_a_worker_told_not_to_uses_grpc(cluster, monkeypatch):
    monkeypatch.setenv(ENV_DATA_PATH, "0")
    shard = cluster.shards[0]
    wait_for("no data connections", lambda: _sample(shard, "tfps_ps_data_connections") == 0, timeout=5, interval=0.05)
    version = shard.version
    worker = _train_steps(cluster, 1)
    try:
        assert shard.version == version + 3
        assert _sample(shard, "tfps_ps_data_connections") == 0
    finally:
        worker.close()


def test_a_ps_without_a_data_port_is_reached_over_grpc():
    model = InProcessCluster(TRAINING).model()
    shard = lone_shard(model.params, TRAINING, job="inprocess")
    server, port = serve(shard, "127.0.0.1:0", data_port=None)
    try:
        worker = Worker(
            model, TRAINING, [f"127.0.0.1:{port}"], 1, 0, WorkerMetrics(Identity("inprocess", "default", "worker", 0))
        )
        worker.pull()
        worker.train_step()
        assert worker.clients[0].status()["data_port"] is None
        worker.close()
        assert shard.version == 1
    finally:
        server.stop(None)
        shard.close()


def _reply(sock: socket.socket) -> wire.Message:
    size = FRAME.unpack(sock.recv(FRAME.size, socket.MSG_WAITALL))[0]
    return wire.decode(sock.recv(size, socket.MSG_WAITALL))


def _hello(port: int, token: bytes | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    payload = hello_body(token)
    sock.sendall(FRAME.pack(len(payload)) + payload)
    assert _reply(sock).meta == {"hello": "ok"}
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_frame_over_the_limit_is_refused_and_the_ps_goes_on(cluster):
    shard = cluster.shards[0]
    before, version = cluster.parameters(), shard.version
    count = _sample(shard, "tfps_ps_rejected_requests_total", reason="oversize")
    with _hello(cluster.servers[0].data_port) as sock:
        sock.sendall(FRAME.pack(1 << 40))  # claims a TiB: refused before any of it is read
        reply = _reply(sock)
        assert reply.meta["error"]["code"] == "INVALID_ARGUMENT" and reply.meta["error"]["reason"] == "oversize"
        assert _closed_by_peer(sock)
    assert _sample(shard, "tfps_ps_rejected_requests_total", reason="oversize") == count + 1
    assert shard.version == version
    for name, value in cluster.parameters().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    worker = _train_steps(cluster, 0, steps=1)  # still serving
    worker.close()
    assert shard.version == version + 1


def test_a_frame_cut_short_is_counted_and_changes_nothing(cluster):
    shard = cluster.shards[0]
    before, version = cluster.parameters(), shard.version
    count = _sample(shard, "tfps_ps_rejected_requests_total", reason="truncated")
    grads = {name: np.ones_like(value) for name, value in before.items()}
    message = wire.encode({"worker": 0, "tag": version, "pull": False, "batch": 1}, grads)
    with _hello(cluster.servers[0].data_port) as sock:
        sock.sendall(FRAME.pack(len(message)) + message[: len(message) // 2])
    wait_for(
        "the truncated frame counted",
        lambda: _sample(shard, "tfps_ps_rejected_requests_total", reason="truncated") == count + 1,
        timeout=5,
        interval=0.05,
    )
    assert shard.version == version
    for name, value in cluster.parameters().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_the_data_port_admits_only_the_jobs_token():
    model = InProcessCluster(TRAINING).model()
    shard = lone_shard(model.params, TRAINING, job="inprocess")
    server, _ = serve(shard, "127.0.0.1:0", security=ServerSecurity(Material(b"the-job-token")))
    try:
        for wrong in (Material(b"another-token"), None):
            with pytest.raises(DataPathError) as err:
                DataConnection("127.0.0.1", server.data_port, wrong, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _sample(shard, "tfps_ps_rejected_requests_total", reason="unauthenticated") == 2
        conn = DataConnection("127.0.0.1", server.data_port, Material(b"the-job-token"), timeout=10)
        reply = conn.step({"worker": 0, "tag": -1, "pull": True}, {})
        conn.close()
        assert reply.meta["version"] == 0 and set(reply.tensors) == set(shard.vars)
    finally:
        server.stop(None)
        shard.close()


def test_the_hello_is_checked_before_anything_a_peer_sent_is_parsed(monkeypatch):
    """A hello is a frame of a fixed size, its token a digest compared before any JSON or tensor
    is decoded: a hello of the old kind (a wire message, here a 64 KiB header of thousands of
    dimensions) is refused unread and one of the right size with another token unparsed, neither
    reaching the wire's readers in the PS's threads. Once admitted, a request refused as malformed
    is answered, and the connection serves the next."""
    parsed = []
    for name in ("decode", "header"):
        real = getattr(wire, name)
        spy = lambda *args, _real=real, **kwargs: (
            parsed.append(threading.current_thread().name) or _real(*args, **kwargs)
        )  # noqa: E731
        monkeypatch.setattr(wire, name, spy)
    model = InProcessCluster(TRAINING).model()
    shard = lone_shard(model.params, TRAINING, job="inprocess")
    server, _ = serve(shard, "127.0.0.1:0", security=ServerSecurity(Material(b"the-job-token")))
    header = json.dumps({"meta": {"hello": {"token": "x"}}, "tensors": [["w", "float32", [1] * 20_000, 4]]}).encode()
    old_hello = len(header).to_bytes(4, "little") + header + bytes(4)
    try:
        for hello in (old_hello[: 64 << 10], hello_body(b"another-token")):
            with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as sock:
                sock.sendall(FRAME.pack(len(hello)) + hello)
                assert _reply(sock).meta["error"]["code"] == "UNAUTHENTICATED"
                assert _closed_by_peer(sock)
        assert _sample(shard, "tfps_ps_rejected_requests_total", reason="unauthenticated") == 2
        assert not [thread for thread in parsed if thread.startswith("ps-data")], parsed
        kernel = shard.vars["dense_0/kernel"]
        with _hello(server.data_port, b"the-job-token") as sock:
            bad = json.dumps({"meta": {"worker": 0}, "tensors": [[["a", "list"], "float32", [1], 4]]}).encode()
            bad = len(bad).to_bytes(4, "little") + bad + bytes(4)
            sock.sendall(FRAME.pack(len(bad)) + bad)
            assert _reply(sock).meta["error"]["reason"] == "malformed"
            push = wire.encode(
                {"worker": 0, "tag": 0, "pull": False, "batch": 1}, {"dense_0/kernel": np.ones_like(kernel)}
            )
            sock.sendall(FRAME.pack(len(push)) + push)
            assert _reply(sock).meta["version"] == shard.version == 1
    finally:
        server.stop(None)
        shard.close()


def test_a_frame_that_comes_in_pieces_is_read_whole_and_a_silent_connection_is_closed(cluster, monkeypatch):
    """The PS reads a frame's body with one blocking MSG_WAITALL receive under the kernel's own
    timeout (datapath.set_timeout): a push that arrives in pauses is still applied once, the
    connection stays open for the worker's next step, and once it stays silent past the idle
    limit the PS closes it (the client's own socket timeout, well past that limit, would fail
    the test rather than hang it)."""
    from tfps.runtime import datapath

    monkeypatch.setattr(datapath, "IDLE_SECONDS", 1.0)
    shard = cluster.shards[0]
    before, version = cluster.parameters(), shard.version
    connections = _sample(shard, "tfps_ps_data_connections")
    grads = {name: np.full_like(value, 0.5) for name, value in before.items()}
    message = wire.encode({"worker": 0, "tag": version, "pull": False, "batch": 1, "seq": 10_000}, grads)
    with _hello(cluster.servers[0].data_port) as sock:
        frame = FRAME.pack(len(message)) + message
        for start in range(0, len(frame), len(frame) // 4 + 1):
            sock.sendall(frame[start : start + len(frame) // 4 + 1])
            time.sleep(0.1)
        reply = _reply(sock)
        assert "error" not in reply.meta and reply.meta["version"] == version + 1
        # A reply does not close it: the next step goes over the same connection.
        pull = wire.encode({"worker": 0, "tag": version + 1, "pull": True})
        sock.sendall(FRAME.pack(len(pull)) + pull)
        reply = _reply(sock)
        assert "error" not in reply.meta and reply.meta["version"] == version + 1 and reply.tensors
        assert _sample(shard, "tfps_ps_data_connections") == connections + 1
        assert _closed_by_peer(sock)
    wait_for(
        "the PS to count the connection closed",
        lambda: _sample(shard, "tfps_ps_data_connections") == connections,
        timeout=5,
        interval=0.05,
    )
    after = cluster.parameters()
    for name, value in after.items():
        np.testing.assert_allclose(value, before[name] - 0.1 * 0.5, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_worker_that_stops_mid_frame_holds_no_other_worker_up(cluster):
    """A connection that sent half a push and went quiet (a worker stopped, a network cut) does
    not stop the PS answering the others (each connection has a reader of its own): another
    worker's steps are applied and answered on its data connection while that push is still
    waiting for its rest. When the rest comes, that push is applied after them and answered."""
    shard = cluster.shards[0]
    version = shard.version
    grads = {name: np.full_like(value, 0.5) for name, value in cluster.parameters().items()}
    message = wire.encode({"worker": 1, "tag": version, "pull": False, "batch": 1, "seq": 20_000}, grads)
    frame = FRAME.pack(len(message)) + message
    with _hello(cluster.servers[0].data_port) as sock:
        sock.sendall(frame[: len(frame) // 2])
        time.sleep(0.2)
        worker = cluster.worker(0)
        try:
            worker.pull()
            connection = worker.clients[0]._data
            for _ in range(3):
                worker.train_step()
            # Answered over the data connection, not after falling back to gRPC on a timeout.
            assert worker.clients[0]._data is connection is not None
        finally:
            worker.close()
        assert shard.version == version + 3
        sock.sendall(frame[len(frame) // 2 :])
        size = FRAME.unpack(sock.recv(FRAME.size, socket.MSG_WAITALL))[0]
        reply = wire.decode(sock.recv(size, socket.MSG_WAITALL))
        assert "error" not in reply.meta and reply.meta["version"] == version + 4


def test_a_step_whose_data_connection_breaks_is_made_again_and_applied_once():
    """A worker sends its Step to every PS before it reads any reply (client.SentSteps).
    When one PS's connection breaks, that PS's request is made again through the client's
    retrying path on a new connection; each PS applies the step's push once."""
    training = TrainingSpec.model_validate({**TRAINING.model_dump(by_alias=True), "steps": 100})
    with InProcessCluster(training, num_ps=2, num_workers=1) as cluster:
        worker = _train_steps(cluster, 0, steps=2)
        try:
            versions = [s.version for s in cluster.shards]
            broken = worker.clients[1]._data
            broken.sock.shutdown(socket.SHUT_RDWR)
            worker.train_step()
            assert [s.version for s in cluster.shards] == [v + 1 for v in versions]
            assert worker.clients[1]._data is not None and worker.clients[1]._data is not broken
            assert worker.clients[0]._data is not None
            worker.train_step()
            assert [s.version for s in cluster.shards] == [v + 2 for v in versions]
        finally:
            worker.close()


def test_a_push_whose_connection_breaks_before_its_reply_is_read_is_made_again_and_applied_once():
    """A pipelined worker sends a step's push, computes its next gradients, and only then reads
    the replies (Worker._send, Worker._finish). When a PS's connection breaks in between, after
    the PS applied the push, the request goes again through the client's retrying path: the PS
    recognises the retried push and applies it once. No other message may use a connection
    while a reply on it is still to be read."""
    training = TrainingSpec.model_validate({**TRAINING.model_dump(by_alias=True), "steps": 100})
    with InProcessCluster(training, num_ps=2, num_workers=1) as cluster:
        worker = _train_steps(cluster, 0, steps=2)
        try:
            versions = [s.version for s in cluster.shards]
            loss, grads, routes, batch = worker._compute(worker.clock)
            sent = worker._send(
                list(worker.versions),
                worker.plan.split_push(worker.dense_vars, grads, routes),
                {"pull": True, "batch": batch, "loss": loss},
                [{} for _ in worker.clients],
                {},
            )
            with pytest.raises(RuntimeError, match="still to be read"):
                worker.clients[0]._data.call(wire.pieces({"tag": -1, "pull": True}, {}))
            wait_for(
                "both PS to apply the push",
                lambda: [s.version for s in cluster.shards] == [v + 1 for v in versions],
                timeout=10,
            )
            broken = worker.clients[1]._data
            broken.sock.close()  # the reply, sent, is never read
            worker._update_state(worker._finish(sent))
            assert [s.version for s in cluster.shards] == [v + 1 for v in versions]
            assert worker.versions == [v + 1 for v in versions]
            assert _sample(cluster.shards[1], "tfps_ps_duplicate_pushes_total", replica_index="1") == 1
            assert worker.clients[1]._data is not None and worker.clients[1]._data is not broken
        finally:
            worker.close()


@pytest.mark.parametrize("data_path,wire_dtype", [(True, "float32"), (True, "bfloat16"), (False, "float32")])
def test_a_variable_split_over_two_ps_reaches_the_worker_whole(data_path, wire_dtype, monkeypatch):
    """dense_0/kernel is split by rows over both PS. Over the data path each part is received
    straight into its rows of one array (no concatenation after), in the wire's dtype; over gRPC
    the parts are joined on arrival. Either way the worker computes on the variable the PS
    hold, whole, and its data connection stays the one it opened."""
    monkeypatch.setenv(ENV_DATA_PATH, "1" if data_path else "0")
    training = TrainingSpec.model_validate({**TRAINING.model_dump(by_alias=True), "wireDtype": wire_dtype})
    with InProcessCluster(training, num_ps=2, num_workers=1) as cluster:
        worker = _train_steps(cluster, 0, steps=1)
        try:
            connections = [c._data for c in worker.clients]
            for _ in range(2):
                worker.train_step()
            parts = worker.plan.parts_of("dense_0/kernel")
            assert len(parts) == 2
            held = np.concatenate([cluster.shards[p.ps].vars[p.name] for p in parts]).astype(wire.dtype(wire_dtype))
            got = worker.params["dense_0/kernel"]
            assert got.dtype.name == wire_dtype
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), held.view(np.uint8))
            assert (worker._joined._arrays.get("dense_0/kernel") is not None) == data_path
            assert [c._data for c in worker.clients] == connections
            assert sum(_sample(s, "tfps_ps_data_connections", replica_index=str(s.index)) for s in cluster.shards) == (
                2 if data_path else 0
            )
        finally:
            worker.close()
