"""Fuzz target: every entry point of the PS's C kernels (runtime/_rows.c) with arrays of any shape,
dtype, length and alignment in memory (a view at any byte offset of its buffer), sharing memory or
not, and integers of any value.

Each call must do its work or refuse with TypeError, ValueError, KeyError, OverflowError or
BufferError, and never read or write outside its buffers (the sanitized build: any report
aborts). Run by tests/fuzz/run.py; alone: `python tests/fuzz/fuzz_kernels.py CORPUS_DIR [flags]`."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py (PYTHONSAFEPATH leaves this folder out)
import atheris  # noqa: E402
import common  # noqa: E402, F401  (first of tfps: the kernels to fuzz)
import numpy as np  # noqa: E402

with atheris.instrument_imports():
    from tfps.runtime import _rows, wire

REFUSALS = (TypeError, ValueError, KeyError, OverflowError, BufferError)
DTYPES = (np.float32, np.int64, np.uint16, np.int32, np.float64, np.uint8)
INT64 = (-(2**63), 2**63 - 1)


class Arrays:
    """Arrays made from the fuzzer's bytes: a few of them share one buffer, at any byte offset."""

    def __init__(self, fdp: atheris.FuzzedDataProvider):
        self.fdp = fdp
        self.pool = bytearray(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096)).ljust(4096, b"\0"))
        self.made: list[np.ndarray] = []

    def int(self) -> int:
        pick = self.fdp.ConsumeIntInRange(0, 3)
        return self.fdp.ConsumeIntInRange(*INT64) if pick == 0 else self.fdp.ConsumeIntInRange(-2, 40)

    def array(self, dtype=None, ndim: int | None = None) -> np.ndarray:
        fdp = self.fdp
        if self.made and fdp.ConsumeProbability() < 0.1:
            return self.made[fdp.ConsumeIntInRange(0, len(self.made) - 1)]  # the same array again
        dtype = np.dtype(dtype if dtype is not None and fdp.ConsumeProbability() < 0.9 else fdp.PickValueInList(DTYPES))
        ndim = ndim if ndim is not None and fdp.ConsumeProbability() < 0.9 else fdp.ConsumeIntInRange(0, 3)
        shape = tuple(fdp.ConsumeIntInRange(0, 9) for _ in range(ndim))
        count = int(np.prod(shape))
        offset = fdp.ConsumeIntInRange(0, 64)  # any byte: the items may lie misaligned
        if offset + count * dtype.itemsize > len(self.pool):
            offset, shape, count = 0, (0,) * ndim, 0
        arr = np.frombuffer(self.pool, dtype, count, offset).reshape(shape)
        if fdp.ConsumeProbability() < 0.1 and arr.ndim:
            arr = arr[::-1]  # not contiguous
        self.made.append(arr)
        return arr

    def rows(self, n: int = 9) -> np.ndarray:
        """int64 rows, mostly inside 0..n-1, in any order."""
        if self.fdp.ConsumeProbability() < 0.5:
            return self.array(np.int64, 1)
        return np.array([self.fdp.ConsumeIntInRange(-1, n) for _ in range(self.fdp.ConsumeIntInRange(0, 12))], np.int64)


def slots(a: Arrays, opt: int) -> tuple[tuple, dict]:
    names = ("m", "v")[: (0, 1, 2, 1)[opt] if 0 <= opt <= 3 else 0]
    return names, {name: a.array(np.float32, 2) for name in names}


def call(a: Arrays, which: int) -> None:
    fdp = a.fdp
    opt = fdp.ConsumeIntInRange(-1, 4)
    h = tuple(fdp.ConsumeFloat() for _ in range(4))
    if which == 0:
        _rows.finite(a.array(np.float32))
    elif which == 1:
        _rows.check_rows(a.rows(), a.int())
    elif which == 2:
        _rows.take(a.array(np.float32, 2), a.rows(), a.array(np.float32, 2))
    elif which == 3:
        _rows.segment_sum(a.array(np.float32, 2), a.rows(), a.array(np.float32, 2))
    elif which == 4:
        _rows.unique(a.array(np.int64, 1), a.array(np.int64, 1), a.array(np.int64, 1))
    elif which == 5:
        saved = [(a.rows(40), a.array(np.float32, 2)) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        _rows.put_back(a.array(np.float32, 2), a.int(), saved)
    elif which == 6:
        names, mine = slots(a, opt)
        _rows.update_rows(opt, h, names, a.array(np.float32, 2), mine, a.rows(), a.array(np.float32, 2))
    elif which == 7:
        names, mine = slots(a, opt)
        plus = a.array(np.float32) if fdp.ConsumeBool() else None
        _rows.update_dense(opt, h, names, a.array(np.float32), mine, a.array(np.float32), plus, fdp.ConsumeFloat())
    elif which == 8:
        _rows.to_bfloat16(a.array(np.float32), a.array(np.uint16))
    elif which == 9:
        _rows.from_bfloat16(a.array(np.uint16), a.array(np.float32))
    elif which == 10:
        tensors = {fdp.ConsumeUnicodeNoSurrogates(8): a.array() for _ in range(fdp.ConsumeIntInRange(0, 3))}
        _rows.encode_message(wire.json_dumps({"k": fdp.ConsumeIntInRange(0, 9)}), tensors)
    else:
        data = bytes(a.array(np.uint8, 1))
        _rows.read_header(data, a.int())


def TestOneInput(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    arrays = Arrays(fdp)
    with contextlib.suppress(REFUSALS):
        call(arrays, fdp.ConsumeIntInRange(0, 11))


def main() -> None:
    for fn in (Arrays.int, Arrays.array, Arrays.rows, slots, call):  # this file's branches guide the fuzzer too
        atheris.instrument_func(fn)
    atheris.Setup(sys.argv, atheris.instrument_func(TestOneInput))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
