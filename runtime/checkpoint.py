"""Atomic per-shard checkpoints: `<path>/ps-<i>/shard.tfps`, in the wire format.

Written to a temporary file in the same folder, around the page cache (`DirectFile`), fsynced,
renamed over the old one and the folder fsynced: a reader sees the previous checkpoint or the
new one, never half of one.

A checkpoint written by another number of PS is re-sharded on restore: each new shard
assembles its parts' rows, and the same rows of their optimizer slots, from the old shards'
files (mapped, so only the rows it takes are read). The old layout is recomputed from the
model and the old PS count (runtime/sharding.py is deterministic), and each old file must
match it. The restored step is the smallest of the old shards' (async shards checkpoint at
their own pace); the per-worker clocks likewise.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import numpy as np

from tfps.api.settings import ProcessSettings
from tfps.api.spec import CheckpointSpec

from . import _rows as kernels
from . import wire
from .sharding import Part, Placement

log = logging.getLogger("tfps.ps")

FILE_NAME = "shard.tfps"
# Tests only: "<step>" makes the process SIGKILL itself once (a marker file in the folder
# remembers it), between writing that step's temporary file and renaming it: a crash in the
# middle of a checkpoint, made deterministic.
CRASH_MARKER = ".crash-hook-fired"


def shard_dir(root: str | Path, ps_index: int) -> Path:
    return Path(root) / f"ps-{ps_index}"


def write(folder: str | Path, meta: dict, tensors: dict[str, np.ndarray]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / FILE_NAME
    fd, tmp = tempfile.mkstemp(prefix=".shard-", suffix=".tmp", dir=folder)
    try:
        out = DirectFile(fd)
        try:
            # from the tensors' memory through one staging buffer (a RowSnapshot's blocks are
            # copied into it straight from the table): no copy of the shard is made to write it
            for piece in wire.pieces(meta, tensors):
                if isinstance(piece, RowSnapshot):
                    out.write_snapshot(piece)
                else:
                    out.write(piece)
            out.finish()
        finally:
            os.close(fd)
        _crash_hook(folder, meta)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


class DirectFile:
    """Writes a file around the page cache (O_DIRECT) through an aligned staging buffer;
    `finish()` writes what is left, cuts the file to its length and fsyncs it.

    A checkpoint is written once and not read soon. Through the page cache, the writer copies
    each byte into the cache and the kernel writes it back later: CPU time taken from the cores
    training shares, in the steps that run while a checkpoint is written (several times the CPU
    of a direct write), and the cache filled with the checkpoint. Where the filesystem refuses
    O_DIRECT, at the start or at a write, the file goes on through the cache."""

    ALIGN = 4096  # O_DIRECT's alignment of buffer address, file offset and length (a page)
    STAGE_BYTES = 4 << 20

    def __init__(self, fd: int):
        self.fd, self.size, self.fill = fd, 0, 0
        self.buf = wire.aligned_empty(self.STAGE_BYTES, self.ALIGN)
        self.direct = self._set_direct(True)

    def _set_direct(self, on: bool) -> bool:
        if not hasattr(os, "O_DIRECT"):
            return False
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
        except OSError:  # EINVAL: this filesystem has no O_DIRECT
            return False
        return on

    def write(self, data) -> None:
        src = np.frombuffer(data, np.uint8)
        while src.size:
            n = min(src.size, self.buf.size - self.fill)
            self.buf[self.fill : self.fill + n] = src[:n]
            self.fill += n
            src = src[n:]
            if self.fill == self.buf.size:
                self._flush(self.fill)

    def write_snapshot(self, snap: RowSnapshot) -> None:
        """A RowSnapshot's bytes, each block copied from the table straight into the staging
        buffer (one copy of the table to write it, not two). The blocks are copied under the
        table's lock, so the buffer is written out between them, never while it is held."""
        room = self.buf.size - self.ALIGN  # what a flush leaves at least
        if snap.block_bytes > room:  # rows wider than the buffer: not staged in place
            for block in snap.blocks():
                self.write(block)
            return
        self._make_room(snap.block_bytes)
        for block in snap.blocks(into=self._next):
            self.fill += block.nbytes
            self._make_room(snap.block_bytes)

    def _make_room(self, n: int) -> None:
        if self.buf.size - self.fill < n:
            self._flush(self.fill // self.ALIGN * self.ALIGN)

    def _next(self, n: int) -> np.ndarray:
        """The next `n` bytes of the staging buffer (`_make_room` made them), for the caller to fill."""
        return self.buf[self.fill : self.fill + n]

    def _flush(self, n: int) -> None:
        """Write the first `n` staged bytes (a multiple of ALIGN, or all of them with the last
        padded: `finish` cuts the padding off) and move the rest to the buffer's start."""
        view = memoryview(self.buf[: -(-n // self.ALIGN) * self.ALIGN])
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except OSError as err:
                if err.errno != errno.EINVAL or not self.direct:
                    raise
                self.direct = self._set_direct(False)  # refused at a write: nothing was written
        rest = self.fill - n
        if rest > 0:
            self.buf[:rest] = self.buf[n : self.fill]
        self.size += n
        self.fill = rest

    def finish(self) -> None:
        if self.fill:
            self._flush(self.fill)
        os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)


def _crash_hook(folder: Path, meta: dict) -> None:
    at = ProcessSettings.from_env().crash_at
    if at is None or str(meta.get("version")) != str(at) or (folder / CRASH_MARKER).exists():
        return
    (folder / CRASH_MARKER).write_text(str(at))
    # Die at once, as SIGKILL would; but a container's main process is PID 1 of its namespace,
    # which ignores a SIGKILL sent from inside it, so exit without any clean-up instead.
    os._exit(128 + signal.SIGKILL)


def read(folder: str | Path) -> wire.Message | None:
    """The last complete checkpoint in `folder`, or None when there is none. The file is
    mapped, not read: its tensors are views whose pages are read when they are used."""
    target = Path(folder) / FILE_NAME
    try:
        with open(target, "rb") as fh:
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(fh.fileno()).st_size else b""
    except FileNotFoundError:
        return None
    return wire.decode(data)


def load_rows(dst: np.ndarray, src: np.ndarray, block_bytes: int = 16 << 20) -> None:
    """Copy a checkpoint's tensor into `dst`, a block of rows at a time. The pages of a mapped
    checkpoint file count in this process's resident memory while they stay mapped: each
    block's are dropped once copied, so restoring a shard never holds it twice."""
    if dst.ndim == 0 or dst.nbytes <= block_bytes:
        np.copyto(dst, src)
        return
    step = max(1, block_bytes // max(1, dst.nbytes // dst.shape[0]))
    mapped = _mapping(src)
    for lo in range(0, dst.shape[0], step):
        np.copyto(dst[lo : lo + step], src[lo : lo + step])
        if mapped is not None:
            _drop(mapped, src[lo : lo + step])


def _mapping(arr: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """The read-only file mapping under `arr`, and the address it starts at; None when there is none."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    obj = getattr(base, "obj", None)
    if not isinstance(obj, mmap.mmap) or not hasattr(obj, "madvise"):
        return None
    return obj, np.frombuffer(obj, np.uint8).ctypes.data


def _drop(mapped: tuple[mmap.mmap, int], arr: np.ndarray) -> None:
    """Let go of the pages of `arr` (C-contiguous, inside the mapping): whole pages only."""
    obj, start = mapped
    lo, hi = arr.ctypes.data - start, arr.ctypes.data - start + arr.nbytes
    lo += -lo % mmap.PAGESIZE
    hi -= hi % mmap.PAGESIZE
    if hi > lo:
        obj.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class RowSnapshot:
    """A table that updates change in place (rows of an embedding, or its optimizer slots),
    as it was when the snapshot was taken, read out block by block (`blocks()`, for
    wire.pieces) while training goes on: copy-on-write by rows. Before an update changes rows
    that the reader has not yet copied, the updater calls `before_update` and their old values
    are kept; the reader copies each block under the lock and puts the kept rows back in it.
    The extra memory is one block plus the rows updated during the read, never the table."""

    BLOCK_BYTES = 1 << 20

    def __init__(self, array: np.ndarray, lock):
        self.array, self.lock = array, lock
        self.dtype, self.shape, self.nbytes = array.dtype, array.shape, array.nbytes
        self.written = 0  # rows [0, written) are copied out: updates there need not keep anything
        self._kept: np.ndarray | None = None  # per row: its old value is in _saved
        self._saved: list[tuple[np.ndarray, np.ndarray, int]] = []  # (rows, their old values, max row)

    @property
    def done(self) -> bool:
        return self.written >= self.shape[0]

    def before_update(self, rows: np.ndarray) -> None:
        """`rows` (each once) of the array are about to change; the caller holds the lock."""
        rows = rows[rows >= self.written]
        if not rows.size:
            return
        if self._kept is None:
            self._kept = np.zeros(self.shape[0], bool)
        rows = rows[~self._kept[rows]]
        if rows.size:
            if not kernels.check_rows(rows, len(self._kept)):  # put_back takes them increasing
                rows = np.unique(rows)
            self._kept[rows] = True
            self._saved.append((rows, self.array[rows].reshape(len(rows), -1), int(rows[-1])))

    @property
    def _row_bytes(self) -> int:
        return self.nbytes // max(1, self.shape[0])

    @property
    def _block_rows(self) -> int:
        return max(1, self.BLOCK_BYTES // max(1, self._row_bytes))

    @property
    def block_bytes(self) -> int:
        """The largest block's size."""
        return min(self.shape[0], self._block_rows) * self._row_bytes

    def blocks(self, into=None):
        """The rows in order, a block at a time; with `into` (nbytes -> a writable uint8 array of
        that size), each block is copied there (a writer's staging buffer) instead of into a new array."""
        n, step = self.shape[0], self._block_rows
        try:
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                with self.lock:
                    src = self.array[lo:hi]
                    if into is None:
                        block = src.copy()
                    else:
                        block = into(src.nbytes).view(self.dtype).reshape(src.shape)
                        block[...] = src
                    self.written = hi
                    # entries wholly below `lo` were put back in earlier blocks
                    self._saved = saved = [e for e in self._saved if e[2] >= lo]
                kernels.put_back(block.reshape(hi - lo, -1), lo, saved)
                yield block
                del block, saved  # before the next block is copied
        finally:
            self.release()

    def release(self) -> None:
        """Stop keeping rows (the read is over, or will not happen)."""
        with self.lock:
            self.written = self.shape[0]
            self._kept, self._saved = None, []


class ShardCheckpoints:
    """One PS shard's checkpoints: written in the background as the shard steps on, or now
    (and waited for) when the job ends; read back when the PS starts again."""

    def __init__(
        self,
        root: str | Path,
        index: int,
        metrics,
        every: CheckpointSpec,
        last_step: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.root, self.folder, self.index, self.metrics = root, shard_dir(root, index), index, metrics
        self.every, self.last_step, self._clock = every, last_step, clock
        self._started = clock()  # of the previous checkpoint, or of the shard
        self.step = -1  # the newest written
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt")

    def due(self, version: int) -> bool:
        """Whether the shard at this version is to be checkpointed now; a True restarts the timer."""
        now = self._clock()
        by_steps = self.every.every_steps is not None and version % self.every.every_steps == 0
        if by_steps or version == self.last_step or now - self._started >= self.every.every_seconds:
            self._started = now
            return True
        return False

    def save(self, meta: dict, tensors: dict, wait: bool = False) -> None:
        written = self._pool.submit(self._write, meta, tensors)
        if wait:
            written.result()

    def _write(self, meta: dict, tensors: dict) -> None:
        try:
            write(self.folder, meta, tensors)
        except OSError:
            log.exception("checkpoint of PS %d at step %d failed", self.index, meta["version"])
            return
        finally:
            for tensor in tensors.values():
                if isinstance(tensor, RowSnapshot):
                    tensor.release()
        self.step = max(self.step, meta["version"])
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_step.set(self.step)
        log.info(
            json.dumps({"event": "checkpoint", "ps": self.index, "step": meta["version"], "path": str(self.folder)})
        )

    def load(self, parts: list, optimizer: str, num_ps: int | None, placement=None) -> wire.Message | None:
        """The newest checkpoint of these parts, None without one; an error when it is another
        model's. One written by another number of PS is re-sharded (runtime/reshard.py) when
        `placement(n)` gives the layout that n PS had (`gather`)."""
        written_by = saved_num_ps(self.root)
        if written_by is None:
            return None
        if num_ps is not None and written_by != num_ps and placement is not None:
            msg, event = gather(self.root, parts, placement(written_by)), "resharded"
        else:
            msg, event = read(self.folder), "restored"
            if msg is None:
                return None
        same_parts = event == "resharded" or msg.meta.get("parts") == {p.name: list(p.shape) for p in parts}
        if not same_parts or msg.meta.get("optimizer") != optimizer:
            raise RuntimeError(
                f"checkpoint in {self.folder} was written for another model, placement or optimizer; "
                "move it away or point spec.training.checkpoint.path elsewhere"
            )
        self.step = int(msg.meta["version"])
        self.metrics.restored.inc()
        self.metrics.checkpoint_step.set(self.step)
        log.info(
            json.dumps(
                {"event": event, "ps": self.index, "step": self.step, "path": str(self.folder), "from_ps": written_by}
            )
        )
        return msg

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# ---- restoring into another number of PS ----
def saved_num_ps(root: str | Path) -> int | None:
    """The PS count that wrote the checkpoint under `root` (None: no checkpoint there)."""
    first = read(shard_dir(root, 0))
    if first is not None and "num_ps" in first.meta:
        return int(first.meta["num_ps"])
    count = 0
    while (shard_dir(root, count) / FILE_NAME).exists():
        count += 1
    return count or None


def gather(root: str | Path, own: list[Part], old: Placement) -> wire.Message:
    """The checkpoint of the parts `own`, cut from the shards that the `old` placement wrote."""
    saved = {}
    for i in range(old.num_ps):
        msg = read(shard_dir(root, i))
        expected = {p.name: list(p.shape) for p in old.for_ps(i)}
        if msg is None or msg.meta.get("parts") != expected:
            raise RuntimeError(
                f"cannot re-shard the checkpoint in {root}: PS {i} of {old.num_ps} "
                f"{'has none' if msg is None else 'was written for another model or placement'}"
            )
        saved[i] = msg
    tensors = {}
    for part in own:
        sources = sorted(old.parts_of(part.var), key=lambda p: p.start)
        first = saved[sources[0].ps].tensors
        for suffix in [name[len(sources[0].name) :] for name in first if name.split(":")[0] == sources[0].name]:
            tensors[part.name + suffix] = _rows(part, sources, saved, suffix)
    metas = [m.meta for m in saved.values()]
    clocks = [m.get("clocks", []) for m in metas]
    meta = {
        "version": min(int(m["version"]) for m in metas),
        "examples": min(int(m.get("examples", 0)) for m in metas),
        "loss": metas[0].get("loss"),
        "clocks": [min(c) for c in zip(*clocks, strict=False)] if all(clocks) else [],
        "optimizer": metas[0].get("optimizer"),
    }
    return wire.Message(meta, tensors)


def _rows(part: Part, sources: list[Part], saved: dict[int, wire.Message], suffix: str) -> np.ndarray:
    if not part.shape:
        return saved[sources[0].ps].tensors[sources[0].name + suffix]
    pieces = []
    for src in sources:
        lo, hi = max(part.start, src.start), min(part.stop, src.stop)
        if lo < hi:
            pieces.append(saved[src.ps].tensors[src.name + suffix][lo - src.start : hi - src.start])
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
