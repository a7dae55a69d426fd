"""Fuzz target: a Step request through the PS's Python request path: wire.decode, and Shard.step of
an async and of a sync shard, on each transport's encoding.

wire.decode must return a message or raise WireError; Shard.step must answer or raise Rejected,
and a refused request must leave the shard's version and the sync step's pending pushes as they
were. Any other exception, and any sanitizer report of the C kernels it calls, is a crash.
Run by tests/fuzz/run.py; alone: `python tests/fuzz/fuzz_shard_step.py CORPUS_DIR [libFuzzer flags]`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py (PYTHONSAFEPATH leaves this folder out)
import atheris  # noqa: E402
import common  # noqa: E402  (first of tfps: the kernels to fuzz)
import numpy as np  # noqa: E402

with atheris.instrument_imports():
    from tfps.runtime import ps, wire

ASYNC = common.shard("async", "adam")
SYNC = common.shard("sync", "momentum")


def state(shard: ps.Shard) -> tuple:
    """What a refused request must leave as it was: the version, the sync step's pushes, the workers."""
    c = shard.consistency
    return shard.version, shard.examples, frozenset(c.pushed), tuple(c.clocks), tuple(c.last_seen), c.num_workers


def TestOneInput(data: bytes) -> None:
    try:
        msg = wire.decode(data)
        assert isinstance(msg.meta, dict) and all(type(name) is str for name in msg.tensors)
    except wire.WireError:
        pass
    buf = wire.aligned_empty(len(data))  # as the data path receives a frame
    buf[:] = np.frombuffer(data, np.uint8)
    for shard, request, encoding in (
        (ASYNC, memoryview(buf), "pieces"),
        (ASYNC, data, "bytes"),
        (SYNC, data, "chunks"),
        (SYNC, memoryview(buf), "pieces"),
    ):
        before = state(shard)
        try:
            shard.step(request, encoding)
        except ps.Rejected:
            assert state(shard) == before, "a refused request changed the shard"


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput, custom_mutator=common.mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
