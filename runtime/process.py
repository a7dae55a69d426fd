"""What a PS or worker process reads from its environment, and its structured logging.

In a pod everything comes from the environment the operator sets (TF_CONFIG,
TFPS_JOB_NAME, TFPS_NAMESPACE, TFPS_TRAINING, TFPS_BIND_ADDRESS, TFPS_METRICS_PORT); `tfps
local` sets the same variables for its processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfps.api.naming import ENV_TRAINING, GRPC_PORT
from tfps.api.settings import ProcessSettings
from tfps.api.spec import TrainingSpec
from tfps.api.tfconfig import ClusterConfig

from .malloc import keep_large_buffers

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"  # cgroup v1: cpu.cfs_quota_us and cpu.cfs_period_us
TERMINATION_MESSAGE_LIMIT = 4000  # the kubelet keeps at most 4096 bytes of it


@dataclass(frozen=True)
class ProcessConfig:
    cluster: ClusterConfig
    training: TrainingSpec
    job: str
    namespace: str
    bind_address: str
    metrics_port: int
    data_port: int | None = 0  # None: no data path
    settings: ProcessSettings | None = None  # the rest of the environment

    @property
    def own_port(self) -> int:
        """The port of this task's own address in TF_CONFIG (GRPC_PORT when it has none)."""
        addresses = self.cluster.cluster.get(self.cluster.task_type, [])
        if self.cluster.task_index < len(addresses):
            host_port = addresses[self.cluster.task_index]
            if ":" in host_port:
                return int(host_port.rsplit(":", 1)[1])
        return GRPC_PORT

    def listen_address(self, port: int) -> str:
        host = self.bind_address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ProcessConfig:
        settings = ProcessSettings.from_env(env)
        if settings.training is None:
            raise ValueError(f"{ENV_TRAINING} is not set: the built-in runtime needs spec.training")
        return cls(
            cluster=ClusterConfig.from_env(os.environ if env is None else env),
            training=settings.training,
            job=settings.job_name,
            namespace=settings.namespace,
            bind_address=settings.bind_address,
            metrics_port=settings.metrics_port,
            data_port=settings.data_port_number,
            settings=settings,
        )


class JsonFormatter(logging.Formatter):
    """One JSON object per line, naming the job and the replica; JSON messages are merged in."""

    def __init__(self, job: str, replica: str):
        super().__init__()
        self.fixed = {"job": job, "replica": replica}

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            **self.fixed,
        }
        try:
            parsed = json.loads(msg)
        except ValueError:
            parsed = None
        entry.update(parsed if isinstance(parsed, dict) else {"msg": msg})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """A live process's CPU time so far, user and system, all its threads; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: proc(5)'s fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes(pid: int) -> int | None:
    """A live process's peak resident memory (Linux's VmHWM), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def setup_logging(job: str, replica: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(job, replica))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def cgroup_cpus(cpu_max: str = CGROUP_CPU_MAX, v1_dir: str = CGROUP_V1_CPU) -> int | None:
    """The CPUs this process may use by its cgroup's quota (a pod's CPU limit), rounded up;
    None without a quota. Reads cgroup v2's cpu.max, else cgroup v1's CFS quota and period."""
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = Path(v1_dir, "cpu.cfs_quota_us").read_text().strip()
            period = Path(v1_dir, "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        return None if quota in ("max", "-1") else max(1, math.ceil(int(quota) / int(period)))
    except ValueError:
        return None


def configure_threads(tensorflow: bool = True) -> int | None:
    """The CPUs this process has: $TFPS_INTRA_OP_THREADS (tfps local sets it when it runs
    several processes on one machine), else the pod's CPU limit; logged, and with `tensorflow`
    TensorFlow's thread pools sized to it. TensorFlow would otherwise size them to every core
    of the node, and processes sharing cores then spin against each other."""
    threads = ProcessSettings.from_env().intra_op_threads
    count = threads or cgroup_cpus()
    if count and tensorflow:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(count)
        tf.config.threading.set_inter_op_parallelism_threads(count)
    logging.getLogger("tfps.process").info(
        json.dumps(
            {
                "event": "threads",
                "threads": count,
                "source": "env" if threads else ("cgroup" if count else "default"),
                "tensorflow": tensorflow,
            }
        )
    )
    return count


def use_batch_scheduling() -> str:
    """Put this thread, and every thread and process it starts from now on, under Linux's
    SCHED_BATCH policy (sched(7)), unless $TFPS_SCHED_BATCH is "0"; "batch", or "default" when
    it left the policy as it was.

    Training is batch work. Under the default policy a thread that wakes up takes the core from
    one mid-computation: where a job's PS and workers share cores, a PS's thread wakes for each
    request and preempts a worker's step many times a second. A SCHED_BATCH thread waits for the
    next scheduling point instead, at the same priority, so a job on shared cores trains faster;
    no privilege is needed to take it. Where each process has cores of its own there is nothing
    to preempt."""
    if not ProcessSettings.from_env().sched_batch or not hasattr(os, "SCHED_BATCH"):
        return "default"
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a seccomp profile may refuse it: the default policy works too
        return "default"
    return "batch"


def tune_process(one_arena: bool = False) -> str:
    """The scheduling and malloc settings of a training process, set before any thread starts
    (each inherits them): SCHED_BATCH (`use_batch_scheduling`, whose answer it returns) and large
    buffers kept in the heap, in one arena with `one_arena` (runtime/malloc.py). tfps's PS and
    workers take them, and so do the benchmark's references that stand for them."""
    policy = use_batch_scheduling()
    keep_large_buffers(one_arena)
    return policy


def freeze_startup_objects() -> None:
    """Take everything alive now (imports, the model, TensorFlow's many objects) out of the
    garbage collector's sight: it lives as long as the process, and each full collection
    would scan it again, a stall of the step it lands in."""
    gc.freeze()


def add_pod_arguments(parser: argparse.ArgumentParser, bind_help: str) -> None:
    """The flags `tfps ps` and `tfps worker` share; everything else comes from the pod's env."""
    parser.add_argument("--bind", help=bind_help)
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (default: $TFPS_METRICS_PORT or 9090)")


def start_pod_process(
    command: str, security_from_env: Callable[[bool], Any], tensorflow: bool = True, one_arena: bool = False
) -> tuple[ProcessConfig, Any] | None:
    """The pod's config and its security (`security_from_env(tls)`), with logging set up to name
    the job and replica, its scheduling and malloc settings (`tune_process`) and its CPUs logged
    (with `tensorflow`, TensorFlow's threads sized to them); None, with the reason logged or on
    stderr, when the environment holds no usable config (the caller exits 2). Security comes
    first: a process that cannot check who it talks to must not start at all."""
    from .auth import SecurityError

    try:
        cfg = ProcessConfig.from_env()
    except ValueError as err:
        print(f"tfps {command}: {err}", file=sys.stderr)
        return None
    setup_logging(cfg.job, f"{command}-{cfg.cluster.task_index}")
    policy = tune_process(one_arena)
    try:
        security = security_from_env(cfg.training.tls)
    except SecurityError as err:
        logging.getLogger(f"tfps.{command}").error(
            json.dumps({"event": "failed", command: cfg.cluster.task_index, "detail": str(err)})
        )
        return None
    logging.getLogger("tfps.process").info(json.dumps({"event": "scheduling", "policy": policy}))
    configure_threads(tensorflow)
    return cfg, security


def write_termination_log(text: str, path: str) -> None:
    """In a pod, the kubelet copies this file into the container's terminated state, where the
    operator reads it after the container exits (a result, or why it failed)."""
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return  # not in a pod (`tfps local`): the log and the result file are the channels
    try:
        with open(path, "w") as fh:
            fh.write(text[:TERMINATION_MESSAGE_LIMIT])
    except OSError as err:
        logging.getLogger("tfps.process").warning(
            json.dumps({"event": "termination-message-unwritten", "error": str(err)})
        )


def user_code_failed(cfg: ProcessConfig, command: str, err: Exception) -> int:
    """Log why the user's model could not be loaded, leave it as the termination message, and
    give the exit code that tells the operator not to restart the pod."""
    from tfps.api.semantics import USER_CODE_EXIT_CODE

    logging.getLogger(f"tfps.{command}").error(
        json.dumps({"event": "model-load-failed", command: cfg.cluster.task_index, "error": str(err)})
    )
    write_termination_log(str(err), cfg.settings.termination_log if cfg.settings else "/dev/termination-log")
    return USER_CODE_EXIT_CODE
