"""A real PS under a flood of malformed requests, with the job's token and without it, on both of its
transports, while a worker trains against it: the PS stays up, refuses every request and counts
each under its reason in its /metrics, and the worker's training is unchanged: its parameters at
the end are those of the same training against a PS that nobody attacked.

Two `tfps ps` processes on loopback, one after the other (the first not attacked), each with the
job's token; the worker is tfps's own (TensorFlow, in this process), on the data path. The
attack's requests are bounded (ATTACKS per transport, half with the token and half without) and
so is its time (ATTACK_SECONDS)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
from support.ps_process import PSProcess

from tfps.api.spec import TrainingSpec
from tfps.runtime import wire
from tfps.runtime.auth import ClientSecurity, Material
from tfps.runtime.datapath import FRAME, DataConnection, DataPathError, hello_body
from tfps.runtime.metrics import Identity, WorkerMetrics
from tfps.runtime.models import load_model
from tfps.runtime.worker import Worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TRAINING = {
    "model": "wide-deep",
    "modelArgs": {"vocabSize": 1000, "fields": 4, "embeddingDim": 8, "hidden": [16], "samples": 4096, "testSamples": 0},
    "steps": 10_000,
    "batchSize": 64,
    "consistency": {"mode": "async"},
    "optimizer": {"name": "adam", "learningRate": 0.01},
}
TOKEN = "the-job-token"
STEPS = 30  # the worker's
ATTACKS = 2000  # requests per transport: half with the token, half without
ATTACK_SECONDS = 60.0
KERNEL = "dense_0/kernel"
KERNEL_SHAPE = (4 * 8 + 8, 16)


def _raw(meta: dict, entries: list, payload: bytes = b"", misaligned: bool = False) -> bytes:
    """A message of any header entries; `misaligned`: its tensors packed from an odd offset ("align": 1)."""
    header = json.dumps({"meta": meta, "tensors": entries, **({"align": 1} if misaligned else {})}).encode()
    header += b" " * (misaligned and len(header) % 2 == 0)
    return struct.pack("<I", len(header)) + header + payload


def malformed() -> list[tuple[str, bytes]]:
    """Requests of every kind of fault the PS refuses, with the reason it refuses each for."""
    meta = {"worker": 0, "tag": 0, "pull": True, "batch": 1}
    kernel = np.zeros(KERNEL_SHAPE, np.float32)
    nan = kernel.copy()
    nan[1, 2] = np.nan
    out = [
        ("wrong_shape", wire.encode(meta, {KERNEL: np.zeros((3, 3), np.float32)})),
        ("wrong_dtype", wire.encode(meta, {KERNEL: kernel.astype(np.int32)})),
        ("truncated", wire.encode(meta, {KERNEL: kernel})[:-100]),
        ("truncated", b"\x07\x00"),
        ("malformed", b"\x05\x00\x00\x00{{{{{"),
        ("unknown_variable", wire.encode(meta, {"no/such/variable": np.zeros(3, np.float32)})),
        ("non_finite", wire.encode(meta, {KERNEL: nan})),
        ("non_finite", wire.encode(meta, {KERNEL: nan.astype(wire.dtype("bfloat16"))})),
        ("non_finite", _raw(meta, [[KERNEL, "float32", list(KERNEL_SHAPE), nan.nbytes]], nan.tobytes(), True)),
        ("out_of_range", wire.encode(meta, {"embedding:rows": np.array([0, 10**9], np.int64)})),
        (
            "out_of_range",
            wire.encode(
                meta,
                {"embedding:indices": np.array([-1, 2], np.int64), "embedding:values": np.zeros((2, 8), np.float32)},
            ),
        ),
        ("malformed", wire.encode({**meta, "worker": 7}, {KERNEL: kernel})),
        ("malformed", wire.encode({**meta, "worker": "zero"}, {})),
        ("malformed", _raw(meta, [[KERNEL + ":", "float32", list(KERNEL_SHAPE), kernel.nbytes]], kernel.tobytes())),
        ("wrong_shape", _raw(meta, [["w", "float32", [1] * 64 + [0], 0], ["b", "float32", [1], 4]], bytes(4))),
        ("wrong_shape", _raw(meta, [["w", "float32", [1] * 5000, 4]], bytes(4))),
        ("oversize", _raw(meta, [["w", "float32", [0], 0]] * (wire.MAX_TENSORS + 1))),
    ]
    out += [("malformed", _raw(meta, [[name, "float32", [1], 4]], bytes(4))) for name in ([KERNEL], {"n": 1}, 7, None)]
    return out


def _train(ps: PSProcess, during=None) -> dict[str, np.ndarray]:
    """STEPS steps of worker 0 against `ps` (with `during` running meanwhile, in threads), then
    the whole model as the PS holds it."""
    spec = TrainingSpec.model_validate(TRAINING)
    model = load_model(spec.model, spec.model_args, spec.seed)
    worker = Worker(
        model,
        spec,
        [ps.address],
        1,
        0,
        WorkerMetrics(Identity(ps.job, "default", "worker", 0)),
        retry_seconds=0,
        pipeline=False,
        security=ps.security,
    )
    errors: list[BaseException] = []

    def run(fn) -> None:
        try:
            fn()
        except BaseException as err:  # surfaced below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in during or ()]
    try:
        worker.pull()
        for thread in threads:
            thread.start()
        for _ in range(STEPS):
            worker.train_step()
        for thread in threads:
            thread.join(ATTACK_SECONDS + 60)
            assert not thread.is_alive()
        if errors:
            raise errors[0]
        assert worker.clients[0]._data is not None, "the worker did not train on the data path"
        return worker.full_params()
    finally:
        worker.close()


def _closed(sock: socket.socket) -> bool:
    """The peer closed the connection (a reset too: it closed with bytes of ours unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class Attack:
    """The requests sent, by how the PS must refuse them: {reason: count}."""

    def __init__(self, ps: PSProcess):
        self.ps, self.requests = ps, malformed()
        self.expected: Counter = Counter()
        self.answers: Counter = Counter()  # (transport, status) as the attacker saw them
        self.deadline = time.monotonic() + ATTACK_SECONDS
        self.lock = threading.Lock()

    def _count(self, reason: str, answer: tuple) -> None:
        with self.lock:
            self.expected[reason] += 1
            self.answers[answer] += 1

    def _sent(self, limit: int):
        for i in range(limit):
            if time.monotonic() > self.deadline:
                return
            yield i, self.requests[i % len(self.requests)]

    def grpc_with_token(self) -> None:
        with self.ps.security.channel(self.ps.address, wire.GRPC_OPTIONS) as channel:
            step = channel.unary_unary(wire.method_path("Step"))
            for _, (reason, data) in self._sent(ATTACKS // 2):
                with pytest.raises(grpc.RpcError) as err:
                    step(data, timeout=30)
                assert reason in err.value.details(), (reason, err.value.details())
                self._count(reason, ("grpc", err.value.code().name))

    def grpc_without_token(self) -> None:
        wrong = ClientSecurity(Material(b"another-jobs-token"))
        with grpc.insecure_channel(self.ps.address) as plain, wrong.channel(self.ps.address, []) as other:
            for i, (_, data) in self._sent(ATTACKS // 2):
                with pytest.raises(grpc.RpcError) as err:
                    (plain if i % 2 else other).unary_unary(wire.method_path("Step"))(data, timeout=30)
                self._count("unauthenticated", ("grpc", err.value.code().name))

    def data_path_with_token(self) -> None:
        """One connection, every request refused on it and the connection kept."""
        port = self._data_port()
        conn = DataConnection("127.0.0.1", port, self.ps.security.material, timeout=30)
        try:
            for _, (reason, data) in self._sent(ATTACKS // 2):
                with pytest.raises(DataPathError) as err:
                    conn.call([data])
                assert reason in err.value.details(), (reason, err.value.details())
                self._count(reason, ("data", err.value.code().name))
        finally:
            conn.close()

    def data_path_without_token(self) -> None:
        """A connection per try: a hello with another token, one of the old kind (a wire message with
        the token in its JSON), or bytes that are no hello at all."""
        port = self._data_port()
        old = wire.encode({"hello": {"token": TOKEN}})
        hellos = [hello_body(b"another-jobs-token"), hello_body(None), old, b"\xff" * 40, b""]
        for i, _ in self._sent(ATTACKS // 2):
            hello = hellos[i % len(hellos)]
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(FRAME.pack(len(hello)) + hello)
                size = FRAME.unpack(sock.recv(FRAME.size, socket.MSG_WAITALL))[0]
                reply = wire.decode(sock.recv(size, socket.MSG_WAITALL))
                assert _closed(sock), "the PS kept a connection whose hello it refused"
            self._count("unauthenticated", ("data", reply.meta["error"]["code"]))

    def _data_port(self) -> int:
        """The PS's data port, as a worker asks for it (Status)."""
        from tfps.runtime.client import ShardClient

        client = ShardClient(self.ps.address, 0, retry_seconds=0, security=self.ps.security)
        try:
            return int(client.status()["data_port"])
        finally:
            client.close()

    def all(self) -> list:
        return [self.grpc_with_token, self.grpc_without_token, self.data_path_with_token, self.data_path_without_token]


def test_a_flood_of_malformed_requests_is_refused_counted_and_changes_no_training(tmp_path):
    quiet = PSProcess(tmp_path / "quiet", TRAINING, TOKEN, job="quiet")
    try:
        expected = _train(quiet)
    finally:
        quiet.stop()

    ps = PSProcess(tmp_path / "attacked", TRAINING, TOKEN, job="attacked")
    try:
        before = ps.metrics()
        attack = Attack(ps)
        trained = _train(ps, during=attack.all())
        assert ps.serving(), "the PS stopped serving"
        after = ps.metrics()
    finally:
        ps.stop()
    log = ps.log.read_text()

    sent = sum(attack.expected.values())
    per_transport = Counter(transport for transport, _ in attack.answers.elements())
    assert min(per_transport.values()) >= ATTACKS // 4, per_transport  # most of them before the deadline
    refused = {reason: ps.rejected(reason, after) - ps.rejected(reason, before) for reason in attack.expected}
    assert refused == dict(attack.expected), (refused, attack.expected)
    assert ps.rejected(wire.INTERNAL_REASON, after) == 0 and "Traceback" not in log, log[-3000:]
    assert set(attack.answers) <= {
        ("grpc", "INVALID_ARGUMENT"),
        ("grpc", "UNAUTHENTICATED"),
        ("data", "INVALID_ARGUMENT"),
        ("data", "UNAUTHENTICATED"),
    }, attack.answers
    print(f"attack: {sent} requests refused, {dict(per_transport)} per transport, {dict(attack.expected)}")
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(trained[name], value, err_msg=name)
