"""The benchmark's arithmetic and its report: paired ratios, medians, goals, the table.

Pure: measurements in, a JSON-able report out, and a rich rendering of it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

# What is measured per shape, in the order of a repeat: key -> label.
SYSTEMS: dict[str, str] = {
    "ceiling": "ceiling (no PS)",
    "tf_pss": "TF strategy (async)",
    "tfps_async": "tfps async",
    "tfps_sync": "tfps sync",
    "tfps_async_bf16": "tfps async, bf16 wire",
}
LEGEND = (
    "TF strategy = tf.distribute ParameterServerStrategy with ClusterCoordinator; ceiling = the same "
    "number of worker processes computing gradients with no PS at all; bf16 wire = "
    "spec.training.wireDtype bfloat16 (float32 parameters and updates on the PS)."
)


@dataclass(frozen=True)
class RatioDef:
    key: str
    numerator: str
    denominator: str
    label: str
    goals: dict[str, float]  # shape name -> goal (numerator / denominator >= goal)


# Issue 3's benchmark goals. tf_vs_ceiling has none: it is the anchor's own calibration.
RATIOS: tuple[RatioDef, ...] = (
    RatioDef("async_vs_tf", "tfps_async", "tf_pss", "tfps async / TF strategy", {"670k": 1.6, "5.8M": 1.1}),
    RatioDef("sync_vs_tf", "tfps_sync", "tf_pss", "tfps sync / TF strategy", {"670k": 1.0}),
    RatioDef("async_vs_ceiling", "tfps_async", "ceiling", "tfps async / ceiling", {"670k": 0.75, "5.8M": 0.75}),
    RatioDef("sync_vs_ceiling", "tfps_sync", "ceiling", "tfps sync / ceiling", {}),
    # The same goals for the bfloat16 wire, an option the issue allows (compressed gradients).
    RatioDef("async_bf16_vs_tf", "tfps_async_bf16", "tf_pss", "tfps async bf16 wire / TF strategy", {"670k": 1.6, "5.8M": 1.1}),
    RatioDef("async_bf16_vs_ceiling", "tfps_async_bf16", "ceiling", "tfps async bf16 wire / ceiling", {"670k": 0.75, "5.8M": 0.75}),
    RatioDef("tf_vs_ceiling", "tf_pss", "ceiling", "TF strategy / ceiling", {}),
)
GOODPUT_GOAL = 0.4  # tfps PS push+pull goodput / raw TCP loopback


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0 or not math.isfinite(numerator):
        return None
    return numerator / denominator


def median(values: list[float | None]) -> float | None:
    """The median of the values that were measured (None: a failed measurement)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def verdict(value: float | None, goal: float | None) -> dict[str, Any]:
    """Whether a median ratio meets its goal, and by how much it misses."""
    if goal is None:
        return {"goal": None, "met": None, "missed_by_pct": None, "text": ""}
    if value is None:
        return {"goal": goal, "met": None, "missed_by_pct": None, "text": f"not measured (goal ≥ {goal:g}×)"}
    if value >= goal:
        return {"goal": goal, "met": True, "missed_by_pct": 0.0, "text": f"met (goal ≥ {goal:g}×)"}
    missed = (goal - value) / goal * 100.0
    text = f"missed by {missed:.0f}% (goal ≥ {goal:g}×)"
    return {"goal": goal, "met": False, "missed_by_pct": round(missed, 1), "text": text}


def paired(repeats: list[dict[str, float | None]], numerator: str, denominator: str, label: str, goal: float | None) -> dict[str, Any]:
    """One ratio: its value within each repeat, their median, and the verdict against `goal`."""
    values = [ratio(r.get(numerator), r.get(denominator)) for r in repeats]
    med = median(values)
    return {"label": label, "values": values, "median": med, **verdict(med, goal)}


def summarize_shape(shape: str, repeats: list[dict[str, float | None]]) -> dict[str, Any]:
    """Per-system medians and, for each ratio, the per-repeat (paired) values and their median."""
    medians = {system: median([r.get(system) for r in repeats]) for system in SYSTEMS}
    ratios = {rdef.key: paired(repeats, rdef.numerator, rdef.denominator, rdef.label, rdef.goals.get(shape)) for rdef in RATIOS}
    return {"repeats": repeats, "median_examples_per_second": medians, "ratios": ratios}


def summarize_goodput(repeats: list[dict[str, float | None]]) -> dict[str, Any]:
    """repeats: [{"raw_tcp": MiB/s, "tfps": MiB/s, "grpc_echo": MiB/s}, ...], each measured back to back."""
    return {
        "repeats": repeats,
        "median_mib_per_second": {k: median([r.get(k) for r in repeats]) for k in ("raw_tcp", "tfps", "grpc_echo")},
        "ratio": paired(repeats, "tfps", "raw_tcp", "tfps PS push+pull / raw TCP", GOODPUT_GOAL),
        # No goal of their own: where grpcio alone stands, and how much of it tfps keeps.
        "grpc_ratio": paired(repeats, "grpc_echo", "raw_tcp", "grpcio alone (echo) / raw TCP", None),
        "tfps_vs_grpc": paired(repeats, "tfps", "grpc_echo", "tfps PS push+pull / grpcio alone", None),
    }


def goals_summary(report: dict[str, Any]) -> dict[str, int]:
    """How many goals were met, missed, or not measured."""
    out = {"met": 0, "missed": 0, "not_measured": 0}
    entries = [r for s in report.get("shapes", {}).values() for r in s["ratios"].values()]
    if "goodput" in report:
        entries.append(report["goodput"]["ratio"])
    for entry in entries:
        if entry["goal"] is None:
            continue
        out["met" if entry["met"] else "missed" if entry["met"] is False else "not_measured"] += 1
    return out


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _fmt_rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _status_markup(entry: dict[str, Any]) -> str:
    if entry["met"] is True:
        return f"[green]{entry['text']}[/green]"
    if entry["met"] is False:
        return f"[red]{entry['text']}[/red]"
    return entry["text"]


def render(report: dict[str, Any], console) -> None:
    """Print the report as rich tables on `console`."""
    from rich.table import Table

    rates = Table(title="examples/s (median of repeats; each repeat measures all of them back to back)")
    rates.add_column("shape")
    rates.add_column("params", justify="right")
    rates.add_column("workers × PS", justify="center")
    for label in SYSTEMS.values():
        rates.add_column(label, justify="right")
    for name, shape in report.get("shapes", {}).items():
        cfg = shape["config"]
        rates.add_row(
            name, f"{cfg['params']:,}", f"{cfg['workers']} × {cfg['ps']}",
            *[_fmt_rate(shape["median_examples_per_second"][s]) for s in SYSTEMS],
        )  # fmt: skip
    console.print(rates)
    console.print(LEGEND)

    ratios = Table(title="ratios (paired within a repeat; median over repeats)")
    ratios.add_column("shape")
    ratios.add_column("ratio")
    ratios.add_column("per repeat", justify="right")
    ratios.add_column("median", justify="right")
    ratios.add_column("goal")
    for name, shape in report.get("shapes", {}).items():
        for entry in shape["ratios"].values():
            per = " ".join(_fmt(v) for v in entry["values"])
            ratios.add_row(name, entry["label"], per, _fmt(entry["median"]), _status_markup(entry))
    if "goodput" in report:
        gp = report["goodput"]
        med = gp["median_mib_per_second"]
        label = f"{gp['ratio']['label']} ({_fmt_rate(med['tfps'])} / {_fmt_rate(med['raw_tcp'])} MiB/s)"
        for key in ("ratio", "grpc_ratio", "tfps_vs_grpc"):
            entry = gp[key]
            per = " ".join(_fmt(v) for v in entry["values"])
            ratios.add_row("goodput", label if key == "ratio" else entry["label"], per, _fmt(entry["median"]), _status_markup(entry))
    console.print(ratios)

    for error in report.get("errors", []):
        console.print(f"[yellow]measurement failed:[/yellow] {error}")
    counts = goals_summary(report)
    console.print(f"goals: {counts['met']} met, {counts['missed']} missed, {counts['not_measured']} not measured")
