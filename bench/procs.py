"""Running the benchmark's measurements as child processes on loopback."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from tfps.runtime.ports import LOOPBACK, free_port  # noqa: F401 - the benchmarks take both from here

log = logging.getLogger("tfps.bench")


class MeasurementError(RuntimeError):
    """A measurement's process failed or printed no result."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    # grpc must never pick up a proxy: all traffic stays on 127.0.0.1.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        env.pop(name, None)
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    env.update(extra or {})
    return env


def module_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def last_json_line(text: str) -> dict:
    """The last line of `text` that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise MeasurementError("no JSON result in the output")


def run_json(cmd: Sequence[str], timeout: float, what: str, env: dict[str, str] | None = None) -> dict:
    """Run `cmd`, wait at most `timeout` seconds, return the JSON object it printed last."""
    log.debug("running %s: %s", what, " ".join(cmd))
    # Its own session, so that on a timeout the whole tree it started (servers, workers)
    # goes with it.
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env(), start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as err:
        kill_group(proc)
        raise MeasurementError(f"{what}: no result within {timeout:.0f} s") from err
    kill_group(proc)  # leftovers of a child that exited without stopping its own children
    if proc.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-5:]
        raise MeasurementError(f"{what}: exit code {proc.returncode}: " + " | ".join(tail))
    try:
        return last_json_line(stdout)
    except MeasurementError as err:
        tail = stderr.strip().splitlines()[-3:]
        raise MeasurementError(f"{what}: {err}: " + " | ".join(tail)) from err


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that `proc` leads (started with start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
