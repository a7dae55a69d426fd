"""What PS and worker processes read from their environment, and `tfps local`'s restart rules."""

import json
import os
import subprocess
import sys
import time

import pytest
from support import MALLINFO_PRELUDE

from tfps.api.spec import TrainingJob
from tfps.runtime.local import Fault, LocalRun
from tfps.runtime.process import ProcessConfig, cgroup_cpus


def _env(**extra):
    return {
        "TF_CONFIG": json.dumps(
            {
                "cluster": {
                    "ps": ["j-ps-0.j.ns.svc:2222", "j-ps-1.j.ns.svc:2345"],
                    "worker": ["j-worker-0.j.ns.svc:2222"],
                },
                "task": {"type": "ps", "index": 1},
            }
        ),
        "TFPS_TRAINING": json.dumps(
            {"model": "mlp", "batchSize": 8, "consistency": {"mode": "bounded", "staleness": 3}}
        ),
        "TFPS_JOB_NAME": "j",
        "TFPS_NAMESPACE": "ns",
        "TFPS_BIND_ADDRESS": "10.1.2.3",
        **extra,
    }


def test_pod_environment_is_read_back():
    cfg = ProcessConfig.from_env(_env())
    assert (cfg.job, cfg.namespace, cfg.metrics_port) == ("j", "ns", 9090)
    assert cfg.training.batch_size == 8 and cfg.training.consistency.staleness == 3
    assert cfg.own_port == 2345  # the port of this task's own TF_CONFIG address
    assert cfg.listen_address(cfg.own_port) == "10.1.2.3:2345"
    assert ProcessConfig.from_env(_env(TFPS_BIND_ADDRESS="fd00::1")).listen_address(2222) == "[fd00::1]:2222"
    assert ProcessConfig.from_env(_env(TFPS_METRICS_PORT="9100")).metrics_port == 9100


def test_missing_training_is_a_clear_error():
    env = _env()
    del env["TFPS_TRAINING"]
    with pytest.raises(ValueError, match="TFPS_TRAINING"):
        ProcessConfig.from_env(env)


def _job(ps_policy="OnFailure", worker_policy="OnFailure"):
    return TrainingJob.model_validate(
        {
            "metadata": {"name": "t"},
            "spec": {
                "replicaSpecs": {
                    "PS": {"replicas": 1, "restartPolicy": ps_policy},
                    "Worker": {"replicas": 2, "restartPolicy": worker_policy},
                },
                "training": {"model": "digits-mlp"},
            },
        }
    )


@pytest.mark.parametrize(
    "policy, code, restart",
    [
        ("OnFailure", 1, True),
        ("OnFailure", -9, True),
        ("Never", -9, False),
        ("Always", 0, True),
        ("ExitCode", 1, False),
        ("ExitCode", 137, True),
        ("ExitCode", -9, True),
    ],
)
def test_restart_policy_for_a_ps(tmp_path, policy, code, restart):
    run = LocalRun(_job(ps_policy=policy), workdir=tmp_path)
    assert run._should_restart(run.replicas[("ps", 0)], code) is restart


def test_a_finished_worker_is_never_restarted(tmp_path):
    run = LocalRun(_job(worker_policy="Always"), workdir=tmp_path)
    assert run._should_restart(run.replicas[("worker", 1)], 0) is False
    assert run._should_restart(run.replicas[("worker", 1)], 1) is True


def test_local_run_uses_loopback_and_a_checkpoint_folder(tmp_path):
    run = LocalRun(_job(), workdir=tmp_path)
    env = run._environment(run.replicas[("worker", 0)])
    cluster = json.loads(env["TF_CONFIG"])["cluster"]
    assert all(a.startswith("127.0.0.1:") for a in cluster["ps"] + cluster["worker"])
    assert json.loads(env["TFPS_TRAINING"])["checkpoint"]["path"] == str(tmp_path / "checkpoints")
    assert env["TFPS_RESULT_FILE"]


def test_local_processes_split_the_machine_s_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("TFPS_INTRA_OP_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    run = LocalRun(_job(), workdir=tmp_path)
    env = run._environment(run.replicas[("ps", 0)])
    assert env["TFPS_INTRA_OP_THREADS"] == str(8 // len(run.replicas))
    monkeypatch.setenv("TFPS_INTRA_OP_THREADS", "3")  # the user's choice wins
    assert run._environment(run.replicas[("ps", 0)])["TFPS_INTRA_OP_THREADS"] == "3"


@pytest.mark.parametrize("content, cpus", [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1), ("", None)])
def test_threads_follow_the_pod_cpu_limit(tmp_path, content, cpus):
    path = tmp_path / "cpu.max"
    path.write_text(content)
    nowhere = str(tmp_path / "no-v1")
    assert cgroup_cpus(str(path), v1_dir=nowhere) == cpus
    assert cgroup_cpus(str(tmp_path / "absent"), v1_dir=nowhere) is None


@pytest.mark.parametrize(
    "quota, period, cpus", [("-1", "100000", None), ("100000", "100000", 1), ("150000", "100000", 2)]
)
def test_threads_follow_the_cgroup_v1_cfs_quota(tmp_path, quota, period, cpus):
    (tmp_path / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu.cfs_period_us").write_text(period + "\n")
    assert cgroup_cpus(str(tmp_path / "no-cpu.max"), v1_dir=str(tmp_path)) == cpus


_MALLINFO = (
    MALLINFO_PRELUDE
    + r"""
import sys
if sys.argv[1] == "tuned":
    from tfps.runtime.malloc import keep_large_buffers
    assert keep_large_buffers()
block = bytearray(16 << 20)  # a step's message
mmapped = libc.mallinfo2().hblkhd
del block
print(mmapped >= 16 << 20, libc.mallinfo2().fordblks >= 16 << 20)
"""
)


@pytest.mark.parametrize("mode, mmapped, kept", [("default", True, False), ("tuned", False, True)])
def test_large_buffers_are_kept_in_the_heap(mode, mmapped, kept):
    """glibc's own accounting (mallinfo2), in a fresh process each: by default a 16 MiB block
    is mmapped and given back when freed; with keep_large_buffers it comes from the heap and
    stays there for the next step's message."""
    out = subprocess.run(
        [sys.executable, "-c", _MALLINFO, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [str(mmapped), str(kept)]


_ARENAS = r"""
import ctypes, sys, threading
from tfps.runtime.malloc import keep_large_buffers
assert keep_large_buffers(one_arena=sys.argv[1] == "one")
def request():
    block = bytearray(8 << 20)  # what a request thread builds and drops
thread = threading.Thread(target=request)
thread.start()
thread.join()
ctypes.CDLL("libc.so.6").malloc_stats()  # one "Arena N:" section per arena, on stderr
"""


@pytest.mark.parametrize("arenas, count", [("per-thread", 2), ("one", 1)])
def test_a_ps_keeps_every_threads_buffers_in_one_heap(arenas, count):
    """With one arena (the PS's setting) a request thread allocates from the main heap, whose
    freed blocks every thread reuses; by glibc's default it gets an arena of its own, which keeps
    the largest working set that thread ever had."""
    out = subprocess.run([sys.executable, "-c", _ARENAS, arenas], capture_output=True, text=True, check=True)
    assert sum(line.startswith("Arena ") for line in out.stderr.splitlines()) == count


def test_fault_syntax():
    assert (Fault.parse("ps-1@300").replica, Fault.parse("ps-1@300").step) == ("ps-1", 300)
    with pytest.raises(ValueError):
        Fault.parse("ps1")


def test_settings_name_the_variables_api_naming_spells():
    """Every TFPS_* knob is read through one pydantic model, under the names that
    tfps.api.naming declares (the operator writes those names into pods)."""
    from tfps.api import naming
    from tfps.api.settings import ProcessSettings

    aliases = {f.validation_alias.choices[0] for f in ProcessSettings.model_fields.values()}
    declared = {v for k, v in vars(naming).items() if k.startswith("ENV_") and k != "ENV_OPERATOR_CONFIG"}
    assert aliases == declared
    s = ProcessSettings.from_env({"TFPS_PIPELINE": "0", "TFPS_DATA_PORT": "off", "TFPS_PS_RETRY_SECONDS": "7"})
    assert (s.pipeline, s.data_port_number, s.ps_retry_seconds, s.data_path) == (False, None, 7.0, True)


_POLICY = r"""
import os, sys, threading
from tfps.runtime.process import use_batch_scheduling
taken = use_batch_scheduling()
seen = {}
thread = threading.Thread(target=lambda: seen.update(policy=os.sched_getscheduler(0)))  # started after: inherits it
thread.start()
thread.join()
names = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch"}
print(taken, names[os.sched_getscheduler(0)], names[seen["policy"]])
"""


@pytest.mark.parametrize("setting, policy", [(None, "batch"), ("0", "other")])
def test_a_process_runs_under_sched_batch_unless_told_not_to(setting, policy):
    """The kernel's own answer (sched_getscheduler), in a fresh process each: by default its
    thread and the threads it starts after run under SCHED_BATCH; with TFPS_SCHED_BATCH=0 they
    keep the policy the process started with."""
    env = {k: v for k, v in os.environ.items() if k != "TFPS_SCHED_BATCH"}
    if setting is not None:
        env["TFPS_SCHED_BATCH"] = setting
    # from the default policy, whatever this process runs under (a bench test may have set SCHED_BATCH)
    other = lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # noqa: E731
    out = subprocess.run(
        [sys.executable, "-c", _POLICY], capture_output=True, text=True, check=True, env=env, preexec_fn=other
    ).stdout.split()
    assert out == ["batch" if policy == "batch" else "default", policy, policy]


def test_cpu_seconds_of_a_live_process_and_none_when_gone():
    from tfps.runtime.process import cpu_seconds

    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert before is not None and cpu_seconds(os.getpid()) >= before + 0.2
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert cpu_seconds(proc.pid) is None


def test_cpu_per_step_is_taken_over_the_steady_state_only():
    from tfps.runtime.local import CpuSample, cpu_per_step

    samples = [
        CpuSample(512, False, {"ps": 5.0, "worker": 20.0}),  # start-up: not in the window
        CpuSample(5120, True, {"ps": 6.0, "worker": 24.0}),
        CpuSample(10240, True, {"ps": 6.5, "worker": 26.5}),
        CpuSample(15360, True, {"ps": 7.0, "worker": 29.0}),
    ]
    # 20 worker steps of 512 between the first steady sample and the last
    assert cpu_per_step(samples, 512) == pytest.approx({"ps": 50.0, "worker": 250.0})
    assert cpu_per_step(samples[:2], 512) is None  # one steady sample: no window
    assert cpu_per_step([samples[1], CpuSample(5120, True, {"ps": 6.1, "worker": 24.1})], 512) is None  # no step in it
