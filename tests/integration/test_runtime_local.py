"""`tfps local` end to end: real PS and worker processes on loopback.

- examples/digits.yaml reaches >= 0.95 test accuracy;
- a PS killed with SIGKILL mid-run is restarted, restores its checkpoint, and the run ends
  within 1 accuracy point of the undisturbed one; likewise a killed worker.
"""

import json
from pathlib import Path

import pytest
from support import sample, scrape, tfps_local

from tfps.api.spec import load_manifest
from tfps.runtime.local import Fault, LocalRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"


@pytest.fixture(scope="module")
def undisturbed():
    return tfps_local(EXAMPLE, timeout=600)


def test_digits_example_reaches_95_percent(undisturbed):
    assert undisturbed["succeeded"] and undisturbed["phase"] == "Succeeded"
    assert undisturbed["steps"] == load_manifest(EXAMPLE).spec.training.steps
    assert undisturbed["accuracy"] >= 0.95
    assert undisturbed["examples_per_second"] > 0 and undisturbed["wall_seconds"] > 0
    assert undisturbed["loss"] < 0.5
    steps = undisturbed["step_seconds"]  # worker 0's, past its first tenth
    assert steps["steps"] > 0 and 0 < steps["median"] <= steps["p99"] <= steps["max"]
    cpu = undisturbed["cpu_ms_per_step"]  # each replica type's, per worker step, past the warm-up
    assert set(cpu) == {"ps", "worker"} and cpu["ps"] > 0 and cpu["worker"] > 0


def _scrape(run, rtype, index) -> str:
    return scrape(run.replicas[(rtype, index)].metrics_port)


@pytest.mark.parametrize("victim", ["ps-0", "worker-1"])
def test_sigkill_mid_run_recovers(undisturbed, victim, tmp_path):
    job = load_manifest(EXAMPLE)
    scraped = {}

    def scrape_once(run, status):
        if not scraped and status.get("global_step", 0) >= 50:
            scraped["ps"], scraped["worker"] = _scrape(run, "ps", 0), _scrape(run, "worker", 0)

    run = LocalRun(job, workdir=tmp_path, faults=[Fault(victim, step=250)], keep_workdir=True, on_status=scrape_once)
    result = run.run()
    assert result["succeeded"], result.get("logs")
    assert run.faults[0].fired
    assert any(e.startswith(f"restarting {victim}") for e in result["events"]), result["events"]
    assert result["steps"] == job.spec.training.steps
    assert abs(result["accuracy"] - undisturbed["accuracy"]) <= 0.01
    # every pod serves its metrics with the job's labels, and they count what happened by step 50
    ps0 = {"job": "digits", "namespace": "default", "replica_type": "ps", "replica_index": "0"}
    assert sample(scraped["ps"], "tfps_ps_global_step", **ps0) >= 50
    assert sample(scraped["ps"], "tfps_ps_examples_total", **ps0) > 0
    assert sample(scraped["ps"], "tfps_ps_received_bytes_total", **ps0) > 0
    assert 0 < sample(scraped["ps"], "tfps_ps_loss", **ps0) < 10
    assert (
        sample(scraped["worker"], "tfps_worker_steps_total", job="digits", replica_type="worker", replica_index="0") > 0
    )
    if victim.startswith("ps"):
        log = (tmp_path / f"{victim}.log").read_text()
        restored = [json.loads(line) for line in log.splitlines() if '"event": "restored"' in line]
        assert restored and restored[0]["step"] >= 100  # checkpoints every 100 steps
