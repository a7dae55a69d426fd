"""`tfps local` runs a custom program (no spec.training) with Chief, Worker and Evaluator
replicas as the operator would: each gets TF_CONFIG, and the Chief's exit decides the job."""

from __future__ import annotations

import json
import sys

import pytest

from tfps.api.spec import TrainingJob
from tfps.runtime.local import LocalRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Each replica records its TF_CONFIG; the Chief finishes once every replica has, the others
# once the Chief has finished.
PROGRAM = r"""
import json, os, pathlib, sys, time
cfg = json.loads(os.environ["TF_CONFIG"])
out = pathlib.Path(sys.argv[1])
task = cfg["task"]
(out / f"{task['type']}-{task['index']}.json").write_text(json.dumps(cfg))
end = time.monotonic() + 60
if task["type"] == "chief":
    while len(list(out.glob("*.json"))) < int(sys.argv[2]) and time.monotonic() < end:
        time.sleep(0.1)
    (out / "chief.done").touch()
else:
    while not (out / "chief.done").exists() and time.monotonic() < end:
        time.sleep(0.1)
"""


def test_custom_program_with_chief_and_evaluator(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    template = {
        "spec": {
            "containers": [{"name": "tensorflow", "command": [sys.executable, "-c", PROGRAM], "args": [str(out), "4"]}]
        }
    }
    job = TrainingJob.model_validate(
        {
            "metadata": {"name": "custom"},
            "spec": {
                "replicaSpecs": {
                    "Chief": {"replicas": 1, "template": template},
                    "Worker": {"replicas": 2, "template": template},
                    "Evaluator": {"replicas": 1, "template": template},
                }
            },
        }
    )
    result = LocalRun(job, workdir=tmp_path / "work").run()
    assert result["succeeded"], result
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(seen) == {"chief-0", "worker-0", "worker-1", "evaluator-0"}
    assert set(seen["chief-0"]["cluster"]) == {"chief", "worker"}  # TFJob: evaluators are not in `cluster`
    assert seen["worker-1"]["cluster"]["worker"] == seen["chief-0"]["cluster"]["worker"]
