"""The PS wire format: raw tensor bytes round-trip, and malformed messages are named."""

import numpy as np
import pytest

from tfps.runtime import wire


def test_round_trip_keeps_names_dtypes_shapes_and_values():
    grid = np.arange(20, dtype=np.float32).reshape(4, 5)
    tensors = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "idx": np.array([5, 1], np.int64),
        "s": np.float32(2.5).reshape(()),
        "none": np.empty((0, 64), np.float32),
        "rows": grid[1:3],
        "cols": grid[:, 1:3],
        "half": np.ones(3, np.float16),
        "i32": np.array([[7, -8]], np.int32),
    }
    msg = wire.decode(wire.encode({"worker": 1, "tag": 7}, tensors))
    assert msg.meta == {"worker": 1, "tag": 7}
    for name, arr in tensors.items():
        assert msg.tensors[name].dtype == arr.dtype
        assert msg.tensors[name].shape == arr.shape, name  # a scalar stays 0-d
        np.testing.assert_array_equal(msg.tensors[name], arr)


def test_chunked_message_joins_to_the_same_bytes():
    big = {"w": np.random.default_rng(0).normal(size=(300, 1000)).astype(np.float32)}
    chunks = wire.encode_chunks({"a": 1}, big, chunk=100_000)
    assert len(chunks) > 10 and all(len(c) <= 100_000 for c in chunks)
    assert wire.join(chunks) == wire.encode({"a": 1}, big)
    np.testing.assert_array_equal(wire.decode(wire.join(chunks)).tensors["w"], big["w"])
    assert b"".join(wire.iter_chunks(wire.join(chunks), chunk=100_000)) == wire.join(chunks)


@pytest.mark.parametrize(
    "mangle, reason",
    [
        (lambda b: b[:-3], "truncated"),
        (lambda b: b[:2], "truncated"),
        (lambda b: b + b"xx", "truncated"),
        (lambda b: b[:4] + b"{not json" + b[13:], "malformed"),
    ],
)
def test_malformed_messages_name_their_reason(mangle, reason):
    data = wire.encode({"x": 1}, {"w": np.ones((4, 4), np.float32)})
    with pytest.raises(wire.WireError) as err:
        wire.decode(mangle(data))
    assert err.value.reason == reason


def test_header_that_lies_about_size_is_wrong_shape():
    import json
    import struct

    header = json.dumps({"meta": {}, "tensors": [["w", "float32", [4, 4], 60]]}).encode()
    data = struct.pack("<I", len(header)) + header + bytes(60)
    with pytest.raises(wire.WireError) as err:
        wire.decode(data)
    assert err.value.reason == "wrong_shape"


def test_unknown_dtype_is_refused():
    import json
    import struct

    header = json.dumps({"meta": {}, "tensors": [["w", "object", [1], 8]]}).encode()
    with pytest.raises(wire.WireError) as err:
        wire.decode(struct.pack("<I", len(header)) + header + bytes(8))
    assert err.value.reason == "wrong_dtype"


def test_bfloat16_tensors_travel_as_two_bytes_each():
    values = np.array([[1.5, -2.0], [0.0078125, 3.0e38]], np.float32).astype(wire.dtype("bfloat16"))
    data = wire.encode({}, {"w": values})
    out = wire.decode(data).tensors["w"]
    assert out.dtype.name == "bfloat16" and out.shape == (2, 2)
    np.testing.assert_array_equal(out.astype(np.float32), values.astype(np.float32))
    # the same header length either way ("bfloat16", 8 bytes / "float32", 16 bytes): the payload is half
    assert len(wire.encode({}, {"w": values.astype(np.float32)})) - len(data) == 8


def test_tensors_start_aligned_so_tensorflow_can_use_them_in_place():
    tensors = {"a": np.arange(3, dtype=np.float32), "b": np.ones((5, 7), np.float32), "c": np.arange(4, dtype=np.int64)}
    data = wire.encode({"k": "v"}, tensors)
    buf = wire.aligned_empty(len(data))
    buf[:] = np.frombuffer(data, np.uint8)
    msg = wire.decode(memoryview(buf))
    assert msg.meta == {"k": "v"}
    for name, arr in msg.tensors.items():
        assert arr.ctypes.data % wire.ALIGN == 0, name
        np.testing.assert_array_equal(arr, tensors[name])


def test_a_message_without_alignment_still_decodes_and_a_bad_align_is_refused():
    import json
    import struct

    header = json.dumps({"meta": {}, "tensors": [["a", "float32", [1], 4], ["b", "float32", [1], 4]]}).encode()
    packed = struct.pack("<I", len(header)) + header + np.array([1, 2], np.float32).tobytes()
    assert wire.decode(packed).tensors["b"][0] == 2.0
    header = json.dumps({"meta": {}, "tensors": [], "align": 0}).encode()
    with pytest.raises(wire.WireError) as err:
        wire.decode(struct.pack("<I", len(header)) + header)
    assert err.value.reason == "malformed"


def test_address_is_where_the_array_starts():
    grid = np.arange(20, dtype=np.float32).reshape(4, 5)
    arrays = [
        wire.aligned_array((3, 5), np.float32),
        grid[1:3],
        grid[:, 1:3],
        np.ones((2, 3), wire.dtype("bfloat16")),
        np.empty(0, np.float32),
        np.frombuffer(bytes(64), np.uint8),
        np.array(3.0, np.float32),
    ]
    for arr in arrays:
        assert wire.address(arr) == arr.ctypes.data
    assert all(wire.address(wire.aligned_empty(n)) % wire.ALIGN == 0 for n in (1, 100, 1 << 20))
