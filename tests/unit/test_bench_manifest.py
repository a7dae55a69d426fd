"""`tfps bench`'s generated inputs: the TrainingJob for `tfps local`, the shapes, the settings."""

import argparse
import sys
from types import SimpleNamespace

import pytest

from tfps.api.spec import ConsistencyMode, OptimizerName, TrainingJob
from tfps.bench import goodput, main, mlp, procs, tfps_side
from tfps.runtime.models import load_model


def test_shapes_are_issue_3s():
    small, large = mlp.SHAPES["670k"], mlp.SHAPES["5.8M"]
    assert (small.params, small.workers, small.ps, small.batch) == (669_706, 2, 1, 128)
    assert (large.params, large.workers, large.ps, large.batch) == (5_824_522, 2, 2, 128)
    # the same sizes as tfps's own built-in model
    assert sum(p.size for p in load_model("mlp", large.model_args).params) == large.params


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_manifest_is_a_valid_training_job(mode):
    shape = mlp.SHAPES["5.8M"]
    job = TrainingJob.model_validate(tfps_side.manifest(shape, mode, steps=321, learning_rate=0.05))
    training = job.spec.training
    assert job.spec.replicas("PS") == 2 and job.spec.replicas("Worker") == 2
    assert training.model == "mlp" and training.model_args == {"inputDim": 784, "hidden": [2048, 2048], "classes": 10}
    assert training.batch_size == 128 and training.steps == 321
    assert training.consistency.mode == ConsistencyMode(mode)
    assert training.optimizer.name == OptimizerName.SGD and training.optimizer.learning_rate == 0.05
    assert training.checkpoint.path is None
    assert job.name == f"bench-5-8m-{mode}"


def test_steps_count_ps_versions():
    shape = mlp.SHAPES["670k"]
    # async: a version per push of one worker's batch; sync: per step of all workers
    assert tfps_side.steps_for("async", shape, 128 * 1000) == 1000
    assert tfps_side.steps_for("sync", shape, 128 * 1000) == 500
    assert tfps_side.steps_for("async", shape, 10) == tfps_side.MIN_STEPS


@pytest.mark.parametrize("seconds, warmup", [(10.0, 3.0), (15.0, 3.0), (3.0, 1.0), (60.0, 2.0)])
def test_a_tfps_run_warms_up_as_long_as_the_anchors_before_its_window(seconds, warmup):
    from tfps.runtime.metrics import WARM_UP_ONE_IN

    rate = 1000.0
    run = tfps_side.examples_for(rate, {"seconds": seconds, "warmup_seconds": warmup}) / rate
    # tfps local's examples/s leaves out the first tenth of the run: that tenth is the warm-up
    assert run / WARM_UP_ONE_IN >= warmup
    assert run * (1 - 1 / WARM_UP_ONE_IN) >= seconds


def test_goodput_model_has_the_asked_size():
    for mib in (16, 64, 256):
        params = load_model("mlp", goodput.model_args_for(mib)).params
        size_mib = sum(p.size for p in params) * 4 / goodput.MIB
        assert mib * 0.98 < size_mib <= mib * 1.001


def test_quick_overrides_the_time_knobs():
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    cfg = main.settings(parser.parse_args(["--quick", "--seconds", "20"]))
    assert cfg["seconds"] == main.QUICK["seconds"] and cfg["repeats"] == 1
    cfg = main.settings(parser.parse_args(["--shapes", "670k", "--repeats", "5"]))
    assert cfg["shapes"] == ["670k"] and cfg["repeats"] == 5 and cfg["seconds"] == 15.0
    with pytest.raises(ValueError):
        main.settings(parser.parse_args(["--repeats", "0"]))


def test_last_json_line_skips_logs():
    text = 'WARNING something\n{"a": 1}\nnot json {\n{"b": 2}\ntrailing log line\n'
    assert procs.last_json_line(text) == {"b": 2}
    with pytest.raises(procs.MeasurementError):
        procs.last_json_line("no result here\n")


def test_children_never_use_a_proxy():
    env = procs.child_env({"X": "1"})
    assert "http_proxy" not in env and "HTTPS_PROXY" not in env
    assert env["TF_CPP_MIN_LOG_LEVEL"] in ("0", "1", "2", "3") and env["X"] == "1"


# A child that crashes (SIGSEGV) until the marker file exists, then prints its result.
_CRASHES_ONCE = """
import json, os, pathlib, signal, sys
marker = pathlib.Path(sys.argv[1])
if not marker.exists():
    marker.write_text("crashed")
    os.kill(os.getpid(), signal.SIGSEGV)
print(json.dumps({"examples_per_second": 5.0}))
"""


def test_a_crashed_anchor_is_measured_again_and_the_report_says_so(tmp_path):
    cmd = [sys.executable, "-c", _CRASHES_ONCE, str(tmp_path / "marker")]
    result = procs.run_json(cmd, 60, "flaky anchor", crash_retries=1)
    assert result["examples_per_second"] == 5.0
    assert len(result["crashes"]) == 1 and "exit code -11" in result["crashes"][0]

    lines = []
    rep = procs.Repeat("670k", lines.append, {"tf_pss": "TF strategy"})
    (tmp_path / "marker").unlink()
    rep.attempt("tf_pss", lambda: procs.run_json(cmd, 60, "flaky anchor", crash_retries=1))
    assert rep.row == {"tf_pss": 5.0, "tf_pss:crashed_attempts": 1} and rep.errors == []
    assert "measured again after 1 crashed attempt" in lines[-1]


def test_the_measurement_after_one_whose_ps_held_gibs_waits_for_the_machine_to_settle(monkeypatch):
    slept, lines = [], []
    monkeypatch.setattr(procs.time, "sleep", slept.append)
    rep = procs.Repeat("10M", lines.append, {})
    rep.attempt("tfps_adam", lambda: {"examples_per_second": 1.0, "ps_peak_rss": 900 << 20})
    assert slept == []
    rep.attempt("tf_pss_adam", lambda: {"examples_per_second": 1.0, "ps_peak_rss": 11 << 30})
    assert slept == [procs.SETTLE_SECONDS]
    assert "a 30 s pause for the machine to settle (its PS held 11.0 GiB)" in lines[-1]


def test_a_crash_is_a_failure_without_retries_and_an_error_exit_is_never_retried(tmp_path):
    cmd = [sys.executable, "-c", _CRASHES_ONCE, str(tmp_path / "marker")]
    with pytest.raises(procs.MeasurementError, match="exit code -11") as err:
        procs.run_json(cmd, 60, "tfps local")
    assert err.value.crashed

    fails = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(procs.MeasurementError, match="exit code 3") as err:
        procs.run_json(fails, 60, "anchor", crash_retries=1)
    assert not err.value.crashed


def test_a_measurement_that_times_out_is_reported_with_its_last_progress_lines():
    stuck = [
        sys.executable,
        "-c",
        "import sys, time\n"
        "for line in ('anchor: 1 s: 6 servers up', 'anchor: 40 s: model built'):\n"
        "    print(line, file=sys.stderr, flush=True)\n"
        "time.sleep(60)",
    ]
    with pytest.raises(procs.MeasurementError, match=r"no result within 2 s \| .*servers up \| .*model built$"):
        procs.run_json(stuck, 2, "anchor")


def test_an_anchor_server_killed_mid_run_is_named_with_how_it_died_and_how_large_it_grew():
    """Real processes: a server that grew to ~64 MiB is SIGKILLed, as the OOM killer does."""
    import signal
    import subprocess

    from tfps.bench.anchor_tf_pss import GIB, ServerWatch

    grows = "import sys, time\nx = bytearray(64 << 20)\nprint('up', flush=True)\ntime.sleep(60)"
    servers = [subprocess.Popen([sys.executable, "-c", grows], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for proc in servers:
            proc.stdout.readline()
        watch = ServerWatch(servers, ["ps 0", "worker 0"])
        watch.sample()
        assert watch.dead() is None
        assert watch.peak("ps") >= 64 << 20 and watch.peak("worker") >= 64 << 20
        servers[0].send_signal(signal.SIGKILL)
        servers[0].wait()
        said = watch.dead()
        assert said.startswith(
            "TensorFlow's servers died mid-run: ps 0 exited with -9 (SIGKILL: the kernel's OOM killer"
        )
        assert f"at {watch.peaks[0] / GIB:.1f} GiB resident" in said and "worker 0" not in said
        watch.stop()
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


class _FakeCoordinator:
    """A stand-in for TF's ClusterCoordinator (its `schedule`, `join` and values' `fetch`) on a
    fake clock: `workers` workers take the steps in the order scheduled, `step_s` each, and the
    clock moves while the caller waits for a step and, a little, for each `schedule` (so a window
    that never waits still ends). The scheduling is under test, not TF nor this machine's timer."""

    SCHEDULE_S = 1e-5

    def __init__(self, step_s: float, workers: int):
        self.step_s, self.now = step_s, 0.0
        self.free_at = [0.0] * workers  # when each worker is done with what it was given

    def clock(self) -> float:
        return self.now

    def _wait_until(self, t: float) -> None:
        self.now = max(self.now, t)

    def schedule(self, fn, args=()):
        self.now += self.SCHEDULE_S
        worker = min(range(len(self.free_at)), key=self.free_at.__getitem__)
        done = max(self.free_at[worker], self.now) + self.step_s
        self.free_at[worker] = done
        return SimpleNamespace(fetch=lambda: (self._wait_until(done), 0.5)[1])

    def join(self):
        self._wait_until(max(self.free_at))


@pytest.mark.parametrize("step_s, seconds", [(0.6, 0.5), (0.01, 2.0)])
def test_the_anchor_window_ends_near_its_length_for_a_slow_anchor_and_a_fast_one(step_s, seconds, monkeypatch):
    from tfps.bench import anchor_tf_pss
    from tfps.bench.anchor_tf_pss import CHUNK_SECONDS, MAX_CHUNKS_IN_FLIGHT, run_window

    coordinator = _FakeCoordinator(step_s, workers=2)
    monkeypatch.setattr(
        anchor_tf_pss, "time", SimpleNamespace(perf_counter=coordinator.clock, monotonic=coordinator.clock)
    )
    args = argparse.Namespace(workers=2, seconds=seconds, warmup_seconds=0.1)
    steps, elapsed, loss = run_window(coordinator, None, None, args)
    # A slow anchor (one step per worker outlasts the window) is timed over those steps alone,
    # not over the three such chunks a fast one may have queued when its window ends.
    overrun = step_s if step_s > seconds else (MAX_CHUNKS_IN_FLIGHT + 1) * CHUNK_SECONDS
    assert seconds <= elapsed <= seconds + overrun
    assert steps / elapsed == pytest.approx(2 / step_s, rel=0.01) and loss == 0.5


def test_a_bracketed_reference_is_measured_right_before_and_after_what_it_is_compared_with():
    calls, rates = [], iter([100.0, 80.0])

    def limit():
        calls.append("limit")
        return {"examples_per_second": next(rates), "bytes_per_step": 7}

    rep = procs.Repeat("2M", lambda line: None, {})
    rep.bracket("limit", limit, ("bytes_per_step",), lambda: calls.append("tfps"))
    assert calls == ["limit", "tfps", "limit"]
    assert rep.row == {"limit": 90.0, "limit:before": 100.0, "limit:after": 80.0, "limit:bytes_per_step": 7}


def test_a_bracket_half_of_which_failed_keeps_the_other_half_and_reports_the_failure(monkeypatch):
    slept = []
    monkeypatch.setattr(procs.time, "sleep", slept.append)
    results = iter([procs.MeasurementError("limit: exit code 1"), {"examples_per_second": 80.0}])

    def limit():
        result = next(results)
        if isinstance(result, Exception):
            raise result
        return result

    rep = procs.Repeat("2M", lambda line: None, {})
    rep.bracket("limit", limit, (), lambda: None)
    assert rep.row["limit"] == 80.0 and rep.row["limit:before"] is None
    assert rep.errors == ["2M limit: limit: exit code 1"]
    assert slept == [procs.SETTLE_SECONDS]  # after the failed one: what its processes held is unknown


def _recorded_repeat(monkeypatch, repeat: int, dense: bool) -> list[str]:
    """The measurements of one repeat, in the order they ran (each measurement's process replaced
    by a record of its name: the order is what is checked)."""
    from tfps.bench import embedding, limit, main, tfps_side

    order = []

    def record(name):
        order.append(name)
        return {"examples_per_second": 1000.0}

    monkeypatch.setattr(
        limit,
        "run",
        lambda shape, cfg, update="none", optimizer="sgd", lr=None, sharded=False: record(
            ("limit" if update == "none" else f"limit_update_{optimizer if not dense else update}")
            + ("_sharded" if sharded else "")
        ),
    )
    monkeypatch.setattr(
        tfps_side,
        "measure",
        lambda shape, mode, *a, wire_dtype="float32", optimizer="sgd", every_steps=None: record(
            tfps_side.system_key(mode, wire_dtype) if dense else f"tfps_{optimizer}" + ("_ckpt" if every_steps else "")
        ),
    )
    cfg = {"seconds": 1.0, "warmup_seconds": 1.0, "learning_rate": 0.01}
    if dense:
        monkeypatch.setattr(main, "measure_anchor", lambda module, *a: record(module.rsplit(".", 1)[-1]))
        row, errors = main.measure_shape_once(main.SHAPES["670k"], cfg, {}, lambda line: None, repeat)
    else:
        monkeypatch.setattr(embedding, "measure_anchor", lambda shape, optimizer, *a: record(f"tf_pss_{optimizer}"))
        monkeypatch.setattr(embedding, "shard_state_bytes", lambda shape, optimizer: 1)
        row, errors = embedding.measure_once(embedding.QUICK_SHAPE, cfg, {}, lambda line: None, True, repeat)
    assert errors == [] and row["limit"] == 1000.0
    return order


def test_tfps_runs_between_two_limits_and_they_take_turns_at_going_first(monkeypatch):
    refs = ["limit_update_async", "limit_update_sync", "ceiling", "anchor_tf_pss"]
    assert _recorded_repeat(monkeypatch, 0, dense=True) == [
        *refs,
        "limit",
        "tfps_async",
        "tfps_sync",
        "tfps_async_bf16",
        "limit",
    ]
    assert _recorded_repeat(monkeypatch, 1, dense=True) == [
        *refs,
        "limit",
        "tfps_async_bf16",
        "tfps_sync",
        "tfps_async",
        "limit",
    ]
    # the limit + update and its sharded twin take turns at going first too
    refs = [
        "limit_update_sgd",
        "limit_update_sgd_sharded",
        "tf_pss_sgd",
        "limit_update_adam",
        "limit_update_adam_sharded",
        "tf_pss_adam",
        "limit_sharded",
    ]
    assert _recorded_repeat(monkeypatch, 0, dense=False) == [
        *refs,
        "limit",
        "tfps_sgd",
        "tfps_adam",
        "limit",
        "tfps_adam_ckpt",
    ]
    refs = [
        "limit_update_sgd_sharded",
        "limit_update_sgd",
        "tf_pss_sgd",
        "limit_update_adam_sharded",
        "limit_update_adam",
        "tf_pss_adam",
        "limit_sharded",
    ]
    assert _recorded_repeat(monkeypatch, 1, dense=False) == [
        *refs,
        "limit",
        "tfps_adam",
        "tfps_sgd",
        "limit",
        "tfps_adam_ckpt",
    ]
