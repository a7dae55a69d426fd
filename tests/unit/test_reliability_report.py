"""hack/reliability.py: what the report makes of the records a session leaves."""

from __future__ import annotations

import json
from pathlib import Path

from support import hack_module

REPO = Path(__file__).resolve().parents[2]


def _mod():
    return hack_module("reliability")


VALIDATION = "tests/integration/test_operator_validation.py::test_invalid_manifest_is_rejected_naming_the_field"
FLOOD = "tests/integration/test_runtime_ps_input.py::test_flood_of_bad_pushes_is_refused_and_ps_stays_up"


def _records(mod):
    records: list[dict] = []
    fault = {
        "kind": "fault",
        "fault": "ps-0 SIGKILL",
        "phase": "Succeeded",
        "accuracy": 0.97,
        "baseline": 0.969,
        "steps_redone": 12,
        "steps_lost": 0,
        "duplicates": 0,
        "checkpoint_interval": 50,
    }
    mod.collect(
        records,
        "tests/e2e/test_faults.py::test_fault_mid_run_is_survived[ps-0 SIGKILL]",
        "passed",
        [("reliability", fault)],
    )
    mod.collect(records, f"{VALIDATION}[zero-steps]", "passed", [])
    mod.collect(records, f"{VALIDATION}[negative-ttl]", "failed", [])
    mod.collect(records, FLOOD, "passed", [("reliability", {"count": 2000})])
    mod.collect(records, "tests/unit/test_spec.py::test_other", "passed", [])
    return records


def test_counts_faults_inputs_and_data_lost():
    mod = _mod()
    text = "\n".join(mod.summary(_records(mod)))
    assert "faults injected: 1, survived" in text and ": 1" in text
    assert "ps-0 SIGKILL" in text and "0.9700" in text
    assert "invalid inputs tried: 2002, refused: 2001" in text
    assert "data lost: 0" in text


def test_a_failed_fault_run_counts_as_data_lost(tmp_path):
    mod = _mod()
    records = [{"kind": "fault", "fault": "x", "phase": "Failed", "passed": False}]
    assert any(
        line.strip() == "data lost: 1 (checkpointed steps lost, plus failed runs)" for line in mod.summary(records)
    )
    path = mod.write(records, tmp_path / "r.json")
    assert json.loads(path.read_text())["records"] == records
    assert mod.main(["reliability.py", str(path)]) == 1


def test_nothing_recorded_prints_nothing():
    assert _mod().summary([]) == []
