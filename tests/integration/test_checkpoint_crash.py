"""Nothing lost: a PS process that dies in the middle of writing a checkpoint (after its
temporary file is complete, before the rename: a test hook ends the process there at once, exit 137 as a SIGKILL) leaves
the previous checkpoint whole, and the next writer succeeds.

Real processes and a real file system; the crash point is made deterministic by the hook
(`TFPS_TEST_CHECKPOINT_CRASH_AT`), not simulated. The same crash inside a running job on the
cluster is tests/e2e/test_faults.py::test_crash_in_the_middle_of_a_checkpoint_restores_the_previous_one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tfps.api.naming import ENV_CRASH_AT
from tfps.runtime import checkpoint, wire

pytestmark = pytest.mark.integration

WRITER = """
import sys
import numpy as np
from tfps.runtime import checkpoint
for version in map(int, sys.argv[2:]):
    checkpoint.write(sys.argv[1], {"version": version}, {"w": np.full((512, 512), version, np.float32)})
print("wrote", sys.argv[2:])
"""


def _write(folder, *versions: int, crash_at: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV_CRASH_AT}
    if crash_at is not None:
        env[ENV_CRASH_AT] = str(crash_at)
    return subprocess.run(
        [sys.executable, "-c", WRITER, str(folder), *map(str, versions)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_crash_mid_checkpoint_keeps_the_previous_one(tmp_path):
    folder = tmp_path / "ps-0"
    crashed = _write(folder, 1, 2, crash_at=2)
    assert crashed.returncode == 128 + signal.SIGKILL, crashed.stderr

    # the reader sees the previous checkpoint, whole
    msg = checkpoint.read(folder)
    assert msg.meta == {"version": 1}
    np.testing.assert_array_equal(msg.tensors["w"], np.full((512, 512), 1, np.float32))
    # the crash came after the new temporary file was complete, and it stays behind unread
    (tmp,) = folder.glob(".shard-*.tmp")
    assert wire.decode(tmp.read_bytes()).meta == {"version": 2}

    # the next process (the restarted PS) writes over it as usual; the hook fires only once
    again = _write(folder, 2, 3, crash_at=2)
    assert again.returncode == 0, again.stderr
    msg = checkpoint.read(folder)
    assert msg.meta == {"version": 3}
    np.testing.assert_array_equal(msg.tensors["w"], np.full((512, 512), 3, np.float32))


def test_no_checkpoint_yet_reads_as_none(tmp_path):
    crashed = _write(tmp_path / "ps-0", 1, crash_at=1)
    assert crashed.returncode == 128 + signal.SIGKILL
    assert checkpoint.read(tmp_path / "ps-0") is None
