#!/usr/bin/env python3
"""The reliability report: faults injected and survived, invalid inputs tried and refused, data lost.

The test session collects the figures (tests/conftest.py hooks call `collect` for every test
report and `write` at the end); this script prints the table from the JSON file they leave:

    hack/reliability.py [REPORT_JSON]      (default: $TFPS_RELIABILITY_REPORT or .tfps/reliability.json)

Where the figures come from:
- faults: tests/e2e/test_faults.py records one entry a fault (`record_property("reliability",
  {...})`): the job's final phase and accuracy against the undisturbed run, the steps a restored
  PS had to redo, the checkpointed steps lost, duplicate pods seen;
- invalid inputs: every case of the parametrised refusal tests named in INVALID_INPUT_TESTS
  (invalid TrainingJobs, malformed PS traffic) counts as tried, and as refused when it passed.

Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROPERTY = "reliability"
_VALIDATION = "tests/integration/test_operator_validation.py::"
_PS_INPUT = "tests/integration/test_runtime_ps_input.py::"
# test function (path::name) -> the kind of invalid input its parametrised cases try
INVALID_INPUT_TESTS = {
    f"{_VALIDATION}test_invalid_manifest_is_rejected_naming_the_field": "invalid TrainingJob (API server)",
    f"{_PS_INPUT}test_malformed_push_is_refused_and_changes_nothing": "malformed PS request",
    f"{_PS_INPUT}test_oversize_message_is_refused": "oversize PS message",
    f"{_PS_INPUT}test_stream_over_the_size_limit_is_refused": "oversize PS message",
    f"{_PS_INPUT}test_flood_of_bad_pushes_is_refused_and_ps_stays_up": "flood of bad PS pushes",
}


def default_path() -> Path:
    return Path(os.environ.get("TFPS_RELIABILITY_REPORT") or REPO / ".tfps" / "reliability.json")


def collect(records: list[dict], nodeid: str, outcome: str, user_properties) -> None:
    """Add what one test report says to `records` (called for the `call` phase of each test)."""
    for key, value in user_properties:
        if key == PROPERTY and isinstance(value, dict):
            records.append({**value, "test": nodeid, "passed": outcome == "passed"})
    func = nodeid.split("[", 1)[0]
    if func in INVALID_INPUT_TESTS:
        case = nodeid[len(func) :].strip("[]")
        # the flood test tries many bad requests in one case: it records how many
        count = next((v.get("count", 1) for k, v in user_properties if k == PROPERTY and isinstance(v, dict)), 1)
        records.append(
            {
                "kind": "invalid_input",
                "category": INVALID_INPUT_TESTS[func],
                "case": case,
                "count": count,
                "test": nodeid,
                "passed": outcome == "passed",
            }
        )


def write(records: list[dict], path: Path | None = None) -> Path:
    path = path or default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"records": records}, indent=1))
    tmp.replace(path)
    return path


def summary(records: list[dict]) -> list[str]:
    """The report's lines; empty when the session recorded nothing."""
    faults = [r for r in records if r.get("kind") == "fault"]
    invalid = [r for r in records if r.get("kind") == "invalid_input"]
    if not faults and not invalid:
        return []
    lines = ["reliability report"]
    if faults:
        survived = [r for r in faults if r.get("passed") and r.get("phase") == "Succeeded"]
        lines.append(
            f"  faults injected: {len(faults)}, survived (Succeeded, accuracy within 1 point, "
            f"no duplicate pod): {len(survived)}"
        )
        lines.append(
            f"    {'fault':34} {'phase':10} {'accuracy':>8} {'baseline':>8} {'redone':>6} {'lost':>5} {'dup':>4}"
        )
        for r in faults:
            acc = f"{r['accuracy']:.4f}" if isinstance(r.get("accuracy"), (int, float)) else "-"
            base = f"{r['baseline']:.4f}" if isinstance(r.get("baseline"), (int, float)) else "-"
            lines.append(
                f"    {r.get('fault', '?'):34} {str(r.get('phase')):10} {acc:>8} {base:>8} "
                f"{r.get('steps_redone', 0):>6} {r.get('steps_lost', 0):>5} {r.get('duplicates', 0):>4}"
                + ("" if r.get("passed") else "   FAILED")
            )
        interval = max((r.get("checkpoint_interval") or 0 for r in faults), default=0)
        lines.append(
            f"    redone: steps a restored PS computed again (at most one checkpoint interval, {interval}); "
            "lost: checkpointed steps gone"
        )
    if invalid:
        tried = sum(r.get("count", 1) for r in invalid)
        refused = sum(r.get("count", 1) for r in invalid if r.get("passed"))
        lines.append(f"  invalid inputs tried: {tried}, refused: {refused}")
        cats: dict[str, list[int]] = {}
        for r in invalid:
            c = cats.setdefault(r["category"], [0, 0, 0])
            c[0] += 1
            c[1] += r.get("count", 1)
            c[2] += r.get("count", 1) if r.get("passed") else 0
        for cat, (cases, n, ok) in cats.items():
            lines.append(f"    {cat:34} cases {cases:>3}  tried {n:>5}  refused {ok:>5}")
    lost = sum(r.get("steps_lost", 0) for r in faults) + sum(1 for r in faults if r.get("phase") != "Succeeded")
    lines.append(f"  data lost: {lost} (checkpointed steps lost, plus failed runs)")
    return lines


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else default_path()
    try:
        records = json.loads(path.read_text())["records"]
    except (OSError, ValueError, KeyError) as err:
        print(f"no reliability figures in {path}: {err}", file=sys.stderr)
        return 1
    lines = summary(records)
    print("\n".join(lines) if lines else f"no reliability figures in {path}")
    faults = [r for r in records if r.get("kind") == "fault"]
    bad = [r for r in records if not r.get("passed")]
    return 1 if bad or any(r.get("steps_lost") for r in faults) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
