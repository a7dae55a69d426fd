"""The worker's side of the PS protocol: one `ShardClient` per PS, with retries.

Steps go over the PS's data path (runtime/datapath.py) when it offers one, over gRPC
otherwise. A PS that is down (restarting, or not up yet) answers UNAVAILABLE, or its data
connection breaks; the client retries with exponential backoff for up to `retry_seconds`,
counting each retry, and reconnects (a restarted PS may listen on another data port).
Anything else (INVALID_ARGUMENT above all) is fatal: retrying a malformed request cannot help.
"""

from __future__ import annotations

import json
import logging
import threading

import grpc
import tenacity

from . import datapath, wire
from .auth import ClientSecurity
from .datapath import DataConnection, DataPathError
from .wire import GRPC_OPTIONS, POLL_SECONDS

log = logging.getLogger("tfps.client")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
CLIENT_OPTIONS = GRPC_OPTIONS + [
    # A restarted PS comes back on the same address within seconds: reconnect quickly.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]
CALL_TIMEOUT = POLL_SECONDS + 60.0


def _retryable(err: BaseException) -> bool:
    return isinstance(err, grpc.RpcError) and hasattr(err, "code") and err.code() in RETRYABLE


class ShardClient:
    def __init__(
        self,
        address: str,
        index: int,
        retry_seconds: float = 300.0,
        on_retry=None,
        security: ClientSecurity | None = None,
    ):
        self.address, self.index = address, index
        self.retry_seconds = retry_seconds
        self.on_retry = on_retry
        self.security = security or ClientSecurity(None)
        self.channel = self.security.channel(address, CLIENT_OPTIONS)
        self._data: DataConnection | None = None
        self._data_wanted = datapath.wanted()
        self._data_lock = threading.Lock()
        calls = {name: getattr(self.channel, shape)(wire.method_path(name)) for name, shape in wire.METHODS.items()}
        self._step, self._step_stream, self._pull_full = calls["Step"], calls["StepStream"], calls["PullFull"]
        self._status, self._finish = calls["Status"], calls["Finish"]

    def _retry(self, what: str, fn):
        """`fn()`, retried with jittered exponential backoff (0.1 s doubling up to 2 s) while
        the PS is unavailable, for up to retry_seconds."""
        try:  # the first try outside tenacity: its bookkeeping would be paid on every call, twice a step
            return fn()
        except grpc.RpcError as err:
            if not _retryable(err):
                raise
            self._note_retry(what, err, 0.0)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            self._note_retry(what, state.outcome.exception(), state.upcoming_sleep)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_retryable),
            stop=tenacity.stop_after_delay(self.retry_seconds),
            wait=tenacity.wait_random_exponential(multiplier=0.1, max=2.0),
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(fn)

    def _note_retry(self, what: str, err: grpc.RpcError, delay: float) -> None:
        if self.on_retry:
            self.on_retry()
        log.info(
            json.dumps(
                {"event": "retry", "ps": self.index, "call": what, "code": err.code().name, "delay": round(delay, 2)}
            )
        )

    def step(self, meta: dict, tensors: dict, large: bool) -> wire.Message:
        """One Step call (push and/or pull). Over gRPC, `large` sends it as a chunked stream."""
        return self._retry("Step", lambda: self._step_once(meta, tensors, large))

    def _step_once(self, meta: dict, tensors: dict, large: bool) -> wire.Message:
        with self._data_lock:
            conn = self._data_connection()
            if conn is not None:
                try:
                    return conn.step(meta, tensors)
                except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
                    self._drop_data()
                    raise DataPathError(
                        grpc.StatusCode.UNAVAILABLE, f"data connection to PS {self.index}: {err}"
                    ) from None
                except DataPathError:
                    self._drop_data()
                    raise
        if large:
            return wire.decode(
                wire.join(self._step_stream(iter(wire.encode_chunks(meta, tensors)), timeout=CALL_TIMEOUT))
            )
        return wire.decode(self._step(wire.encode(meta, tensors), timeout=CALL_TIMEOUT))

    def _data_connection(self) -> DataConnection | None:
        """The connection to the PS's data port, opened on first use; None: Steps go over gRPC."""
        if self._data is not None or not self._data_wanted:
            return self._data
        port = self.status(timeout=CALL_TIMEOUT).get("data_port")
        host = datapath.split_host(self.address)
        if not port:
            self._fall_back("the PS offers no data port", logging.INFO)
            return None
        try:
            self._data = DataConnection(host, int(port), self.security.material, CALL_TIMEOUT)
            log.info(json.dumps({"event": "data-path", "ps": self.index, "host": host, "port": int(port)}))
        except TimeoutError:  # dropped, not refused: a network policy without the data port
            self._fall_back(f"no answer from {host}:{port} within {datapath.CONNECT_SECONDS} s", logging.WARNING)
        except OSError as err:  # refused or reset: the PS is restarting
            raise DataPathError(grpc.StatusCode.UNAVAILABLE, f"data port of PS {self.index}: {err}") from None
        return self._data

    def _fall_back(self, why: str, level: int) -> None:
        self._data_wanted = False
        log.log(level, json.dumps({"event": "grpc-steps", "ps": self.index, "detail": why}))

    def _drop_data(self, err: BaseException | None = None) -> None:
        """Close the data connection; with `err`, say why (the Step is made again through `step`)."""
        if err is not None:
            log.warning(
                json.dumps({"event": "data-path-failed", "ps": self.index, "detail": f"{type(err).__name__}: {err}"})
            )
        if self._data is not None:
            self._data.close()
            self._data = None

    def pull_full(self) -> wire.Message:
        return wire.decode(self._retry("PullFull", lambda: wire.join(self._pull_full(b"", timeout=CALL_TIMEOUT))))

    def status(self, timeout: float = 5.0) -> dict:
        return json.loads(self._status(b"", timeout=timeout))

    def finish(self) -> dict:
        return json.loads(self._retry("Finish", lambda: self._finish(b"", timeout=CALL_TIMEOUT)))

    def close(self) -> None:
        with self._data_lock:
            self._drop_data()
        self.channel.close()


class SentSteps:
    """One Step to each PS (`requests[k]`: meta and tensors for `clients[k]`) over the data
    connections already open, all sent before any reply is read, so the PS work on them at once
    without a thread per PS. The replies are read later (`replies`): a worker computes its next
    gradients meanwhile without handing the exchange to a thread (waking a thread and taking the
    GIL back would cost CPU every step, on cores the worker shares)."""

    def __init__(self, clients: list[ShardClient], requests: list[tuple[dict, dict]]):
        self.clients, self.sent = clients, []
        for k, (client, (meta, tensors)) in enumerate(zip(clients, requests, strict=True)):
            with client._data_lock:
                if client._data is not None:
                    try:
                        client._data.send(wire.pieces(meta, tensors))
                        self.sent.append(k)
                    except (OSError, ValueError) as err:
                        client._drop_data(err)

    def replies(self, place=None) -> list[wire.Message | None]:
        """Each PS's reply (`place`: see DataConnection.receive). None for a PS with no open data
        connection, or whose connection failed: the caller makes that request again through
        `ShardClient.step`, with its retries (a push applied before its reply was lost is
        recognised by the PS: async pushes carry their sequence number, sync ones their tag)."""
        replies: list[wire.Message | None] = [None] * len(self.clients)
        refused: list[DataPathError] = []
        for k in self.sent:  # every reply is read, so that no connection is left mid-frame
            client = self.clients[k]
            with client._data_lock:
                if client._data is None:
                    continue
                try:
                    replies[k] = client._data.receive(place)
                except DataPathError as err:
                    client._drop_data()
                    if not _retryable(err):
                        refused.append(err)
                except (OSError, ValueError) as err:
                    client._drop_data(err)
        if refused:
            raise refused[0]
        return replies
