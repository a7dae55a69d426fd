"""The PS wire format: a small JSON header, then raw tensor bytes (never per-float fields).

    message = u32 header length | JSON header | payload
    header  = {"meta": {...}, "tensors": [[name, dtype, shape, nbytes], ...]}

The header is strict JSON, written and read with orjson, a fraction of the standard library's
cost on both sides of every Step (a float that is not finite, such as a NaN loss, goes as null).
Tensors follow one another in the payload in header order, each starting on a multiple of
`align` bytes from the message's start (the header is padded with spaces, tensors with zero
bytes), so that a message received into an aligned buffer (`aligned_empty`) hands TensorFlow
tensors it can use in place (runtime/zerocopy.py). Decoding does not copy: each tensor is an
`np.frombuffer` view of the received bytes, but for a tensor that does not lie aligned for its
items in memory (a message of a sender that does not align them), which is copied. Messages
larger than UNARY_MAX_BYTES travel as a gRPC stream of CHUNK_BYTES chunks (see `encode_chunks` /
`join`).

A message comes from the network: its header's length, its count of tensors and each tensor's
count of dimensions are bounded (MAX_HEADER_BYTES, MAX_TENSORS, MAX_DIMS) and checked before any
work that grows with them, and anything malformed raises WireError, never another exception.
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import orjson

ALIGN = 64  # TensorFlow's CPU buffer alignment (EIGEN_MAX_ALIGN_BYTES with AVX-512)
MAX_ALIGN = 4096
MAX_HEADER_BYTES = 4 << 20  # a header describes its tensors: ~40k of them fit in this
MAX_TENSORS = 65536
MAX_DIMS = 32  # NumPy takes 64 at most
_ZEROS = bytes(ALIGN)
CHUNK_BYTES = 4 << 20
# Larger messages are streamed in chunks. Up to glibc's largest mmap threshold (runtime/malloc.py)
# a whole message reuses warm heap pages, and one unary call costs less than a stream.
UNARY_MAX_BYTES = 32 << 20
MAX_MESSAGE_BYTES = 1 << 30
HEADER_LENGTH = struct.Struct("<I")  # the header's length, first in a message
_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY  # NumPy scalars in a meta, as the standard library's json took them
json_loads = orjson.loads  # the header's parser, here and in runtime/_rows_wire.c

# A message of float32 and int64 arrays is framed and its header read in C (runtime/_rows_wire.c),
# the same bytes and the same header as below, in less of the step's CPU that both sides spend on it.
try:
    from ._rows import encode_message as _encode_in_c
    from ._rows import read_header as _read_header_in_c
except ImportError:  # the package built without its C kernels (runtime/_rows.c)
    _encode_in_c = _read_header_in_c = None


def json_dumps(obj) -> bytes:
    """A header's JSON (and a reply's meta, which _rows.apply_async puts in the header it writes)."""
    return orjson.dumps(obj, option=_DUMPS_OPTIONS)


SERVICE = "tfps.ParameterServer"
# A refusal's reason (tfps_ps_rejected_requests_total{reason}) for a request that met a bug of the
# PS's rather than a fault of its own: answered INTERNAL, not INVALID_ARGUMENT, on either transport.
INTERNAL_REASON = "internal"
# The PS's gRPC methods and their shapes (the names of grpc's `*_rpc_method_handler` on the
# server and of the channel's call factories on the client), declared once for both.
METHODS = {
    "Step": "unary_unary",
    "StepStream": "stream_stream",  # a Step too large for one message, in chunks
    "PullFull": "unary_stream",  # every parameter of the shard, in chunks
    "Status": "unary_unary",
    "Finish": "unary_unary",  # a final checkpoint
}


def method_path(name: str) -> str:
    return f"/{SERVICE}/{name}"


POLL_SECONDS = 2.0  # longest a Step waits before answering "pending" (the worker re-asks)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
]
# The dtypes a message may carry, by their names on the wire: these, and bfloat16, which is
# ml_dtypes' and is imported on first use (`dtype`): memory and start-up time that a PS of a
# float32 job never needs (TensorFlow imports it anyway in a worker).
_NP_DTYPES = {name: np.dtype(name) for name in ("float32", "int64", "int32", "float16")}
_DTYPE_NAMES = {dtype: name for name, dtype in _NP_DTYPES.items()}
_BUFFER_DTYPES = frozenset(_NP_DTYPES.values())  # NumPy's own: an array of one exports its bytes as a buffer
_ADDRESSABLE = _BUFFER_DTYPES | {np.dtype(np.uint8), np.dtype(np.uint16)}
_CHAR = ctypes.c_char


def dtype(name: str) -> np.dtype:
    """The NumPy dtype of a wire dtype name; KeyError when the wire has no such dtype."""
    found = _NP_DTYPES.get(name)
    if found is not None:
        return found
    if name != "bfloat16":
        raise KeyError(name)
    import ml_dtypes

    found = _NP_DTYPES[name] = np.dtype(ml_dtypes.bfloat16)
    _DTYPE_NAMES[found] = name
    return found


def dtype_name(dt: np.dtype) -> str:
    """The wire name of a dtype (np.dtype.name is computed in Python on every access, for each of a
    message's tensors)."""
    name = _DTYPE_NAMES.get(dt)
    return name if name is not None else np.dtype(dt).name


class WireError(ValueError):
    """A message that cannot be decoded; `reason` is the metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Message:
    meta: dict = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


def pieces(meta: dict, tensors: dict[str, np.ndarray]) -> list:
    """The message as its parts (length, header, each tensor's bytes), none of them copied."""
    if _encode_in_c is not None:
        framed = _encode_in_c(json_dumps(meta), tensors)
        if framed is not None:
            return framed
    entries, bufs, offset = [], [], 0
    for name, arr in tensors.items():
        lazy = hasattr(arr, "blocks")  # its bytes come later, block by block (see `expand`)
        if not lazy and not (type(arr) is np.ndarray and arr.flags.c_contiguous and arr.ndim):
            arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # ascontiguousarray makes a 0-d array 1-d
        pad = -offset % ALIGN
        if pad:
            bufs.append(_ZEROS[:pad])
        dt = arr.dtype
        entries.append([name, dtype_name(dt), list(arr.shape), arr.nbytes])
        if lazy:
            bufs.append(arr)
        elif dt in _BUFFER_DTYPES and arr.ndim and arr.size:  # its own buffer as bytes: a fifth of a uint8 view's cost
            bufs.append(arr.data.cast("B"))
        else:  # bfloat16 (ml_dtypes' exports none), 0-d and empty arrays
            bufs.append(memoryview(arr.reshape(-1).view(np.uint8)))
        offset += pad + arr.nbytes
    header = json_dumps({"meta": meta, "tensors": entries, "align": ALIGN})
    header += b" " * (-(HEADER_LENGTH.size + len(header)) % ALIGN)  # the first tensor starts aligned
    return [HEADER_LENGTH.pack(len(header)), header, *bufs]


def expand(parts: Iterable) -> Iterator:
    """`pieces`' output with each lazy tensor (an object with `blocks()`, yielding its rows
    in order as C-contiguous arrays) replaced by the bytes of its blocks."""
    for piece in parts:
        if hasattr(piece, "blocks"):
            for block in piece.blocks():
                yield memoryview(block.reshape(-1).view(np.uint8))
        else:
            yield piece


def address(arr: np.ndarray) -> int:
    """Where `arr`'s first byte is. `ndarray.ctypes` builds an object on every call; ctypes finds it
    in less for a writable, C-contiguous, non-empty array of NumPy's own dtypes."""
    if arr.dtype in _ADDRESSABLE and arr.size and arr.flags.writeable and arr.flags.c_contiguous:
        return ctypes.addressof(_CHAR.from_buffer(arr))
    return arr.ctypes.data


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 buffer starting on an `align` boundary."""
    raw = np.empty(nbytes + align, np.uint8)
    start = -address(raw) % align
    return raw[start : start + nbytes]


def aligned_array(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array of `shape` and `dtype` starting on an ALIGN boundary (TensorFlow
    can then use its memory in place: runtime/zerocopy.py)."""
    dtype = np.dtype(dtype)
    return aligned_empty(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)


def encode(meta: dict, tensors: dict[str, np.ndarray] | None = None) -> bytes:
    return b"".join(pieces(meta, tensors or {}))


def encode_chunks(meta: dict, tensors: dict[str, np.ndarray] | None = None, chunk: int = CHUNK_BYTES) -> list[bytes]:
    """The message as chunks of at most `chunk` bytes, one copy of each byte."""
    out, cur, size = [], [], 0
    for piece in expand(pieces(meta, tensors or {})):
        view = memoryview(piece) if not isinstance(piece, memoryview) else piece
        while len(view):
            take = min(len(view), chunk - size)
            cur.append(view[:take])
            view, size = view[take:], size + take
            if size == chunk:
                out.append(b"".join(cur))
                cur, size = [], 0
    if cur or not out:
        out.append(b"".join(cur))
    return out


def join(chunks: Iterable[bytes], limit: int | None = None) -> bytes:
    """The chunks of one message, whole; WireError("oversize") as soon as they pass `limit` bytes
    (a stream has no size limit of its own: without one, a sender could fill the memory)."""
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if limit is not None and size > limit:
            raise WireError("oversize", f"streamed message over the limit of {limit} bytes")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def header(view: memoryview, total: int) -> tuple[dict, list[tuple[str, np.dtype, tuple, int, int]]]:
    """The meta of a message of `total` bytes and where its tensors lie: (name, dtype, shape,
    offset, nbytes) each. `view` holds the message's first bytes, its header at least (a
    receiver can read the header first and each tensor straight to where it is wanted).
    Raises WireError(reason) on anything malformed."""
    if _read_header_in_c is not None:
        found = _read_header_in_c(view, total)
        if found is not None:
            return found
    return _header_in_python(view, total)


def _header_in_python(view: memoryview, total: int) -> tuple[dict, list[tuple[str, np.dtype, tuple, int, int]]]:
    """`header`'s reading of any message: the C reader's (float32 and int64 tensors only) and what it declines."""
    if len(view) < HEADER_LENGTH.size:
        raise WireError("truncated", f"message of {len(view)} bytes has no header")
    (hlen,) = HEADER_LENGTH.unpack_from(view)
    start = HEADER_LENGTH.size + hlen
    if start > min(len(view), total):
        raise WireError("truncated", f"header of {hlen} bytes exceeds message of {total} bytes")
    if hlen > MAX_HEADER_BYTES:
        raise WireError("oversize", f"header of {hlen} bytes is over the limit of {MAX_HEADER_BYTES}")
    try:
        head = json_loads(view[HEADER_LENGTH.size : start])
        meta, entries, align = head["meta"], head["tensors"], head.get("align", 1)
        if not isinstance(meta, dict) or not isinstance(entries, list):
            raise TypeError("meta must be an object and tensors a list")
        if type(align) is not int or not 1 <= align <= MAX_ALIGN:
            raise TypeError(f"align must be an integer in 1..{MAX_ALIGN}")
    except (ValueError, KeyError, TypeError) as err:
        raise WireError("malformed", f"unreadable header: {brief(err)}") from None
    if len(entries) > MAX_TENSORS:
        raise WireError("oversize", f"{len(entries)} tensors, over the limit of {MAX_TENSORS}")
    places, offset = [], start
    for index, entry in enumerate(entries):
        name, dt, shape, nbytes = _entry(index, entry)
        offset += -offset % align
        if offset + nbytes > total:
            raise WireError("truncated", f"tensor {brief(name)}: payload ends {offset + nbytes - total} bytes early")
        places.append((name, dt, shape, offset, nbytes))
        offset += nbytes
    if offset != total:
        raise WireError("truncated", f"{total - offset} unexpected bytes after the last tensor")
    return meta, places


def brief(value, limit: int = 80) -> str:
    """`value`'s repr, cut to `limit` characters: what a refusal says of what a sender sent."""
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _entry(index: int, entry) -> tuple[str, np.dtype, tuple, int]:
    """Tensor entry number `index` of a header, [name, dtype, shape, nbytes], checked: its name a
    string, its dtype the wire's, its shape at most MAX_DIMS counts (checked before its size is
    computed), its size in bytes its shape's."""
    if type(entry) is not list or len(entry) != 4:
        raise WireError("wrong_dtype", f"tensor entry {index}: not [name, dtype, shape, nbytes]")
    name, wire_name, shape, nbytes = entry
    if type(name) is not str:
        raise WireError("malformed", f"tensor entry {index}: its name {brief(name)} is not a string")
    try:
        dt = dtype(wire_name)
    except (KeyError, TypeError):
        raise WireError("wrong_dtype", f"tensor {brief(name)}: unsupported dtype {brief(wire_name)}") from None
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise WireError("wrong_shape", f"tensor {brief(name)}: a shape is a list of at most {MAX_DIMS} counts")
    if not all(type(n) is int and n >= 0 for n in shape) or type(nbytes) is not int:
        raise WireError("wrong_shape", f"tensor {brief(name)}: shape {brief(shape)} and size {brief(nbytes)}")
    if nbytes != math.prod(shape) * dt.itemsize:
        raise WireError(
            "wrong_shape", f"tensor {brief(name)}: {nbytes} bytes do not match shape {brief(shape)} of {wire_name}"
        )
    return name, dt, tuple(shape), nbytes


def decode(data: bytes) -> Message:
    """Parse a message; raises WireError(reason) on anything malformed."""
    view = memoryview(data)
    meta, places = header(view, len(view))
    return Message(meta, {place[0]: tensor_at(view, place) for place in places})


def tensor_at(view: memoryview, place: tuple) -> np.ndarray:
    """The tensor at `place` (one of `header`'s) of the message whose bytes `view` holds: a view of
    them, or a copy where they do not lie aligned for its items (the kernels read them as such)."""
    _, dt, shape, offset, nbytes = place
    arr = np.frombuffer(view, dt, nbytes // dt.itemsize, offset).reshape(shape)
    return arr if arr.flags.aligned else arr.copy()


def iter_chunks(data: bytes, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    if len(data) <= chunk:
        yield data
        return
    view = memoryview(data)
    for i in range(0, len(view), chunk):
        yield bytes(view[i : i + chunk])
