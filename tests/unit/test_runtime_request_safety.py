"""The PS's request path refuses every malformed request the same way (issue 56): each finding of the
audit, as the request or the call that showed it. The C entry points check their buffers and their
preconditions before any typed access; wire.py and the Shard's checks raise WireError (Rejected),
never another exception; a refused request changes nothing. The transports' side is
tests/integration/test_runtime_ps_input.py's and test_runtime_datapath.py's."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tomllib

import numpy as np
import pytest
from support import REPO, async_training, lone_shard

from tfps.api.spec import TrainingSpec
from tfps.runtime import _rows, wire
from tfps.runtime.models import load_model
from tfps.runtime.ps import Rejected

MODEL_ARGS = {"vocabSize": 1000, "fields": 4, "embeddingDim": 8, "hidden": [16], "samples": 64, "testSamples": 0}
MODEL = load_model("wide-deep", MODEL_ARGS, 0)
KERNEL = "dense_0/kernel"
KERNEL_SHAPE = next(p.shape for p in MODEL.params if p.name == KERNEL)


def _shard(mode: str = "async", workers: int = 1):
    if mode == "async":
        training = async_training("wide-deep", MODEL_ARGS, "sgd", 0.1, steps=1000)
    else:
        training = TrainingSpec.model_validate(
            {
                "model": "wide-deep",
                "modelArgs": MODEL_ARGS,
                "optimizer": {"name": "sgd", "learningRate": 0.1},
                "steps": 1000,
                "consistency": {"mode": "sync"},
            }
        )
    return lone_shard(MODEL.params, training, workers=workers)


def _push(worker: int = 0, **meta) -> dict:
    return {"worker": worker, "tag": 0, "pull": False, "batch": 1, **meta}


def _gradients(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        KERNEL: rng.standard_normal(KERNEL_SHAPE).astype(np.float32),
        "embedding:indices": np.array([1, 5, 9], np.int64),
        "embedding:values": rng.standard_normal((3, 8)).astype(np.float32),
        "embedding:rows": np.array([4, 2], np.int64),
    }


def _message(meta: dict, entries: list, arrays: list, align: int = wire.ALIGN, header_pad: int = 0) -> bytes:
    """A wire message of any header entries and each tensor's bytes, laid out on `align`."""
    header = json.dumps({"meta": meta, "tensors": entries, "align": align}).encode() + b" " * header_pad
    out = struct.pack("<I", len(header)) + header
    for arr in arrays:
        out += bytes(-len(out) % align) + arr.tobytes()
    return out


def _packed(meta: dict, tensors: dict, align: int = wire.ALIGN, name=lambda n: n, header_pad: int = 0) -> bytes:
    entries = [[name(n), wire.dtype_name(a.dtype), list(a.shape), a.nbytes] for n, a in tensors.items()]
    return _message(meta, entries, list(tensors.values()), align, header_pad)


def _misaligned(meta: dict, tensors: dict) -> bytes:
    """`tensors` packed one after another ("align": 1) from an odd offset: every one misaligned."""
    for pad in range(8):
        data = _packed(meta, tensors, align=1, header_pad=pad)
        if (len(data) - sum(a.nbytes for a in tensors.values())) % 2:
            return data
    raise AssertionError("no odd offset")


def _state(shard) -> dict[str, np.ndarray]:
    out = {name: np.array(var) for name, var in shard.vars.items()}
    out |= {f"{n}:{s}": np.array(a) for n, slots in shard.slots.items() for s, a in slots.items()}
    return out


# ---- undefined behaviour reachable from the network ---------------------------------------------


def test_a_misaligned_push_is_not_read_in_place_and_is_applied_as_an_aligned_one():
    """A push whose header says "align": 1, its tensors at odd offsets: the C parser declines it
    (it read them as int64 and floats in place), and the Python path applies aligned copies."""
    grads = _gradients()
    misaligned = _misaligned(_push(pull=True), grads)
    shard = _shard()
    assert _rows.parse_request(misaligned, shard._layout, False) is None
    aligned, reference = wire.encode(_push(pull=True), grads), _shard()
    reference.step(memoryview(aligned), encoding="pieces")
    shard.step(memoryview(misaligned), encoding="pieces")
    assert shard.version == reference.version == 1
    for name, value in _state(reference).items():
        np.testing.assert_array_equal(_state(shard)[name], value, err_msg=name)


def _odd(dtype, count: int = 16) -> np.ndarray:
    """`count` items of `dtype` one byte past an aligned address."""
    raw = np.zeros(count * np.dtype(dtype).itemsize + 16, np.uint8)
    start = (-raw.ctypes.data % 16) + 1
    arr = raw[start : start + count * np.dtype(dtype).itemsize].view(dtype)
    assert arr.ctypes.data % np.dtype(dtype).itemsize and not arr.flags.aligned
    return arr


MISALIGNED_CALLS = {
    "finite": lambda: _rows.finite(_odd(np.float32)),
    "check_rows": lambda: _rows.check_rows(_odd(np.int64), 100),
    "take": lambda: _rows.take(np.zeros((8, 2), np.float32), _odd(np.int64, 2), np.zeros((2, 2), np.float32)),
    "segment_sum": lambda: _rows.segment_sum(
        _odd(np.float32).reshape(8, 2), np.zeros(8, np.int64), np.zeros((1, 2), np.float32)
    ),
    "unique": lambda: _rows.unique(_odd(np.int64), np.zeros(16, np.int64), np.zeros(16, np.int64)),
    "put_back": lambda: _rows.put_back(
        np.zeros((4, 2), np.float32), 0, [(_odd(np.int64, 2), np.ones((2, 2), np.float32))]
    ),
    "update_rows": lambda: _rows.update_rows(
        0,
        (0.1, 0, 0, 0),
        (),
        np.zeros((8, 2), np.float32),
        {},
        np.array([1, 2], np.int64),
        _odd(np.float32, 4).reshape(2, 2),
    ),
    "update_dense": lambda: _rows.update_dense(0, (0.1, 0, 0, 0), (), np.zeros(16, np.float32), {}, _odd(np.float32)),
    "to_bfloat16": lambda: _rows.to_bfloat16(_odd(np.float32), np.zeros(16, np.uint16)),
    "from_bfloat16": lambda: _rows.from_bfloat16(_odd(np.uint16), np.zeros(16, np.float32)),
}


@pytest.mark.parametrize("call", MISALIGNED_CALLS.values(), ids=MISALIGNED_CALLS.keys())
def test_every_kernel_refuses_items_that_are_not_aligned(call):
    with pytest.raises(ValueError, match="not aligned"):
        call()


def test_put_back_refuses_rows_that_are_not_increasing_and_writes_nothing_outside_its_block():
    """Rows out of order sent a copy outside the block (a heap overflow where the block ends its
    allocation): here the block is rows 2..5 of a larger array, whose other rows must not change."""
    table = np.zeros((8, 2), np.float32)
    block = table[2:6]
    with pytest.raises(ValueError, match="strictly increasing"):
        _rows.put_back(block, 10, [(np.array([8, 13, 9], np.int64), np.ones((3, 2), np.float32))])
    assert not table[:2].any() and not table[6:].any()


@pytest.mark.parametrize("lo", [2**63 - 2, -1])
def test_put_back_refuses_a_block_whose_rows_overflow(lo):
    with pytest.raises(ValueError, match="a block from row"):
        _rows.put_back(np.zeros((4, 2), np.float32), lo, [(np.array([1], np.int64), np.ones((1, 2), np.float32))])


def test_check_rows_refuses_a_table_of_negative_size():
    with pytest.raises(ValueError, match="a table of"):
        _rows.check_rows(np.zeros(0, np.int64), -(2**63))


# ---- malformed requests refused as such, never as another exception ---------------------------


@pytest.mark.parametrize("name", [[KERNEL], {"n": KERNEL}, 7, None], ids=["list", "dict", "number", "null"])
def test_a_tensor_name_that_is_not_a_string_is_refused(name):
    data = _packed(_push(), {KERNEL: _gradients()[KERNEL]}, name=lambda _: name)
    with pytest.raises(wire.WireError) as err:
        wire.decode(data)
    assert err.value.reason == "malformed"
    with pytest.raises(Rejected) as refused:
        _shard().step(data)
    assert refused.value.reason == "malformed"


def test_a_shape_of_more_dimensions_than_numpy_takes_is_refused():
    entries = [["w", "float32", [1] * 64 + [0], 0], ["b", "float32", [1], 4]]
    data = _message(_push(), entries, [np.zeros(0, np.float32), np.ones(1, np.float32)])
    with pytest.raises(wire.WireError) as err:
        wire.decode(data)
    assert err.value.reason == "wrong_shape"


def test_a_dense_name_ending_in_a_colon_is_refused_and_the_sync_step_keeps_the_other_pushes():
    """A name "part:" once passed the checks as the dense part and failed in the update, after the
    sync step had taken the pushes of the other workers: they were lost with it."""
    shard, grads = _shard("sync", workers=2), [_gradients(seed) for seed in (1, 2)]
    before = np.array(shard.vars[KERNEL])
    dense = [{KERNEL: g[KERNEL]} for g in grads]
    shard.step(wire.encode(_push(0), dense[0]))  # pending: the step waits for worker 1
    with pytest.raises(Rejected) as err:
        shard.step(_packed(_push(1), {KERNEL + ":": grads[1][KERNEL]}))
    assert err.value.reason == "malformed" and shard.version == 0 and shard.consistency.pushed == {0}
    shard.step(wire.encode(_push(1), dense[1]))
    assert shard.version == 1
    mean = (dense[0][KERNEL] + dense[1][KERNEL]) * np.float32(0.5)
    np.testing.assert_allclose(shard.vars[KERNEL], before - np.float32(0.1) * mean, rtol=1e-6, atol=1e-7)


def test_a_push_refused_for_a_nan_leaves_the_workers_the_shard_counts():
    """A push of a worker 7 in a cluster it claims to be larger, refused for a NaN found by the
    update's own pass: the shard counts the workers it did before (and tells real workers to cut
    their batches into as many slices)."""
    shard = _shard()
    grads = _gradients()
    grads[KERNEL] = grads[KERNEL].copy()
    grads[KERNEL].flat[3] = np.nan
    workers, split = list(shard.clocks), shard.consistency.split_size()
    for encoding in ("pieces", "bytes"):  # the C path and the Python one
        with pytest.raises(Rejected) as err:
            shard.step(memoryview(wire.encode(_push(7, workers=100, pull=True), grads)), encoding=encoding)
        assert err.value.reason == "non_finite"
        assert shard.clocks == workers and shard.consistency.split_size() == split


# ---- bounds checked before the work that grows with them ---------------------------------------


def test_a_header_over_the_limit_is_refused_unparsed(monkeypatch):
    parsed = []
    monkeypatch.setattr(wire, "json_loads", lambda text: parsed.append(len(text)))
    data = _message(_push(), [], [], header_pad=wire.MAX_HEADER_BYTES)
    for reader in (wire._header_in_python, wire.header):
        with pytest.raises(wire.WireError) as err:
            reader(memoryview(data), len(data))
        assert err.value.reason == "oversize"
    assert not parsed


def test_the_counts_of_tensors_and_dimensions_are_bounded_before_any_size_is_computed(monkeypatch):
    """A shape of thousands of dimensions cost a product over all of them, quadratic in their
    count (35 ms for a 64 KiB header): now no product is made over more than MAX_DIMS."""
    products = []
    real = wire.math.prod
    monkeypatch.setattr(wire.math, "prod", lambda shape: products.append(len(shape)) or real(shape))
    wide = _message(_push(), [["w", "float32", [1] * 10_000, 4]], [np.zeros(1, np.float32)])
    many = _message(_push(), [["w", "float32", [0], 0]] * (wire.MAX_TENSORS + 1), [])
    for data, reason in ((wide, "wrong_shape"), (many, "oversize")):
        with pytest.raises(wire.WireError) as err:
            wire.decode(data)
        assert err.value.reason == reason
    assert max(products, default=0) <= wire.MAX_DIMS
    assert (_rows.MAX_HEADER_BYTES, _rows.MAX_TENSORS, _rows.MAX_DIMS, _rows.ALIGN) == (
        wire.MAX_HEADER_BYTES,
        wire.MAX_TENSORS,
        wire.MAX_DIMS,
        wire.ALIGN,
    )


# ---- the C module itself ------------------------------------------------------------------------


def test_the_module_is_whole_when_imported_and_a_call_imports_nothing():
    """Its state was made on the first call of a reader, one reference after another, its flag
    first: a second thread could find the flag set and the rest not yet. Now it is made at import
    (the module's exec slot): a first call, in a process that imported nothing else of tfps,
    imports nothing."""
    script = """
import builtins, numpy as np
from tfps.runtime import _rows
seen, real = [], builtins.__import__
builtins.__import__ = lambda name, *a, **k: seen.append(name) or real(name, *a, **k)
header = b'{"meta":{},"tensors":[["w","float32",[1],4]],"align":4}'
data = len(header).to_bytes(4, "little") + header + bytes(-(4 + len(header)) % 4) + bytes(4)
assert _rows.read_header(data, len(data)) is not None
assert _rows.parse_request(data, {}, False) is None
_rows.apply_async(0, (0.1, 0, 0, 0), (), {}, {}, {}, {}, {}, (), b"{}")
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]", out.stdout


def test_each_function_of_the_module_takes_the_arguments_its_docstring_names():
    """Calls with as many arguments as a docstring names reach the argument checks of the types,
    not of the count."""
    for name in ("update_rows", "update_dense", "apply_async", "parse_request", "check_rows", "read_header"):
        doc = getattr(_rows, name).__doc__
        signature = doc[doc.index("(") + 1 : doc.index(")")]
        required = signature.split("[")[0].count(",") + 1
        most = signature.count(",") + 1
        for count in {required, most}:
            try:
                getattr(_rows, name)(*[object()] * count)
            except TypeError as err:
                assert "argument" not in str(err) or "must be" in str(err), f"{name}: {doc!r}: {err}"
            except ValueError:
                pass


def test_the_kernels_build_with_every_warning_an_error_and_say_what_they_assume():
    with open(REPO / "pyproject.toml", "rb") as fh:
        modules = tomllib.load(fh)["tool"]["setuptools"]["ext-modules"]
    (rows,) = [m for m in modules if m["name"] == "tfps.runtime._rows"]
    assert {"-Wall", "-Wextra", "-Werror"} <= set(rows["extra-compile-args"])
    assert {"runtime/_rows.c", "runtime/_rows_wire.c"} == set(rows["sources"])
    header = (REPO / "runtime" / "_rows.h").read_text()
    assert "__ORDER_LITTLE_ENDIAN__" in header and "sizeof(Py_ssize_t) == 8" in header
