"""The data path: Step messages between workers and a PS over a plain TCP (or TLS) socket.

grpcio's Python stack copies every message several times on each side; a socket that sends
from the tensors' own memory (sendmsg) and receives into one buffer (recv_into) copies none.
A Step is the one call made every step, so it gets its own port; all else stays on gRPC
(health probes, Status, PullFull, Finish). Each PS listens on
$TFPS_DATA_PORT (0: a free port it picks itself) and says which in its gRPC Status reply;
a worker asks once, then sends its Steps there. A PS that offers no data port, or a network
that drops it, leaves the worker on gRPC's Step.

Framing: each frame is `u64 length | body`. A connection opens with a hello, a frame of a fixed
size: HELLO_MAGIC, then the SHA-256 of the job's token (`hello_body`). The PS reads those bytes
alone and compares the digest in constant time (hmac.compare_digest, as the gRPC interceptor
compares the token) before it parses anything a peer sent: no JSON and no tensor of an
unauthenticated peer is decoded. TLS with the job's certificate when spec.training.tls. The PS
answers the hello with a wire message (runtime/wire.py); each request frame, a wire message,
then gets one reply frame. A refused request is answered with meta `{"error": {code, reason,
detail}}` and counted like a refused gRPC call, and the connection goes on; a frame the PS cannot
read (oversize, cut short) and a refused hello close the connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import numpy as np

from tfps.api.settings import ProcessSettings

from . import wire
from .auth import REJECT_DETAIL, REJECT_REASON, Material

log = logging.getLogger("tfps.ps")

FRAME = struct.Struct("<Q")
CONNECT_SECONDS = 5.0
IDLE_SECONDS = 600.0  # a PS closes a connection silent this long; the worker reconnects
MAX_CONNECTIONS = 1024
HELLO_MAGIC = b"tfps-dp2"  # the data path's hello, version 2: a token digest, no wire message
HELLO = struct.Struct(f"<{len(HELLO_MAGIC)}s32s")  # HELLO_MAGIC, SHA-256 of the job's token
IOV_MAX = 1024
REPLY_BUFFERS = 3  # a pipelined worker holds two replies at most (in use, in flight)


class DataPathError(grpc.RpcError):
    """A failed Step on the data path, shaped like gRPC's errors so that callers handle both
    alike (UNAVAILABLE is retried, INVALID_ARGUMENT and UNAUTHENTICATED are not)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def wanted(env: dict[str, str] | None = None) -> bool:
    return ProcessSettings.from_env(env).data_path


# ---- frames ----------------------------------------------------------------------------


def send_frame(sock: socket.socket, pieces: list) -> None:
    """Send `pieces` (bytes and memoryviews, one wire message) as one frame without joining them."""
    views = [p if type(p) is bytes else memoryview(p).cast("B") for p in pieces]
    views.insert(0, FRAME.pack(sum(map(len, views))))
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + IOV_MAX])
        while sent:  # a partial send: skip what went, resume mid-piece
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i], sent = memoryview(views[i])[sent:], 0
        while i < len(views) and not len(views[i]):
            i += 1


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    # A plain socket in blocking mode (`set_timeout`) reads the rest of a frame in one call,
    # woken once, instead of once per TCP segment as it comes (each a return to Python, the
    # GIL taken again).
    flags = socket.MSG_WAITALL if sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket) else 0
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, flags)
        if n == 0:
            raise ConnectionError(f"connection closed {len(view) - got} bytes before the end of a frame")
        got += n


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """Fail a send or receive that waits longer than `seconds` (an OSError). A plain socket
    stays in blocking mode with the kernel's own timeouts, for `recv_exact`'s MSG_WAITALL;
    Python's timeouts put it in non-blocking mode, where MSG_WAITALL returns what is there."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_length(sock: socket.socket) -> int | None:
    """The next frame's length; None when the peer closed the connection between frames."""
    head = bytearray(FRAME.size)
    view = memoryview(head)
    n = sock.recv_into(view)
    if n == 0:
        return None
    if n < FRAME.size:
        recv_exact(sock, view[n:])
    return FRAME.unpack(head)[0]


def error_pieces(code: str, reason: str, detail: str) -> list:
    return wire.pieces({"error": {"code": code, "reason": reason, "detail": detail}}, {})


def token_digest(token: bytes | None) -> bytes:
    """What the hello carries of a token: a digest of fixed size, whatever the token's length."""
    return hashlib.sha256(token or b"").digest()


def hello_body(token: bytes | None) -> bytes:
    """The hello a worker sends first on a connection (the frame's body)."""
    return HELLO.pack(HELLO_MAGIC, token_digest(token))


# ---- TLS -------------------------------------------------------------------------------


def server_context(material: Material) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # load_cert_chain reads only files: the job's cert and key go through a private temp folder
    with tempfile.TemporaryDirectory(prefix="tfps-tls-") as folder:
        cert, key = Path(folder, "tls.crt"), Path(folder, "tls.key")
        for path, data in ((cert, material.tls_crt), (key, material.tls_key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        ctx.load_cert_chain(cert, key)
    return ctx


def client_context(material: Material) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the PS's certificate and name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=material.ca_crt.decode())
    return ctx


# ---- the PS side -------------------------------------------------------------------------


class DataServer:
    """Serves `shard.step` on its own port, one thread per connection (a job has few workers)."""

    def __init__(self, shard, host: str, port: int, material: Material | None, on_reject):
        self.shard, self._on_reject = shard, on_reject
        self._digest = token_digest(material.token) if material is not None else None
        self._tls = server_context(material) if material is not None and material.tls else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self.port = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="ps-data-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    sock.close()
                    continue
                self._conns.add(sock)
                self.shard.metrics.data_connections.set(len(self._conns))
            threading.Thread(target=self._serve, args=(sock,), name="ps-data", daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        sock = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(CONNECT_SECONDS)  # the TLS handshake and the hello
            if self._tls is not None:
                sock = self._tls.wrap_socket(raw, server_side=True)
            if self._hello(sock):
                set_timeout(sock, IDLE_SECONDS)
                self._loop(sock)
        except (OSError, ValueError):
            pass  # the worker went away (or sent a TLS handshake that failed): it reconnects
        except Exception:  # a bug of the PS's: said, and only this connection closed
            log.exception("the data path's connection failed unexpectedly")
        finally:
            sock.close()
            with self._lock:
                self._conns.discard(raw)
                self.shard.metrics.data_connections.set(len(self._conns))

    def _hello(self, sock: socket.socket) -> bool:
        """The connection's first frame: a hello of HELLO.size bytes, its digest the job's token's.
        Nothing else is read from a peer before it passes; a frame of another size is refused
        unread. A PS with a token refuses every other hello as unauthenticated; an open one (no
        token: tests on loopback) refuses one that is not a hello as malformed."""
        size = recv_length(sock)
        if size is None:
            return False
        data = bytearray(HELLO.size)
        if size == HELLO.size:
            recv_exact(sock, memoryview(data))
        magic, digest = HELLO.unpack(data)
        hello = size == HELLO.size and hmac.compare_digest(magic, HELLO_MAGIC)
        if self._digest is not None and not (hmac.compare_digest(digest, self._digest) and hello):
            return self._refuse_hello(sock, "UNAUTHENTICATED", REJECT_REASON, REJECT_DETAIL)
        if not hello:
            return self._refuse_hello(sock, "INVALID_ARGUMENT", "malformed", f"not a data path hello ({size} bytes)")
        send_frame(sock, wire.pieces({"hello": "ok"}, {}))
        return True

    def _refuse_hello(self, sock: socket.socket, code: str, reason: str, detail: str) -> bool:
        """Count a refused hello and answer it (the connection then closes): False."""
        self._on_reject(reason, detail)
        send_frame(sock, error_pieces(code, reason, detail))
        return False

    def _loop(self, sock: socket.socket) -> None:
        buf = wire.aligned_empty(0)  # reused: the shard keeps no view of a request once it answered
        while True:
            size = recv_length(sock)
            if size is None:
                return
            if size > self.shard.max_request_bytes:
                detail = f"frame of {size} bytes is over the limit of {self.shard.max_request_bytes}"
                self._on_reject("oversize", detail)
                send_frame(sock, error_pieces("INVALID_ARGUMENT", "oversize", detail))
                return  # the rest of the frame is not read: the stream cannot be resynchronised
            if size > len(buf):
                buf = wire.aligned_empty(size)
            view = memoryview(buf)[:size]
            try:
                recv_exact(sock, view)
            except ConnectionError as err:
                self._on_reject("truncated", str(err))
                return
            try:
                out = self.shard.step(view, encoding="pieces")
            except wire.WireError as err:  # ps.Rejected
                self._on_reject(err.reason, str(err))
                out = error_pieces("INVALID_ARGUMENT", err.reason, f"{err.reason}: {err}")
            except (
                Exception
            ):  # a bug of the PS's, not of the request: said as such, counted, and the connection goes on
                log.exception("a Step request on the data path met an unexpected error")
                self._on_reject(wire.INTERNAL_REASON, "unexpected error (see the PS's log)")
                out = error_pieces(
                    "INTERNAL", wire.INTERNAL_REASON, f"{wire.INTERNAL_REASON}: unexpected error in the PS"
                )
            send_frame(sock, out)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self._listener.close()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


# ---- the worker side ---------------------------------------------------------------------


class ReplyBuffers:
    """Aligned buffers for replies, each reused once nothing refers to it any more.

    The worker keeps views of a reply (its parameters go to TensorFlow in place), so a buffer
    must not be overwritten while one lives. Every view holds a reference to its buffer; a
    buffer that only this pool refers to is free. Reusing it spares the page faults of fresh
    memory: messages over glibc's largest mmap threshold (32 MiB) get new pages every time.
    """

    def __init__(self, keep: int = REPLY_BUFFERS):
        self.keep = keep
        self._buffers: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        for buf in self._buffers:
            # A reply's tensors are views of a memoryview of `buf` itself (never of a slice of
            # it), so while one lives it refers to `buf`. Only the list, the loop variable and
            # getrefcount's argument do: no reply in it is in use.
            if len(buf) == nbytes and sys.getrefcount(buf) == 3:
                return buf
        buf = wire.aligned_empty(nbytes)
        self._buffers = [buf, *self._buffers][: self.keep]
        return buf


class DataConnection:
    """One worker's connection to one PS's data port."""

    def __init__(self, host: str, port: int, material: Material | None, timeout: float):
        self._buffers = ReplyBuffers()
        self.awaiting = 0  # replies to messages sent (`send`) not read yet (`receive`)
        raw = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = (
                client_context(material).wrap_socket(raw, server_hostname=host)
                if material is not None and material.tls
                else raw
            )
            reply = self.call([hello_body(material.token if material is not None else None)])  # within CONNECT_SECONDS
            if reply.meta.get("hello") != "ok":
                raise DataPathError(grpc.StatusCode.UNAVAILABLE, f"unexpected hello reply {reply.meta}")
            set_timeout(self.sock, timeout)
        except BaseException:
            raw.close()
            raise

    def call(self, pieces: list) -> wire.Message:
        """Send one message (its pieces) and return the reply; DataPathError when refused."""
        if self.awaiting:  # its reply would be the one read
            raise RuntimeError("a reply to an earlier message is still to be read on this connection")
        self.send(pieces)
        return self.receive()

    def send(self, pieces: list) -> None:
        send_frame(self.sock, pieces)
        self.awaiting += 1

    def receive(self, place=None) -> wire.Message:
        """The reply to the message sent last; DataPathError when it was refused. `place(name,
        dtype, shape)` may give an array (C-contiguous, of that dtype and shape) to receive a
        tensor straight into, or None to leave it in the reply's buffer."""
        self.awaiting -= 1
        size = recv_length(self.sock)
        if size is None:
            raise ConnectionError("the PS closed the connection")
        # The worker keeps views of a reply (parameters, embedding rows) and TensorFlow uses
        # them in place (runtime/zerocopy.py): a buffer is reused only once they are gone.
        view = memoryview(self._buffers.take(size))
        if place is None:
            recv_exact(self.sock, view)
            msg = wire.decode(view)
        else:
            msg = self._receive_placed(view, place)
        err = msg.meta.get("error")
        if err:
            code = getattr(grpc.StatusCode, str(err.get("code")), grpc.StatusCode.UNKNOWN)
            raise DataPathError(code, str(err.get("detail", err)))
        return msg

    def _receive_placed(self, view: memoryview, place) -> wire.Message:
        """A reply read header first, then each tensor that `place` wants straight into its array,
        the rest (and the padding) into `view`."""
        head = wire.HEADER_LENGTH.size
        if len(view) < head:  # no room for a header: decode says so
            recv_exact(self.sock, view)
            return wire.decode(view)
        recv_exact(self.sock, view[:head])
        start = head + wire.HEADER_LENGTH.unpack_from(view)[0]
        if start > len(view):
            recv_exact(self.sock, view[head:])
            return wire.decode(view)
        recv_exact(self.sock, view[head:start])
        meta, places = wire.header(view[:start], len(view))
        tensors, done = {}, start  # bytes of the message read so far
        for name, dt, shape, offset, nbytes in places:
            dest = place(name, dt, shape) if nbytes else None
            if dest is None:
                continue
            if offset > done:
                recv_exact(self.sock, view[done:offset])
            recv_exact(self.sock, memoryview(dest.reshape(-1).view(np.uint8)))  # any dtype, bfloat16 too
            tensors[name], done = dest, offset + nbytes
        if done < len(view):
            recv_exact(self.sock, view[done:])
        for place in places:
            if place[0] not in tensors:
                tensors[place[0]] = wire.tensor_at(view, place)
        return wire.Message(meta, tensors)

    def step(self, meta: dict, tensors: dict) -> wire.Message:
        return self.call(wire.pieces(meta, tensors))

    def close(self) -> None:
        self.sock.close()


def split_host(address: str) -> str:
    """The host of `host:port` or `[v6]:port`."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host
