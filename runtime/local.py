"""`tfps local FILE`: run a TrainingJob manifest as local processes, no cluster.

Every replica the operator would create (PS, Chief, Worker, Evaluator) runs as a process on
loopback (127.0.0.1, free ports) with the environment the operator gives pods: `tfps ps` /
`tfps worker` with spec.training, else the command of the pod template's `tensorflow`
container (a custom TF program reading TF_CONFIG). Which exits are restarted, within
runPolicy.backoffLimit, and when the job has succeeded (the Chief when there is one, else
successPolicy) are tfps.api.semantics' rules, the operator's. Checkpoints go to
spec.training.checkpoint.path, or to the run's work folder.

Python API (for tests and `tfps bench`): `LocalRun(job).run()` returns the result dict;
`run_job(job)` does the same in one call. `on_status(run, status)` is called on every
poll with PS 0's status and may inject faults with `run.kill("ps", 0)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tfps.api import semantics
from tfps.api.naming import (
    CONTAINER_NAME,
    ENV_AUTH_TOKEN_FILE,
    ENV_BIND_ADDRESS,
    ENV_INTRA_OP_THREADS,
    ENV_JOB_NAME,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_RESULT_FILE,
    ENV_TF_CONFIG,
    ENV_TRAINING,
)
from tfps.api.spec import ReplicaType, TrainingJob, load_manifest
from tfps.api.tfconfig import tf_config

from . import auth, pki
from .ports import LOOPBACK, free_port
from .process import cpu_seconds, peak_rss_bytes

POLL_SECONDS = 0.25


def process_threads(processes: int) -> int:
    """TensorFlow threads (per pool) of each of `processes` sharing this machine: like
    torchrun's OMP_NUM_THREADS, they split its cores."""
    return max(1, (os.cpu_count() or 1) // processes)


@dataclass(frozen=True)
class CpuSample:
    examples: int  # trained so far (PS 0's count)
    steady: bool  # PS 0's examples/s is being measured: its warm-up is over
    cpu: dict[str, float]  # replica type -> its processes' CPU seconds so far


def cpu_per_step(samples: list[CpuSample], batch: int) -> dict[str, float] | None:
    """Each replica type's CPU per worker step (core-ms, all its replicas together) over the
    steady state, the window of the job's examples/s: from the first sample past the warm-up
    to the last one. None without two such samples."""
    steady = [s for s in samples if s.steady]
    if len(steady) < 2 or batch <= 0:
        return None
    first, last = steady[0], steady[-1]
    steps = (last.examples - first.examples) / batch
    if steps <= 0:
        return None
    return {kind: 1000.0 * (last.cpu[kind] - first.cpu[kind]) / steps for kind in last.cpu}


@dataclass
class Replica:
    rtype: ReplicaType
    index: int
    port: int
    metrics_port: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exit_code: int | None = None  # final, once it will not be restarted
    log_path: Path | None = None
    peak_rss: int | None = None  # bytes, sampled on every poll while it runs

    @property
    def name(self) -> str:
        return f"{self.rtype.task_type}-{self.index}"


@dataclass
class Fault:
    """Kill `replica` (e.g. "ps-0") with `sig` once PS 0's global step reaches `step`."""

    replica: str
    step: int
    sig: int = signal.SIGKILL
    fired: bool = False

    @classmethod
    def parse(cls, text: str) -> Fault:
        replica, _, step = text.partition("@")
        if not step or "-" not in replica:
            raise ValueError(f"--kill {text!r}: use REPLICA@STEP, e.g. ps-0@300")
        return cls(replica, int(step))


@dataclass
class LocalRun:
    job: TrainingJob
    workdir: Path | None = None
    on_status: Callable[[LocalRun, dict], None] | None = None
    faults: list[Fault] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every process
    keep_workdir: bool = False

    def __post_init__(self):
        spec = self.job.spec
        if spec.training is None:
            missing = [t.value for t, _ in semantics.replicas(spec) if not self._user_command(t)]
            if missing:
                raise ValueError(
                    f"spec.replicaSpecs.{missing[0]}: without spec.training, tfps local runs the command of "
                    f"the template's {CONTAINER_NAME!r} container, and it has none"
                )
        self._own_workdir = self.workdir is None
        self.workdir = Path(self.workdir or tempfile.mkdtemp(prefix=f"tfps-{self.job.name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        training = spec.training.model_copy(deep=True) if spec.training else None
        if training is not None and training.checkpoint.path is None:
            training.checkpoint.path = str(self.workdir / "checkpoints")
        self.training = training
        # A token per run (and, with spec.training.tls, a CA and a cert for loopback), as the
        # operator's per-job Secret gives pods.
        self.token_file = auth.write_material(self.workdir / "auth", pki.new_token(), self._tls_material())
        self.replicas: dict[tuple[str, int], Replica] = {
            (rtype.task_type, i): Replica(rtype, i, free_port(), free_port()) for rtype, i in semantics.replicas(spec)
        }
        reporter_type, reporter_index = semantics.reporting_replica(spec)
        self.reporter = (reporter_type.task_type, reporter_index)
        self.result_file = self.workdir / f"result-{reporter_type.task_type}-{reporter_index}.json"
        self.status: dict = {}
        self.restarts = 0
        self.events: list[str] = []
        self._clients: dict = {}
        self.wire_bytes: int | None = None
        self.cpu_samples: list[CpuSample] = []

    def _tls_material(self):
        if self.training is None or not self.training.tls:
            return None
        from .pki import issue

        return issue(f"{self.job.name}.local", ["localhost"], [LOOPBACK])

    # ---- processes ----
    def _address(self, rtype: ReplicaType, index: int) -> str:
        replica = self.replicas.get((rtype.task_type, index))
        return f"{LOOPBACK}:{replica.port if replica else free_port()}"

    def _user_container(self, rtype: ReplicaType) -> dict:
        template = self.job.spec.replica_specs[rtype].template or {}
        containers = (template.get("spec") or {}).get("containers") or []
        return next((c for c in containers if c.get("name") == CONTAINER_NAME), {})

    def _user_command(self, rtype: ReplicaType) -> list[str]:
        container = self._user_container(rtype)
        return [*(container.get("command") or []), *(container.get("args") or [])] if container.get("command") else []

    def _command(self, replica: Replica) -> list[str]:
        """What the operator's pod would run: the user's command when the template names one,
        else the built-in runtime's `tfps` arguments."""
        args = semantics.built_in_args(self.job.spec, replica.rtype)
        user = self._user_command(replica.rtype)
        if user or args is None:
            return user
        return [sys.executable, "-m", "tfps.cli.main", *args]

    def _environment(self, replica: Replica) -> dict[str, str]:
        cfg = tf_config(
            self.job.name, self.job.namespace, self.job.spec, replica.rtype, replica.index, address=self._address
        )
        # The template's plain env values, under the ones the operator owns (as in its pods).
        user_env = {
            e["name"]: str(e["value"])
            for e in self._user_container(replica.rtype).get("env") or []
            if "name" in e and "value" in e
        }
        env = {
            **os.environ,
            **user_env,
            ENV_TF_CONFIG: json.dumps(cfg),
            ENV_JOB_NAME: self.job.name,
            ENV_NAMESPACE: self.job.namespace,
            ENV_BIND_ADDRESS: LOOPBACK,
            ENV_METRICS_PORT: str(replica.metrics_port),
            ENV_AUTH_TOKEN_FILE: str(self.token_file),
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "PYTHONUNBUFFERED": "1",
            ENV_INTRA_OP_THREADS: os.environ.get(ENV_INTRA_OP_THREADS, str(process_threads(len(self.replicas)))),
            **self.env,
        }
        if self.training is not None:
            env[ENV_TRAINING] = json.dumps(self.training.to_manifest())
        if (replica.rtype.task_type, replica.index) == self.reporter:
            env[ENV_RESULT_FILE] = str(self.result_file)
        return env

    def _start(self, replica: Replica) -> None:
        replica.log_path = self.workdir / f"{replica.name}.log"
        # The child holds its own copy of the descriptor: ours closes once it has started (or failed to).
        with open(replica.log_path, "ab") as log:
            replica.proc = subprocess.Popen(
                self._command(replica),
                env=self._environment(replica),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def pid(self, rtype: str, index: int) -> int | None:
        proc = self.replicas[(rtype, index)].proc
        return proc.pid if proc and proc.poll() is None else None

    def kill(self, rtype: str, index: int, sig: int = signal.SIGKILL) -> bool:
        pid = self.pid(rtype, index)
        if pid is None:
            return False
        os.kill(pid, sig)
        self.events.append(f"sent signal {sig} to {rtype}-{index} (pid {pid}) at step {self.status.get('global_step')}")
        return True

    def _should_restart(self, replica: Replica, code: int) -> bool:
        policy = self.job.spec.replica_specs[replica.rtype].restart_policy
        return semantics.restarts_after_exit(replica.rtype, policy, code)

    # ---- progress ----
    def _ps(self, index: int = 0):
        if index not in self._clients:
            if self.training is None or not self.job.spec.replicas(ReplicaType.PS):
                raise LookupError("no built-in PS to ask")
            from .client import ShardClient

            security = auth.ClientSecurity.from_env(self.training.tls, {ENV_AUTH_TOKEN_FILE: str(self.token_file)})
            self._clients[index] = ShardClient(
                self._address(ReplicaType.PS, index), index, retry_seconds=0, security=security
            )
        return self._clients[index]

    def poll_status(self) -> dict:
        with contextlib.suppress(Exception):  # PS 0 not up yet or restarting: keep the last status
            self.status = self._ps().status(timeout=1.0)
        return self.status

    def _wire_bytes(self) -> int | None:
        """Bytes of Step and PullFull messages through every PS, either way."""
        try:
            return sum(
                self._ps(k).status(timeout=5.0)["wire_bytes"] for k in range(self.job.spec.replicas(ReplicaType.PS))
            )
        except Exception:
            return None

    def _sample_memory(self) -> None:
        for replica in self.replicas.values():
            if replica.proc is not None and replica.proc.poll() is None:
                rss = peak_rss_bytes(replica.proc.pid)
                if rss is not None:
                    replica.peak_rss = max(rss, replica.peak_rss or 0)

    def _sample_cpu(self, status: dict) -> None:
        """Each replica type's CPU seconds so far, with the examples trained, past the warm-up and
        while every replica runs in its first process (a restarted one starts its count again).
        Only the window's first sample and the latest are kept: `cpu_per_step` reads no other."""
        if self.restarts or not status.get("examples") or not status.get("examples_per_second"):
            return
        cpu: dict[str, float] = {}
        for replica in self.replicas.values():
            seconds = (
                cpu_seconds(replica.proc.pid) if replica.proc is not None and replica.proc.poll() is None else None
            )
            if seconds is None:
                return
            cpu[replica.rtype.task_type] = cpu.get(replica.rtype.task_type, 0.0) + seconds
        self.cpu_samples[1:] = [CpuSample(int(status["examples"]), True, cpu)]

    def succeeded(self) -> str | None:
        """Why the job has succeeded (tfps.api.semantics.success), or None while it has not."""
        completed = {(r.rtype, r.index) for r in self.replicas.values() if r.exit_code == 0}
        return semantics.success(self.job.spec, completed)

    def on_exit(self, replica: Replica, code: int) -> tuple[bool, str | None]:
        """Decide about a replica that exited: (restart it?, the job's failure reason or None)."""
        backoff = self.job.spec.run_policy.backoff_limit
        step = self.status.get("global_step")
        self.events.append(f"{replica.name} exited with code {code} at step {step} ({time.strftime('%H:%M:%S')})")
        if not self._should_restart(replica, code):
            replica.exit_code = code
            if code != 0:
                policy = self.job.spec.replica_specs[replica.rtype].restart_policy.value
                return False, f"{replica.name} exited with code {code} (restartPolicy {policy})"
            return False, None
        if self.restarts >= backoff:
            replica.exit_code = code
            return False, f"{replica.name} exited with code {code}; backoffLimit {backoff} reached"
        self.restarts += 1
        replica.restarts += 1
        self.events.append(f"restarting {replica.name} (exit code {code}, restart {self.restarts}/{backoff})")
        return True, None

    def _check_processes(self) -> str | None:
        """Reap exited processes, restart per policy; returns a failure reason or None."""
        for replica in self.replicas.values():
            if replica.proc is None or replica.exit_code is not None:
                continue
            code = replica.proc.poll()
            if code is None:
                continue
            restart, failure = self.on_exit(replica, code)
            if failure:
                return failure
            if restart:
                self._start(replica)
        return None

    def _fire_faults(self) -> None:
        step = self.status.get("global_step", 0)
        for fault in self.faults:
            if not fault.fired and step >= fault.step:
                rtype, _, index = fault.replica.rpartition("-")
                fault.fired = self.kill(rtype, int(index), fault.sig)

    def run(self, progress: Callable[[dict], None] | None = None) -> dict:
        started = time.monotonic()
        deadline = self.job.spec.run_policy.active_deadline_seconds
        for replica in self.replicas.values():
            self._start(replica)
        failure = None
        try:
            while True:
                time.sleep(POLL_SECONDS)
                status = self.poll_status()
                self._sample_memory()
                self._sample_cpu(status)
                if progress:
                    progress(status)
                if self.on_status:
                    self.on_status(self, status)
                self._fire_faults()
                failure = self._check_processes()
                if failure or self.succeeded():
                    break
                if deadline and time.monotonic() - started > deadline:
                    failure = f"activeDeadlineSeconds {deadline} exceeded"
                    break
            if not failure:
                self._wait_workers(timeout=30)
                self.poll_status()
                self.wire_bytes = self._wire_bytes()
        finally:
            self._stop_all()
        return self._result(failure, time.monotonic() - started)

    def _wait_workers(self, timeout: float) -> None:
        """Give the other trainers a moment to finish on their own before the PS are stopped."""
        end = time.monotonic() + timeout
        for replica in self.replicas.values():
            if replica.rtype in (ReplicaType.WORKER, ReplicaType.CHIEF) and replica.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    replica.proc.wait(timeout=max(0.1, end - time.monotonic()))

    def _stop_all(self) -> None:
        procs = [r.proc for r in self.replicas.values() if r.proc is not None and r.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for client in self._clients.values():
            client.close()

    def _result(self, failure: str | None, wall: float) -> dict:
        worker0 = {}
        if self.result_file.exists():
            worker0 = json.loads(self.result_file.read_text())
        status = self.status
        result = {
            "job": self.job.name,
            "phase": "Failed" if failure else "Succeeded",
            "succeeded": failure is None,
            "reason": failure,
            "model": self.training.model if self.training else None,
            "mode": self.training.consistency.mode.value if self.training else None,
            "steps": status.get("global_step", worker0.get("steps")),
            "loss": status.get("loss", worker0.get("loss")),
            "accuracy": worker0.get("accuracy"),
            "auc": worker0.get("auc"),
            "examples_per_second": status.get("examples_per_second"),
            "examples": status.get("examples"),
            "wall_seconds": round(wall, 3),
            "wire_bytes": self.wire_bytes,
            "peak_rss_bytes": {r.name: r.peak_rss for r in self.replicas.values()},
            "step_seconds": worker0.get("step_seconds"),
            "cpu_ms_per_step": cpu_per_step(self.cpu_samples, self.training.batch_size) if self.training else None,
            "restarts": self.restarts,
            "events": self.events,
            "workdir": str(self.workdir),
        }
        if failure:
            result["logs"] = {r.name: _tail(r.log_path) for r in self.replicas.values() if r.log_path}
        if self._own_workdir and not self.keep_workdir and not failure:
            shutil.rmtree(self.workdir, ignore_errors=True)
            result["workdir"] = None
        return result


def _tail(path: Path | None, lines: int = 15) -> str:
    if not path or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_job(job: TrainingJob, **kwargs) -> dict:
    """Run a whole job locally and return the result dict (see LocalRun)."""
    progress = kwargs.pop("progress", None)
    return LocalRun(job, **kwargs).run(progress)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a TrainingJob manifest (YAML)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the result at the end")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--workdir", help="folder for logs and default checkpoints (kept)")
    parser.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="REPLICA@STEP",
        help="fault injection: SIGKILL a replica (e.g. ps-0) when the global step reaches STEP",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    job = load_manifest(args.file)
    console = Console(stderr=True)
    local = LocalRun(
        job,
        workdir=Path(args.workdir) if args.workdir else None,
        faults=[Fault.parse(k) for k in args.kill],
        keep_workdir=bool(args.workdir),
    )
    if args.no_progress or local.training is None:  # a custom program reports no steps
        result = local.run()
    else:
        columns = (
            TextColumn(f"[bold]{job.name}[/] {local.training.consistency.mode.value}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[eps]} ex/s"),
            TimeElapsedColumn(),
        )
        steps = local.training.steps
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("train", total=steps, loss="-", eps="-")
            seen_events = [0]

            def show(status: dict) -> None:
                loss = status.get("loss")
                bar.update(
                    task,
                    completed=min(steps, status.get("global_step", 0)),
                    loss=f"{loss:.4f}" if loss is not None else "-",
                    eps=f"{status.get('examples_per_second', 0):,.0f}",
                )
                for event in local.events[seen_events[0] :]:
                    bar.console.log(event)
                seen_events[0] = len(local.events)

            result = local.run(show)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "logs"}))
    else:
        acc = result["accuracy"]
        console.print(
            f"{result['phase']}: steps {result['steps']}, loss {result['loss']}, "
            f"accuracy {acc if acc is None else round(acc, 4)}"
            + (f", AUC {result['auc']:.4f}" if result.get("auc") is not None else "")
            + f", {result['examples_per_second'] or 0:,.0f} examples/s, "
            f"{result['wall_seconds']:.1f} s, restarts {result['restarts']}"
        )
    if not result["succeeded"]:
        console.print(f"[red]failed:[/] {result['reason']}")
        for name, tail in result.get("logs", {}).items():
            console.print(f"[bold]--- {name} (last lines)[/]\n{tail}", markup=False, highlight=False)
        return 1
    return 0
