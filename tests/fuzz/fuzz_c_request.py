"""Fuzz target: a Step request through the PS's request path in C (runtime/_rows_wire.c), as the data
path and gRPC hand it over: read_header, parse_request and, for what parse_request takes,
apply_async on a shard's own arrays.

The C readers must take only what the Python reader takes (runtime/wire.py's header, runtime/ps.py's
checks), and read it alike; every call must return or refuse (None, a non-finite name), never
raise, and never read or write outside its buffers (the sanitized build: any report aborts).
Run by tests/fuzz/run.py; alone: `python tests/fuzz/fuzz_c_request.py CORPUS_DIR [libFuzzer flags]`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py (PYTHONSAFEPATH leaves this folder out)
import atheris  # noqa: E402
import common  # noqa: E402  (first of tfps: the kernels to fuzz)
import numpy as np  # noqa: E402

with atheris.instrument_imports():
    from tfps.runtime import _rows, ps, wire

SHARD = common.shard("async", "adam")
REPLY_META = wire.json_dumps({"version": 1, "fuzz": True})


def python_header(view, total: int):
    try:
        return wire._header_in_python(memoryview(view), total)
    except wire.WireError:
        return None


def same_tensors(fast: dict, slow: dict) -> bool:
    return fast.keys() == slow.keys() and all(
        np.asarray(fast[k]).dtype == np.asarray(slow[k]).dtype
        and np.asarray(fast[k]).tobytes() == np.asarray(slow[k]).tobytes()
        for k in fast
    )


def check(view, data: bytes, check_dense: bool) -> None:
    total = len(data)
    for length in (total, min(total, 4 + int.from_bytes(data[:4].ljust(4, b"\0"), "little"))):
        header = _rows.read_header(view[:length], total)  # the header alone, as a receiver reads it first
        if header is not None:
            assert header == python_header(view[:length], total), "read_header took what wire.header does not"
    parsed = _rows.parse_request(view, SHARD._layout, check_dense)
    if parsed is None:
        return
    meta, dense, sparse, rows = parsed
    try:
        SHARD._parse_fields(meta)
    except ps.Rejected:
        return  # the meta is the Python side's to check
    slow = SHARD._parse(wire.decode(view))  # what C took, the Python checks take: no Rejected here
    assert same_tensors(dense, slow.push.dense), "dense gradients differ"
    assert same_tensors(rows, slow.rows), "rows asked for differ"
    assert same_tensors({k: v[0] for k, v in sparse.items()}, {k: v[0] for k, v in slow.push.sparse.items()})
    assert same_tensors({k: v[1] for k, v in sparse.items()}, {k: v[1] for k, v in slow.push.sparse.items()})
    opt, hyper = SHARD.optimizer.kernel_args(SHARD.version + 1)
    out = _rows.apply_async(
        opt,
        hyper,
        SHARD.optimizer.slot_names(),
        SHARD.vars,
        SHARD.slots,
        dense,
        sparse,
        rows,
        SHARD._dense_names,
        REPLY_META,
    )
    if isinstance(out, str):
        assert out in dense, out
        return
    pieces, nbytes = out
    reply = wire.decode(b"".join(bytes(memoryview(p).cast("B")) for p in pieces))
    assert (
        len(reply.tensors) == len(SHARD._dense_names) + len(rows)
        and sum(len(memoryview(p).cast("B")) for p in pieces) == nbytes
    )


def TestOneInput(data: bytes) -> None:
    buf = wire.aligned_empty(len(data))  # as the data path receives a frame
    buf[:] = np.frombuffer(data, np.uint8)
    check(memoryview(buf), data, False)
    check(data, data, True)  # as gRPC hands it over: bytes


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput, custom_mutator=common.mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
