"""The wire format framed and read in C (runtime/_rows.c's encode_message and read_header): the
same bytes and the same header as runtime/wire.py's Python makes and reads, and everything else
left to that Python, which says what is wrong with a malformed message."""

import json
import struct

import numpy as np
import pytest

from tfps.runtime import wire

_rows = pytest.importorskip("tfps.runtime._rows")


@pytest.fixture
def python_only(monkeypatch):
    """Turns the C framing off: wire.pieces and wire.header as they are without it."""

    def python(fn, *args):
        monkeypatch.setattr(wire, "_encode_in_c", None)
        monkeypatch.setattr(wire, "_read_header_in_c", None)
        try:
            return fn(*args)
        finally:
            monkeypatch.undo()

    return python


def a_push() -> tuple[dict, dict]:
    """A worker's push as it sends it: dense gradients, a table's rows and their gradients, the rows it asks for."""
    rng = np.random.default_rng(7)
    tensors = {
        "dense/kernel": rng.normal(size=(520, 64)).astype(np.float32),
        "dense/bias": rng.normal(size=64).astype(np.float32),
        "emb/1:indices": np.sort(rng.choice(10_000, 300, replace=False)).astype(np.int64),
        "emb/1:values": rng.normal(size=(300, 64)).astype(np.float32),
        "emb/1:rows": np.sort(rng.choice(10_000, 200, replace=False)).astype(np.int64),
        "wide/1:rows": np.empty(0, np.int64),  # asks for none
        'odd "näme"\\': np.arange(3, dtype=np.float32),
    }
    return {"worker": 1, "workers": 2, "tag": 12, "seq": np.int64(11), "loss": 0.693, "pull": True}, tensors


def joined(pieces: list) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def test_a_push_is_framed_in_c_byte_for_byte_as_in_python(python_only):
    meta, tensors = a_push()
    in_c = _rows.encode_message(wire.json_dumps(meta), tensors)
    assert in_c is not None
    assert joined(wire.pieces(meta, tensors)) == joined(in_c) == joined(python_only(wire.pieces, meta, tensors))
    # each piece is bytes or a flat view of bytes, as the senders, the chunker and the checkpoints expect
    assert all(type(p) is bytes or (type(p) is memoryview and p.format == "B" and p.ndim == 1) for p in in_c)
    assert wire.join(wire.encode_chunks(meta, tensors, chunk=10_000)) == joined(in_c)
    msg = wire.decode(joined(in_c))
    assert msg.meta == {**meta, "seq": 11}
    for name, arr in tensors.items():
        assert msg.tensors[name].dtype == arr.dtype and msg.tensors[name].shape == arr.shape, name
        np.testing.assert_array_equal(msg.tensors[name], arr)


@pytest.mark.parametrize(
    "tensor",
    [
        np.ones(3, np.float16),
        np.ones(3, np.int32),
        np.ones((4, 4), np.float32)[:, 1],  # not contiguous
        np.float32(2.5).reshape(()),  # 0-d
        np.ones(3, np.float32).view(np.recarray),  # not the ndarray type itself
        np.ones(3, wire.dtype("bfloat16")),
    ],
    ids=["float16", "int32", "strided", "0-d", "subclass", "bfloat16"],
)
def test_any_other_tensor_is_framed_by_python(tensor, python_only):
    tensors = {"ok": np.arange(4, dtype=np.float32), "other": tensor}
    assert _rows.encode_message(wire.json_dumps({}), tensors) is None
    assert joined(wire.pieces({}, tensors)) == joined(python_only(wire.pieces, {}, tensors))
    np.testing.assert_array_equal(wire.decode(wire.encode({}, tensors)).tensors["other"], tensor)


def test_a_header_is_read_in_c_as_in_python(python_only):
    meta, tensors = a_push()
    data = memoryview(wire.encode(meta, tensors))
    start = wire.HEADER_LENGTH.size + wire.HEADER_LENGTH.unpack_from(data)[0]
    for view in (data, data[:start]):  # the whole message, or its header alone (a receiver reads that first)
        in_c = _rows.read_header(view, len(data))
        assert in_c is not None
        assert wire.header(view, len(data)) == in_c == python_only(wire.header, view, len(data))
    unaligned = json.dumps({"meta": {}, "tensors": [["a", "float32", [1], 4], ["b", "int64", [1], 8]]}).encode()
    packed = struct.pack("<I", len(unaligned)) + unaligned + np.float32(1).tobytes() + np.int64(2).tobytes()
    assert _rows.read_header(packed, len(packed)) == python_only(wire.header, memoryview(packed), len(packed))


def _message(entries: list, payload: int, **head) -> bytes:
    header = json.dumps({"meta": {}, "tensors": entries, **head}).encode()
    return struct.pack("<I", len(header)) + header + bytes(payload)


@pytest.mark.parametrize(
    "data, reason",
    [
        (_message([["w", "float32", [4, 4], 64]], 60), "truncated"),
        (_message([["w", "float32", [4, 4], 64]], 70), "truncated"),
        (_message([["w", "float32", [4, 4], 60]], 60), "wrong_shape"),
        (_message([["w", "float32", [-1, 4], -16]], 0), "wrong_shape"),
        (_message([["w", "object", [1], 8]], 8), "wrong_dtype"),
        (_message([["w", "float32", [1]]], 4), "wrong_dtype"),
        (_message([], 0, align=0), "malformed"),
        (_message([], 0, align=True), "malformed"),
        (b"\x05\x00\x00\x00{not json", "malformed"),
        (b"\x01\x00", "truncated"),
        (_message([["w", "float32", [2.0], 8]], 8), "wrong_shape"),  # a count that is not an integer
        (_message([[7, "float32", [1], 4]], 4), "malformed"),  # a name that is not a string
    ],
)
def test_a_malformed_header_is_left_to_python_which_names_what_is_wrong(data, reason):
    assert _rows.read_header(data, len(data)) is None
    with pytest.raises(wire.WireError) as err:
        wire.decode(data)
    assert err.value.reason == reason


def test_what_python_reads_its_own_way_is_left_to_it(python_only):
    for entries, payload in (
        ([["w", "bfloat16", [2], 4]], 4),
        ([["w", "float32", [2, 1, 1, 1, 1, 1, 1, 1, 1], 8]], 8),  # more dimensions than the C reader takes
    ):
        data = _message(entries, payload)
        assert _rows.read_header(data, len(data)) is None
        assert wire.header(memoryview(data), len(data)) == python_only(wire.header, memoryview(data), len(data))
