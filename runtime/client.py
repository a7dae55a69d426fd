"""The worker's side of the PS protocol: one `ShardClient` per PS, with retries.

A PS that is down (restarting, or not up yet) answers UNAVAILABLE; the client retries
with exponential backoff for up to `retry_seconds`, counting each retry. Anything else
(INVALID_ARGUMENT above all) is fatal: retrying a malformed request cannot help.
"""
from __future__ import annotations

import json
import logging
import random
import time

import grpc

from . import wire
from .auth import ClientSecurity
from .wire import GRPC_OPTIONS, POLL_SECONDS, SERVICE

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


class ShardClient:
    def __init__(self, address: str, index: int, retry_seconds: float = 300.0, on_retry=None,
                 security: ClientSecurity | None = None):
        self.address, self.index = address, index
        self.retry_seconds = retry_seconds
        self.on_retry = on_retry
        self.channel = (security or ClientSecurity(None)).channel(address, CLIENT_OPTIONS)
        path = f"/{SERVICE}/"
        self._step = self.channel.unary_unary(path + "Step")
        self._step_stream = self.channel.stream_stream(path + "StepStream")
        self._pull_full = self.channel.unary_stream(path + "PullFull")
        self._status = self.channel.unary_unary(path + "Status")
        self._finish = self.channel.unary_unary(path + "Finish")

    def _retry(self, what: str, fn):
        delay, deadline = 0.1, time.monotonic() + self.retry_seconds
        while True:
            try:
                return fn()
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if code not in RETRYABLE or time.monotonic() > deadline:
                    raise
                if self.on_retry:
                    self.on_retry()
                log.info(json.dumps({"event": "retry", "ps": self.index, "call": what, "code": code.name, "delay": round(delay, 2)}))
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    def step(self, meta: dict, tensors: dict, large: bool) -> wire.Message:
        """One Step call (push and/or pull); `large` sends it as a chunked stream."""
        if large:
            chunks = wire.encode_chunks(meta, tensors)
            call = lambda: wire.join(self._step_stream(iter(chunks), timeout=CALL_TIMEOUT))  # noqa: E731
        else:
            data = wire.encode(meta, tensors)
            call = lambda: self._step(data, timeout=CALL_TIMEOUT)  # noqa: E731
        return wire.decode(self._retry("Step", call))

    def pull_full(self) -> wire.Message:
        return wire.decode(self._retry("PullFull", lambda: wire.join(self._pull_full(b"", timeout=CALL_TIMEOUT))))

    def status(self, timeout: float = 5.0) -> dict:
        return json.loads(self._status(b"", timeout=timeout))

    def finish(self) -> dict:
        return json.loads(self._retry("Finish", lambda: self._finish(b"", timeout=CALL_TIMEOUT)))

    def close(self) -> None:
        self.channel.close()
