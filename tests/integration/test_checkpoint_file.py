"""A checkpoint file is written around the page cache where the filesystem allows it, and
whole either way: the bytes of the wire message, nothing more, readable at once.

Real files: the test folder's filesystem (O_DIRECT), a ramfs mounted in a private mount
namespace (which refuses O_DIRECT), and util-linux's `fincore` to see the page cache.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from tfps.runtime import checkpoint, wire

pytestmark = pytest.mark.integration

RNG = np.random.default_rng(0)
# sizes that are not multiples of the staging buffer or of a page, one larger than the buffer
TENSORS = {
    "table": RNG.standard_normal((40_000, 33)).astype(np.float32),
    "bias": RNG.standard_normal(7).astype(np.float32),
    "step": np.arange(3, dtype=np.int64),
}
META = {"version": 12, "optimizer": "adam"}


def _resident_bytes(path) -> int:
    """Bytes of the file in the page cache, as `fincore` reports them."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[0])


def test_a_checkpoint_is_written_around_the_page_cache_and_reads_back_whole(tmp_path):
    assert TENSORS["table"].nbytes > checkpoint.DirectFile.STAGE_BYTES
    path = checkpoint.write(tmp_path, META, TENSORS)

    assert _resident_bytes(path) == 0  # written, fsynced, and none of it left in the cache
    assert path.read_bytes() == wire.encode(META, TENSORS)  # exactly the message: no padding left
    msg = checkpoint.read(tmp_path)
    assert msg.meta == META
    for name, arr in TENSORS.items():
        np.testing.assert_array_equal(msg.tensors[name], arr)
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILE_NAME]  # no temporary file behind


WRITE_ON_RAMFS = """
import sys
import numpy as np
from tfps.runtime import checkpoint, wire
tensors = {"w": np.arange(1_500_000, dtype=np.float32)}
path = checkpoint.write(sys.argv[1], {"version": 1}, tensors)
assert path.read_bytes() == wire.encode({"version": 1}, tensors)
print("whole")
"""


def test_a_filesystem_without_o_direct_gets_the_checkpoint_through_the_cache(tmp_path):
    folder = tmp_path / "ramfs"
    folder.mkdir()
    script = f'mount -t ramfs none "$1" && exec "{sys.executable}" -c "$2" "$1"'
    out = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, "sh", str(folder), WRITE_ON_RAMFS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["whole"]


def test_o_direct_refused_at_a_write_goes_on_through_the_cache(tmp_path, monkeypatch):
    """A mock: no filesystem here takes O_DIRECT when it is set and then refuses a write (one
    with a logical block larger than a page would), so the first direct write is refused
    here. Nothing may be lost: the refused bytes go through the cache."""
    real_write, refused = os.write, []

    def write(fd, data):
        if not refused and os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(checkpoint.os, "write", write)
    path = checkpoint.write(tmp_path, META, TENSORS)
    assert refused == [checkpoint.DirectFile.STAGE_BYTES]
    assert path.read_bytes() == wire.encode(META, TENSORS)


def test_a_table_that_training_changes_while_it_is_written_is_saved_as_it_was(tmp_path, monkeypatch):
    """Rows of an embedding table change between the writer's blocks (each time the staging
    buffer goes to disk, outside the table's lock: a plain Lock would deadlock otherwise), rows
    ahead of the writer and behind it; the file holds the table as it was at the snapshot."""
    table = TENSORS["table"].copy()
    lock = threading.Lock()
    snap = checkpoint.RowSnapshot(table, lock)
    real_flush, rng, changed = checkpoint.DirectFile._flush, np.random.default_rng(1), []

    def flush_while_training(self, n):
        with lock:
            rows = np.unique(rng.integers(0, len(table), 2_000))
            snap.before_update(rows)
            table[rows] += 1.0
            changed.append(len(rows))
        real_flush(self, n)

    monkeypatch.setattr(checkpoint.DirectFile, "_flush", flush_while_training)
    path = checkpoint.write(tmp_path, META, {**TENSORS, "table": snap})

    assert len(changed) > 1 and not np.array_equal(table, TENSORS["table"])
    assert path.read_bytes() == wire.encode(META, TENSORS)
