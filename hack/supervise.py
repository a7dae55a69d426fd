#!/usr/bin/env python3
"""Run one cluster component and start it again when it exits, as systemd's `Restart=always` (or the
kubelet, for a static pod) does on a real machine. The kubelet counts on it: it exits on purpose when
a start-up step fails ("rely on the babysitter to retry starting kubelet"), e.g. when cAdvisor has
no figures yet for the root filesystem right after a restart.

Usage: supervise.py NAME [--first-delay SECONDS] -- ARGV...

SIGTERM or SIGINT is passed on to the component, and the supervisor ends when the component does.
The delay before a new start doubles with each start in the last START_WINDOW seconds (1, 2, 4, 8,
then 10 s), and a component that exits more than START_LIMIT times within them is given up on: the
supervisor ends, so `hack/cluster.sh status`/`up` see it stopped. Lines about restarts go to stdout,
the component's log. Standard library only.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

FIRST_DELAY, MAX_DELAY = 1.0, 10.0  # kubeadm's kubelet unit waits 10 s (RestartSec) every time
START_LIMIT, START_WINDOW = 5, 120.0  # systemd's StartLimitBurst, StartLimitIntervalSec


def say(name: str, message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"==== {stamp} supervise {name}: {message}", flush=True)


def exit_text(rc: int) -> str:
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="supervise.py",
        usage="%(prog)s NAME [--first-delay SECONDS] -- ARGV...",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("name")
    ap.add_argument("--first-delay", type=float, default=FIRST_DELAY, help="seconds before the first new start")
    split = argv.index("--") if "--" in argv else len(argv)
    args, cmd = ap.parse_args(argv[:split]), argv[split + 1 :]
    if not cmd:
        ap.error("no command given after --")
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
            say(args.name, f"{exit_text(rc)}; {len(starts)} starts within {START_WINDOW:.0f}s: giving up")
            return 1
        delay = min(MAX_DELAY, args.first_delay * 2 ** (len(starts) - 1))
        say(args.name, f"{exit_text(rc)}; starting it again in {delay:g}s")
        time.sleep(delay)
        if stopping:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
