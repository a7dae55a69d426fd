"""Atomic per-shard checkpoints: `<path>/ps-<i>/shard.tfps`, in the wire format.

Written to a temporary file in the same folder, fsynced, renamed over the old one and the
folder fsynced: a reader sees the previous checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import numpy as np

from tfps.api.settings import ProcessSettings

from . import wire

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
    os.kill(os.getpid(), signal.SIGKILL)


def read(folder: str | Path) -> wire.Message | None:
    """The last complete checkpoint in `folder`, or None when there is none."""
    target = Path(folder) / FILE_NAME
    if not target.exists():
        return None
    return wire.decode(target.read_bytes())
