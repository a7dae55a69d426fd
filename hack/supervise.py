#!/usr/bin/env python3
"""Run one cluster component and start it again when it exits, as systemd's `Restart=always` (or the
kubelet, for a static pod) does on a real machine. The kubelet counts on it: it exits on purpose when
a start-up step fails ("rely on the babysitter to retry starting kubelet"), e.g. when cAdvisor has
no figures yet for the root filesystem right after a restart.

Usage: supervise.py NAME -- ARGV...

SIGTERM or SIGINT is passed on to the component, and the supervisor ends when the component does.
A component that exits more than START_LIMIT times within START_WINDOW seconds is given up on: the
supervisor ends, so `hack/cluster.sh status`/`up` see it stopped. Lines about restarts go to stdout,
the component's log. Standard library only.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

RESTART_DELAY = 1.0  # systemd's RestartSec
START_LIMIT, START_WINDOW = 5, 60.0  # systemd's StartLimitBurst, StartLimitIntervalSec


def say(name: str, message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"==== {stamp} supervise {name}: {message}", flush=True)


def exit_text(rc: int) -> str:
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    name, cmd = argv[0], argv[2:]
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    starts: list[float] = []
    while True:
        starts = [t for t in starts if time.monotonic() - t < START_WINDOW] + [time.monotonic()]
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        if stopping:  # a signal between the check below and this start
            child.send_signal(signal.SIGTERM)
        rc = child.wait()
        if stopping:
            return 0
        if len(starts) > START_LIMIT:
            say(name, f"{exit_text(rc)}; {len(starts)} starts within {START_WINDOW:.0f}s: giving up")
            return 1
        say(name, f"{exit_text(rc)}; starting it again in {RESTART_DELAY:.0f}s")
        time.sleep(RESTART_DELAY)
        if stopping:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
