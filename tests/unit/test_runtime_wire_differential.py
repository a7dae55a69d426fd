"""The C readers of the wire (runtime/_rows_wire.c) against its Python reader (runtime/wire.py) and
the Shard's checks (runtime/ps.py), on messages Hypothesis makes: well-formed ones of every dtype
and shape, and the same with one thing of their header or payload changed.

What C reads, it reads as Python does (the same meta and places; the same tensors, taken by the
same checks); what Python refuses, C declines; Python raises nothing but WireError. C may decline
what Python takes (bfloat16, more than 8 dimensions, rows out of order): Python reads those."""

from __future__ import annotations

import json
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import async_training, lone_shard

from tfps.runtime import _rows, wire
from tfps.runtime.models import load_model
from tfps.runtime.ps import Rejected

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI does not turn red at random
    database=None,  # nothing written into the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODEL_ARGS = {"vocabSize": 100, "fields": 2, "embeddingDim": 4, "hidden": [3], "samples": 8, "testSamples": 0}
MODEL = load_model("wide-deep", MODEL_ARGS, 0)
SHARD = lone_shard(MODEL.params, async_training("wide-deep", MODEL_ARGS))
TABLE_ROWS = {p.name: p.shape[0] for p in MODEL.params if p.sparse}
DENSE = {p.name: p.shape for p in MODEL.params if not p.sparse}

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
dtypes = st.sampled_from(["float32", "int64", "int32", "float16", "bfloat16"])
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
metas = st.dictionaries(st.sampled_from(["worker", "tag", "pull", "x"]), st.integers(-2, 5) | st.booleans(), max_size=4)


@st.composite
def messages(draw) -> bytes:
    tensors = {}
    for name in draw(st.lists(names, max_size=4, unique=True)):
        dtype, shape = wire.dtype(draw(dtypes)), draw(shapes)
        count = int(np.prod(shape))
        raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
        tensors[name] = np.frombuffer(raw, dtype).reshape(shape)
    return wire.encode(draw(metas), tensors)


def _reframed(data: bytes, change) -> bytes:
    """`data` with its header's JSON changed by `change(head)` (in place) and framed again."""
    (hlen,) = struct.unpack_from("<I", data)
    head = json.loads(data[4 : 4 + hlen])
    change(head)
    header = json.dumps(head).encode()
    header += b" " * (-(4 + len(header)) % 64)
    return struct.pack("<I", len(header)) + header + data[4 + hlen :]


ODD = st.sampled_from([-1, 0, 1, 3, 7, 2**40, 2**63 - 1, 1.5, "4", None, True, [], [1], {"a": 1}])


@st.composite
def changed(draw) -> bytes:
    """A well-formed message with one thing changed: a header field, a byte, its length."""
    data = draw(messages())
    how = draw(st.integers(0, 5))
    (hlen,) = struct.unpack_from("<I", data)
    head = json.loads(data[4 : 4 + hlen])
    entries = head["tensors"]
    if how == 0:
        head["align"] = draw(ODD | st.integers(1, 8))
    elif how == 1 and entries:
        entry, field = draw(st.sampled_from(entries)), draw(st.integers(0, 3))
        entry[field] = draw(ODD | names | st.lists(st.integers(0, 3), max_size=70))
    elif how == 2 and entries:
        del draw(st.sampled_from(entries))[draw(st.integers(0, 3))]
    elif how == 3:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    elif how == 4:
        return data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=16))
    else:
        head[draw(st.sampled_from(["meta", "tensors"]))] = draw(ODD)
    return _reframed(data, lambda h: h.update(head))


def _python_header(view, total: int):
    try:
        return wire._header_in_python(view, total)
    except wire.WireError:
        return None


def _check_header(data: bytes) -> None:
    view = memoryview(data)
    python = _python_header(view, len(data))
    in_c = _rows.read_header(view, len(data))
    if in_c is not None:
        assert in_c == python
    try:
        wire.decode(data)
    except wire.WireError:
        assert python is None
    if len(data) >= 4:  # the header alone, as a receiver reads it first
        start = min(len(data), 4 + struct.unpack_from("<I", data)[0])
        in_c = _rows.read_header(view[:start], len(data))
        if in_c is not None:
            assert in_c == _python_header(view[:start], len(data))


@SETTINGS
@given(messages())
def test_c_reads_a_header_as_python_does(data):
    _check_header(data)
    msg = wire.decode(data)
    if all(arr.dtype in (np.float32, np.int64) and arr.ndim for arr in msg.tensors.values()):
        assert _rows.read_header(data, len(data)) is not None  # the common kind: read in C


@SETTINGS
@given(changed())
def test_c_takes_no_header_that_python_refuses(data):
    _check_header(data)


# ---- a Step request: parse_request against the Shard's own checks -----------------------------


@st.composite
def requests(draw) -> bytes:
    """A request as a worker sends it (dense gradients, each table's rows and their gradients, the
    rows it asks for back), with its values, order or shapes drawn so that some are refused."""
    tensors = {}
    floats = st.sampled_from([0.0, 1.0, -2.5, 1e30, float("nan"), float("inf")])
    for name, shape in DENSE.items():
        if draw(st.booleans()):
            bad = draw(st.sampled_from(["", "", "", "shape", "dtype", "value"]))
            arr = np.full(shape if bad != "shape" else (*shape[:-1], shape[-1] + 1), 0.5, np.float32)
            arr.flat[0] = draw(floats) if bad == "value" else 0.5
            tensors[name] = arr.astype(np.int64) if bad == "dtype" else arr
    for table, rows in TABLE_ROWS.items():
        width = next(p.shape[1] for p in MODEL.params if p.name == table)
        ids = draw(st.lists(st.integers(-1, rows), max_size=5))
        if draw(st.booleans()):
            ids = sorted(set(ids))
        if ids or draw(st.booleans()):
            tensors[f"{table}:indices"] = np.array(ids, np.int64)
            k = len(ids) + draw(st.sampled_from([0, 0, 0, 1]))
            values = np.full((k, width), 0.25, np.float32)
            if k:
                values.flat[0] = draw(floats)
            tensors[f"{table}:values"] = values
        if draw(st.booleans()):
            tensors[f"{table}:rows"] = np.array(draw(st.lists(st.integers(-1, rows), max_size=5)), np.int64)
    order = draw(st.permutations(list(tensors)))
    meta = {"worker": 0, "tag": draw(st.integers(0, 3)), "pull": draw(st.booleans()), "batch": 1}
    return wire.encode(meta, {name: tensors[name] for name in order})


def _same(fast: dict, slow: dict) -> None:
    assert fast.keys() == slow.keys()
    for name in fast:
        assert fast[name].dtype == slow[name].dtype and fast[name].tobytes() == slow[name].tobytes(), name


@SETTINGS
@given(requests(), st.booleans())
def test_c_takes_a_request_only_as_the_shards_checks_do(data, check_dense):
    try:
        slow = SHARD._parse(wire.decode(data))
        if check_dense:
            for name, arr in slow.push.dense.items():
                SHARD._check_values(name, arr, arr.shape)
    except Rejected:
        slow = None
    fast = _rows.parse_request(data, SHARD._layout, check_dense)
    if fast is None:
        return
    assert slow is not None, "parse_request took a request that the Shard's checks refuse"
    meta, dense, sparse, rows = fast
    assert meta == wire.decode(data).meta
    _same(dense, slow.push.dense)
    _same(rows, slow.rows)
    _same({k: v[0] for k, v in sparse.items()}, {k: v[0] for k, v in slow.push.sparse.items()})
    _same({k: v[1] for k, v in sparse.items()}, {k: v[1] for k, v in slow.push.sparse.items()})


def test_a_request_whose_tensors_lie_misaligned_is_left_to_python():
    """Tensors packed one after another from an odd offset ("align": 1): C declines the request (it
    would read them in place), and the Python reader hands the Shard's checks aligned copies."""
    rows = np.array([1, 2], np.int64)
    grad = np.arange(np.prod(DENSE["dense_0/kernel"]), dtype=np.float32).reshape(DENSE["dense_0/kernel"])
    entries = [
        ["embedding:rows", "int64", [2], rows.nbytes],
        ["dense_0/kernel", "float32", list(grad.shape), grad.nbytes],
    ]
    header = json.dumps({"meta": {"worker": 0}, "tensors": entries, "align": 1}).encode()
    header += b" " * ((4 + len(header)) % 2 == 0)  # the first tensor at an odd offset
    data = struct.pack("<I", len(header)) + header + rows.tobytes() + grad.tobytes()
    assert _rows.parse_request(data, SHARD._layout, False) is None
    req = SHARD._parse(wire.decode(data))
    np.testing.assert_array_equal(req.push.dense["dense_0/kernel"], grad)
    np.testing.assert_array_equal(req.rows["embedding"], rows)
    assert req.push.dense["dense_0/kernel"].flags.aligned and req.rows["embedding"].flags.aligned
