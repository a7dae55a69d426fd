"""Atomic per-shard checkpoints: `<path>/ps-<i>/shard.tfps`, in the wire format.

Written to a temporary file in the same folder, fsynced, renamed over the old one and the
folder fsynced: a reader sees the previous checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
from concurrent import futures
from pathlib import Path

import numpy as np

from tfps.api.settings import ProcessSettings

from . import wire

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
        with os.fdopen(fd, "wb") as fh:
            for chunk in wire.encode_chunks(meta, tensors, chunk=16 << 20):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
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


def _crash_hook(folder: Path, meta: dict) -> None:
    at = ProcessSettings().crash_at
    if at is None or str(meta.get("version")) != str(at) or (folder / CRASH_MARKER).exists():
        return
    (folder / CRASH_MARKER).write_text(str(at))
    # Die at once, as SIGKILL would; but a container's main process is PID 1 of its namespace,
    # which ignores a SIGKILL sent from inside it, so exit without any clean-up instead.
    os._exit(128 + signal.SIGKILL)


def read(folder: str | Path) -> wire.Message | None:
    """The last complete checkpoint in `folder`, or None when there is none."""
    target = Path(folder) / FILE_NAME
    if not target.exists():
        return None
    return wire.decode(target.read_bytes())


class ShardCheckpoints:
    """One PS shard's checkpoints: written in the background as the shard steps on, or now
    (and waited for) when the job ends; read back when the PS starts again."""

    def __init__(self, root: str | Path, index: int, metrics, every_steps: int, last_step: int):
        self.folder, self.index, self.metrics = shard_dir(root, index), index, metrics
        self.every_steps, self.last_step = every_steps, last_step
        self.step = -1  # the newest written
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt")

    def due(self, version: int) -> bool:
        return version % self.every_steps == 0 or version == self.last_step

    def save(self, meta: dict, tensors: dict, wait: bool = False) -> None:
        written = self._pool.submit(self._write, meta, tensors)
        if wait:
            written.result()

    def _write(self, meta: dict, tensors: dict) -> None:
        try:
            write(self.folder, meta, {k: np.asarray(v) for k, v in tensors.items()})
        except OSError:
            log.exception("checkpoint of PS %d at step %d failed", self.index, meta["version"])
            return
        self.step = max(self.step, meta["version"])
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_step.set(self.step)
        log.info(json.dumps({"event": "checkpoint", "ps": self.index, "step": meta["version"], "path": str(self.folder)}))

    def load(self, parts: dict[str, list[int]], optimizer: str) -> wire.Message | None:
        """The newest checkpoint, None without one; an error when it is another model's."""
        msg = read(self.folder)
        if msg is None:
            return None
        if msg.meta.get("parts") != parts or msg.meta.get("optimizer") != optimizer:
            raise RuntimeError(
                f"checkpoint in {self.folder} was written for another model, placement or optimizer; "
                "move it away or point spec.training.checkpoint.path elsewhere"
            )
        self.step = int(msg.meta["version"])
        self.metrics.restored.inc()
        self.metrics.checkpoint_step.set(self.step)
        log.info(json.dumps({"event": "restored", "ps": self.index, "step": self.step, "path": str(self.folder)}))
        return msg

    def close(self) -> None:
        self._pool.shutdown(wait=True)
