"""The operator benchmarks' arithmetic and report: percentiles, per-run figures, medians over
runs, the ratios against the training-operator anchor and the goals, and a rich table.

Pure: timestamps and counters in, a JSON-able report out.
"""

from __future__ import annotations

import statistics
from typing import Any

# Sides of the scale benchmark: key -> label.
SIDES: dict[str, str] = {
    "tfps": "tfps operator",
    "stock": "training-operator v1.8.1 (stock)",
    "raised": "training-operator v1.8.1 (client limits raised)",
}
# The figures of one run, in the table's order: key -> (label, unit).
FIGURES: dict[str, tuple[str, str]] = {
    "to_all_pods_created_p50": ("create → all pods created p50", "s"),
    "to_all_pods_created_p99": ("create → all pods created p99", "s"),
    "to_running_p50": ("create → job Running p50", "s"),
    "to_running_p99": ("create → job Running p99", "s"),
    "to_pods_running_p50": ("create → all pods Running p50", "s"),
    "to_pods_running_p99": ("create → all pods Running p99", "s"),
    "to_succeeded_p50": ("create → job Succeeded p50", "s"),
    "to_succeeded_p99": ("create → job Succeeded p99", "s"),
    "all_succeeded_s": ("first create → all jobs Succeeded", "s"),
    "all_cleaned_s": ("first create → all PS pods gone", "s"),
    "operator_cpu_s": ("operator CPU", "s"),
    "operator_peak_rss_mib": ("operator peak RSS", "MiB"),
    "operator_requests_per_job": ("operator's API requests per job", ""),
    "writes_per_job": ("API writes per job (all clients)", ""),
}
# Goals: (figure, anchor side, goal on tfps / anchor, label); RSS is an absolute goal.
RATIO_GOALS: tuple[tuple[str, str, float, str], ...] = (
    ("to_all_pods_created_p99", "stock", 0.5, "p99 to all pods created / stock"),
    ("to_all_pods_created_p99", "raised", 1.0, "p99 to all pods created / raised"),
    ("operator_cpu_s", "stock", 1.0, "operator CPU / stock"),
    ("operator_cpu_s", "raised", 1.0, "operator CPU / raised"),
)
RSS_GOAL_MIB = 300.0


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1); None for no values."""
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def _since(stamps: dict[str, float], created: dict[str, float]) -> list[float]:
    return [stamps[n] - t for n, t in created.items() if n in stamps]


def run_figures(
    created: dict[str, float],
    all_pods_created: dict[str, float],
    running: dict[str, float],
    pods_running: dict[str, float],
    succeeded: dict[str, float],
    cleaned: dict[str, float],
) -> dict[str, Any]:
    """One run's timing figures from per-job timestamps (same clock): each dict maps a job
    name to when it reached that point; a job missing from one never reached it."""
    out: dict[str, Any] = {"jobs": len(created)}
    for key, stamps in (
        ("to_all_pods_created", all_pods_created),
        ("to_running", running),
        ("to_pods_running", pods_running),
        ("to_succeeded", succeeded),
    ):
        values = _since(stamps, created)
        out[f"{key}_n"] = len(values)
        out[f"{key}_p50"] = _round(percentile(values, 0.5))
        out[f"{key}_p99"] = _round(percentile(values, 0.99))
    t0 = min(created.values()) if created else 0.0
    done = len(created) > 0
    out["all_succeeded_s"] = _round(max(succeeded.values()) - t0) if done and set(created) <= set(succeeded) else None
    out["all_cleaned_s"] = _round(max(cleaned.values()) - t0) if done and set(created) <= set(cleaned) else None
    return out


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side: each run's figures and their medians; then the goals on the medians."""
    sides: dict[str, Any] = {}
    for side in SIDES:
        mine = [r for r in runs if r.get("side") == side]
        if mine:
            sides[side] = {"runs": mine, "median": {k: _round(median([r.get(k) for r in mine])) for k in FIGURES}}
    goals = []
    tfps = sides.get("tfps", {}).get("median", {})
    for figure, anchor, goal, label in RATIO_GOALS:
        theirs = sides.get(anchor, {}).get("median", {}).get(figure)
        ours = tfps.get(figure)
        value = ours / theirs if ours is not None and theirs else None
        goals.append(
            {
                "label": label,
                "figure": figure,
                "anchor": anchor,
                "goal_max": goal,
                "value": _round(value),
                "met": None if value is None else value <= goal,
            }
        )
    rss = tfps.get("operator_peak_rss_mib")
    goals.append(
        {
            "label": "tfps operator peak RSS (MiB)",
            "figure": "operator_peak_rss_mib",
            "anchor": None,
            "goal_max": RSS_GOAL_MIB,
            "value": rss,
            "met": None if rss is None else rss <= RSS_GOAL_MIB,
        }
    )
    return {"sides": sides, "goals": goals}


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def render(report: dict[str, Any], console) -> None:
    """The report as rich tables: every run and the medians per side, then the goals."""
    from rich.table import Table

    table = Table(title=report.get("title", "operator scale benchmark"))
    table.add_column("figure")
    columns = []
    for side, data in report["sides"].items():
        for i, _ in enumerate(data["runs"]):
            columns.append((side, i))
            table.add_column(f"{side} #{i + 1}", justify="right")
        columns.append((side, None))
        table.add_column(f"{side} median", justify="right", style="bold")
    for key, (label, unit) in FIGURES.items():
        row = [f"{label} ({unit})" if unit else label]
        for side, i in columns:
            data = report["sides"][side]
            row.append(_fmt(data["median"].get(key) if i is None else data["runs"][i].get(key)))
        table.add_row(*row)
    console.print(table)
    goals = Table(title="goals (tfps median / anchor median)")
    for col in ("goal", "value", "max", "met"):
        goals.add_column(col)
    for g in report["goals"]:
        met = {True: "[green]met[/]", False: "[red]missed[/]", None: "not measured"}[g["met"]]
        goals.add_row(g["label"], _fmt(g["value"]), _fmt(g["goal_max"]), met)
    console.print(goals)
    for line in report.get("notes", []):
        console.print(line)
