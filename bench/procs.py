"""Running the benchmark's measurements as child processes on loopback."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tfps.runtime.ports import LOOPBACK, free_port  # noqa: F401 - the benchmarks take both from here

log = logging.getLogger("tfps.bench")


# TensorFlow's distributed runtime can segfault now and then, which says nothing about what
# an anchor measures: an anchor gets one more attempt. tfps's own processes never do: their
# crash is a failure of the benchmark.
ANCHOR_CRASH_RETRIES = 1

# Memory freed in GiBs slows a virtual machine for a while after (its pages are handed back to
# the host while the guest's own CPUs stay idle), so the measurement after one whose processes
# held that much (an embedding anchor's or tfps's PS) waits first rather than pay for it.
SETTLE_AFTER_RSS = 1 << 30  # bytes of a PS's peak RSS
SETTLE_SECONDS = 30.0


class MeasurementError(RuntimeError):
    """A measurement's process failed or printed no result."""

    def __init__(self, message: str, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed  # killed by a signal it did not get from us (a segfault, say)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints each thread's Python stack to stderr
    # grpc must never pick up a proxy: all traffic stays on 127.0.0.1.
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        env.pop(name, None)
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    env.update(extra or {})
    return env


def module_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def flag_args(flags: dict[str, object]) -> list[str]:
    """A child's command-line options from a table of `--flag: value`, in the table's order."""
    return [arg for flag, value in flags.items() for arg in (flag, str(value))]


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


def run_json(
    cmd: Sequence[str], timeout: float, what: str, env: dict[str, str] | None = None, crash_retries: int = 0
) -> dict:
    """Run `cmd`, wait at most `timeout` seconds, return the JSON object it printed last.

    An anchor (TensorFlow's own processes) that crashes is run again up to `crash_retries`
    times; the result then lists why each crashed attempt failed (`crashes`).
    """
    crashes: list[str] = []
    while True:
        try:
            result = _run_json_once(cmd, timeout, what, env)
        except MeasurementError as err:
            if not err.crashed or len(crashes) >= crash_retries:
                raise
            log.warning("%s crashed, measuring again: %s", what, err)
            crashes.append(str(err))
            continue
        if crashes:
            result["crashes"] = crashes
        return result


def _run_json_once(cmd: Sequence[str], timeout: float, what: str, env: dict[str, str] | None) -> dict:
    log.debug("running %s: %s", what, " ".join(cmd))
    # Its own session, so that on a timeout the whole tree it started (servers, workers)
    # goes with it.
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or child_env(),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as err:
        kill_group(proc)
        stderr = proc.communicate()[1] or ""  # what it said before it was stopped
        tail = stderr.strip().splitlines()[-3:]
        raise MeasurementError(
            f"{what}: no result within {timeout:.0f} s" + "".join(f" | {line}" for line in tail)
        ) from err
    kill_group(proc)  # leftovers of a child that exited without stopping its own children
    if proc.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-5:]
        raise MeasurementError(f"{what}: exit code {proc.returncode}: " + " | ".join(tail), crashed=proc.returncode < 0)
    try:
        return last_json_line(stdout)
    except MeasurementError as err:
        tail = stderr.strip().splitlines()[-3:]
        raise MeasurementError(f"{what}: {err}: " + " | ".join(tail)) from err


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that `proc` leads (started with start_new_session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def timed_window(step: Callable[[], None], warmup_seconds: float, seconds: float) -> tuple[int, float, float]:
    """A measuring child's loop: steps until warm (a few at least: tracing), READY on stdout,
    then, on GO from stdin, steps for `seconds`. Returns (steps, elapsed seconds, the CPU
    seconds this process used meanwhile, all its threads)."""
    warm_start, warm = time.perf_counter(), 0
    while warm < 3 or time.perf_counter() - warm_start < warmup_seconds:
        step()
        warm += 1
    print("READY", flush=True)
    sys.stdin.readline()  # GO
    steps, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    return steps, time.perf_counter() - start, time.process_time() - cpu


def run_together(cmds: list[list[str]], timeout: float) -> list[dict]:
    """Start children that use `timed_window`, say GO to all once all are READY (so their
    windows overlap), and return the JSON line each printed last."""
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), text=True) for cmd in cmds
    ]
    try:
        for proc in procs:
            if not any(line.strip() == "READY" for line in _until_ready(proc)):
                raise MeasurementError(f"a measuring process did not start (exit code {proc.wait()})")
        for proc in procs:
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        return [last_json_line(proc.communicate(timeout=timeout)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _until_ready(proc: subprocess.Popen):
    for line in proc.stdout:
        yield line
        if line.strip() == "READY":
            return


# CPU per worker step (core-ms) of tfps's runs and of the limits: every worker together, and
# every PS together (a limit's: its answering process's threads).
CPU_FIGURES = ("worker_cpu_ms_per_step", "ps_cpu_ms_per_step")


class Repeat:
    """One repeat of one shape: each system's examples/s and chosen figures (`system:figure`),
    and what failed."""

    def __init__(self, shape: str, progress: Callable[[str], None], labels: dict[str, str]):
        self.shape, self.progress, self.labels = shape, progress, labels
        self.row: dict[str, float | None] = {}
        self.errors: list[str] = []

    def attempt(self, system: str, fn: Callable[[], dict], figures: Sequence[str] = ()) -> dict | None:
        t0 = time.monotonic()
        label = self.labels.get(system, system)
        try:
            result = fn()
            self.row[system] = float(result["examples_per_second"])
        except (MeasurementError, KeyError, ValueError, TypeError) as err:
            self.row[system] = None
            self.errors.append(f"{self.shape} {system}: {err}")
            self.progress(f"{self.shape} {label}: FAILED: {err}")
            # how much memory its processes held is unknown: an anchor killed by the OOM killer held the most
            self._pause("its processes' peak is unknown")
            return None
        for name in figures:
            self.row[f"{system}:{name}"] = result.get(name)
        again = ""
        if crashed := len(result.get("crashes", ())):
            self.row[f"{system}:crashed_attempts"] = crashed
            again = f", measured again after {crashed} crashed attempt(s)"
        self.progress(
            f"{self.shape} {label}: {self.row[system]:,.0f} examples/s ({time.monotonic() - t0:.0f} s{again})"
        )
        self._settle(result)
        return result

    @staticmethod
    def in_turn(items: Sequence, repeat: int) -> Sequence:
        """`items` in order on even repeats and reversed on odd ones, so that no system always goes first."""
        return items if repeat % 2 == 0 else items[::-1]

    def bracket(self, system: str, fn: Callable[[], dict], figures: Sequence[str], inner: Callable[[], None]) -> None:
        """`system` measured right before `inner()` (the measurements compared with it) and right
        after; its examples/s is the mean of the two (each is kept: `system:before`, `system:after`),
        its figures the first one's. The speed of a virtual machine drifts by tens of percent within
        minutes: measured once ahead of them, a reference carries that drift into every ratio."""
        self.attempt(system, fn, figures)
        before = self.row[system]
        inner()
        self.attempt(system, fn)
        after = self.row[system]
        measured = [v for v in (before, after) if v is not None]
        self.row[system] = sum(measured) / len(measured) if measured else None
        self.row[f"{system}:before"], self.row[f"{system}:after"] = before, after

    def _settle(self, result: dict) -> None:
        peak = result.get("ps_peak_rss") or 0
        if peak >= SETTLE_AFTER_RSS:
            self._pause(f"its PS held {peak / 2**30:.1f} GiB")

    def _pause(self, why: str) -> None:
        self.progress(f"{self.shape}: a {SETTLE_SECONDS:.0f} s pause for the machine to settle ({why})")
        time.sleep(SETTLE_SECONDS)


def child_or_orchestrator(args, child: Callable, measure: Callable[..., dict]) -> int:
    """The entry point of a measurement whose module is also its own child processes: the
    references that stand for tfps's own processes (the limits, the ceiling), so they run
    under the same scheduling policy and malloc settings as a tfps process
    (runtime/process.py's `tune_process`): the children as a worker, the orchestrator (the
    limits' answering process) as a PS, in one arena. Each also takes what it made before its
    timed steps out of the garbage collector's sight, as tfps's processes do
    (`freeze_startup_objects`)."""
    from tfps.runtime.process import tune_process

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tune_process(one_arena=not args.child)
    if args.child:
        child(args)
    else:
        print(json.dumps(measure(args)), flush=True)
    return 0


def add_processes_argument(parser: argparse.ArgumentParser) -> None:
    """--processes, which size_tf_threads takes: the replicas of the job a measurement stands for."""
    parser.add_argument(
        "--processes",
        type=int,
        default=3,
        help=(
            "replicas of the tfps job it stands for (workers + PS): "
            "each worker sizes TensorFlow's pools as `tfps local` sizes a replica's"
        ),
    )


def size_tf_threads(processes: int) -> int:
    """Size this process's TensorFlow thread pools as `tfps local` sizes each of a job's
    `processes` replicas on this machine (so an anchor's workers compute as tfps's do), and
    return the count."""
    import tensorflow as tf

    from tfps.runtime.local import process_threads

    threads = process_threads(processes)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return threads
