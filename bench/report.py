"""The benchmark's arithmetic and its report: paired ratios, medians, goals, the table.

Pure: measurements in, a JSON-able report out, and a rich rendering of it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

# What is measured per shape, in the report's order: key -> label.
SYSTEMS: dict[str, str] = {
    "limit": "bytes-inclusive limit",
    "limit_update_async": "limit + update, async",
    "limit_update_sync": "limit + update, sync",
    "ceiling": "ceiling (no PS)",
    "tf_pss": "TF strategy (async)",
    "tfps_async": "tfps async",
    "tfps_sync": "tfps sync",
    "tfps_async_bf16": "tfps async, bf16 wire",
}
LEGEND = (
    "TF strategy = tf.distribute ParameterServerStrategy with ClusterCoordinator; bytes-inclusive limit = the same "
    "worker processes computing the same gradients and moving each step's push and pull bytes over plain sockets "
    "to a process that only answers (no optimizer), measured right before and right after tfps's runs, the mean "
    "of the two; limit + update = the same, the answering process also "
    "applying SGD's update with the PS's own kernel and sending back the parameters it made (async: each push in "
    "turn, the workers computing their next step meanwhile as tfps's async workers do; sync: the mean of both "
    "workers' pushes, both waiting for it), what a PS with no cost of its own beyond the bytes and the update "
    "would reach; ceiling = the same worker processes computing gradients with "
    "no PS and no bytes at all (both with TensorFlow's thread pools sized as tfps local sizes each replica's); "
    "bf16 wire = spec.training.wireDtype bfloat16 (float32 parameters and updates on the PS)."
)
EMBEDDING_SYSTEMS: dict[str, str] = {
    "limit": "bytes-inclusive limit",  # of the touched rows' bytes (EMBEDDING_LEGEND)
    "limit_sharded": "limit, sharded as the PS",
    "limit_update_sgd": "limit + update, SGD",
    "limit_update_sgd_sharded": "limit + update, SGD, sharded",
    "tf_pss_sgd": "TF strategy, SGD",
    "tfps_sgd": "tfps async, SGD",
    "limit_update_adam": "limit + update, Adam",
    "limit_update_adam_sharded": "limit + update, Adam, sharded",
    "tf_pss_adam": "TF strategy, Adam",
    "tfps_adam": "tfps async, Adam",
    "tfps_adam_ckpt": "tfps async, Adam, checkpointing",
}
EMBEDDING_LEGEND = (
    "wide-deep, power-law ids, batch 512 per worker, 2 workers, 2 PS, async. TF strategy = ParameterServerStrategy "
    "training Keras 2 Embedding tables split over the PS by a variable partitioner; its Adam decays every row's slots "
    "each step, tfps's is lazy (only the touched rows). The limit moves only the touched rows' and the dense part's "
    "bytes, measured right before and right after tfps's runs, the mean of the two. Limit + update = the same, "
    "the answering process also holding the tables and applying each push with the PS's own kernels (the dense "
    "part, then only the touched rows: lazily for Adam) and sending back the rows asked for, taken from its tables; "
    "its push also carries the row ids, and its workers compute their next step while it updates, as tfps's async "
    "workers do. Sharded = the same over one answering process per PS, the model split over them as tfps "
    "splits it over its PS, each worker exchanging with every one each step: the job's topology with no cost of "
    "a PS's own. PS state = the most loaded shard's parameters + optimizer slots. Checkpointing = about three "
    "checkpoints of every shard written during the run."
)

CPU_LEGEND = (
    "CPU per worker step, in core-ms, over each run's timed window: tfps's workers together and its PS together "
    "(tfps local's steady state); a limit's workers, and the threads of its answering process (per request "
    "answered, one a worker step). Where the processes share the cores, examples/s follows the total."
)


@dataclass(frozen=True)
class RatioDef:
    key: str
    numerator: str
    denominator: str
    label: str
    goals: dict[str, float]  # shape name (or "*": every shape) -> goal
    at_most: bool = False  # the goal is numerator / denominator <= goal (else >=)

    def goal(self, shape: str) -> float | None:
        return self.goals.get(shape, self.goals.get("*"))


# The dense shapes' goals. The compute-only ceiling has none: moving a step's bytes over TCP
# already costs a large part of a compute step when the processes share the cores, so the goals
# are set against the limit that counts the bytes, and the ceiling stays as a second reference.
RATIOS: tuple[RatioDef, ...] = (
    RatioDef("async_vs_limit", "tfps_async", "limit", "tfps async / bytes-inclusive limit", {"*": 0.85}),
    RatioDef("sync_vs_limit", "tfps_sync", "limit", "tfps sync / bytes-inclusive limit", {"*": 0.75}),
    RatioDef("async_vs_tf", "tfps_async", "tf_pss", "tfps async / TF strategy", {"670k": 1.6, "5.8M": 1.1}),
    RatioDef("sync_vs_tf", "tfps_sync", "tf_pss", "tfps sync / TF strategy", {"670k": 1.0}),
    RatioDef("async_vs_ceiling", "tfps_async", "ceiling", "tfps async / ceiling", {}),
    RatioDef("sync_vs_ceiling", "tfps_sync", "ceiling", "tfps sync / ceiling", {}),
    # The TF goals hold for the bfloat16 wire too, an option that compresses gradients.
    RatioDef(
        "async_bf16_vs_tf",
        "tfps_async_bf16",
        "tf_pss",
        "tfps async bf16 wire / TF strategy",
        {"670k": 1.6, "5.8M": 1.1},
    ),
    RatioDef(
        "async_bf16_vs_limit",
        "tfps_async_bf16",
        "limit",
        "tfps async bf16 wire / bytes-inclusive limit (float32 bytes)",
        {},
    ),
    # What the update itself costs, and tfps against a PS that has no other cost (no goals: references)
    RatioDef("async_vs_limit_update", "tfps_async", "limit_update_async", "tfps async / limit + update, async", {}),
    RatioDef("sync_vs_limit_update", "tfps_sync", "limit_update_sync", "tfps sync / limit + update, sync", {}),
    RatioDef(
        "limit_update_async_vs_limit",
        "limit_update_async",
        "limit",
        "limit + update, async / bytes-inclusive limit",
        {},
    ),
    RatioDef(
        "limit_update_sync_vs_limit", "limit_update_sync", "limit", "limit + update, sync / bytes-inclusive limit", {}
    ),
    RatioDef("limit_vs_ceiling", "limit", "ceiling", "bytes-inclusive limit / ceiling", {}),
    RatioDef("tf_vs_ceiling", "tf_pss", "ceiling", "TF strategy / ceiling", {}),
)


def _embedding_ratios(opt: str, name: str) -> tuple[RatioDef, ...]:
    tfps = f"tfps_{opt}"
    return (
        RatioDef(f"{opt}_vs_limit", tfps, "limit", f"tfps {name} / bytes-inclusive limit", {"*": 0.8}),
        RatioDef(f"{opt}_vs_tf", tfps, f"tf_pss_{opt}", f"tfps {name} / TF strategy {name}", {"*": 10.0}),
        RatioDef(
            f"{opt}_wire",
            f"{tfps}:wire_bytes_per_step",
            "limit:bytes_per_step",
            f"{name}: bytes on the wire per step / touched rows' + dense bytes",
            {"*": 1.2},
            at_most=True,
        ),
        RatioDef(
            f"{opt}_ps_rss",
            f"{tfps}:ps_peak_rss",
            f"state_{opt}:shard",
            f"{name}: PS peak RSS / its shard's parameters + slots",
            {"*": 1.3},
            at_most=True,
        ),
        # What the update itself costs, and tfps against a PS that has no other cost (no goals: references)
        RatioDef(f"{opt}_vs_limit_update", tfps, f"limit_update_{opt}", f"tfps {name} / limit + update, {name}", {}),
        RatioDef(
            f"limit_update_{opt}_vs_limit",
            f"limit_update_{opt}",
            "limit",
            f"limit + update, {name} / bytes-inclusive limit",
            {},
        ),
        # The same over as many answering processes as PS: what the job's topology alone reaches
        RatioDef(
            f"{opt}_vs_limit_update_sharded",
            tfps,
            f"limit_update_{opt}_sharded",
            f"tfps {name} / limit + update, {name}, sharded",
            {},
        ),
        RatioDef(
            f"limit_update_{opt}_sharded_vs_limit",
            f"limit_update_{opt}_sharded",
            "limit",
            f"limit + update, {name}, sharded / bytes-inclusive limit",
            {},
        ),
    )


# The large-embedding shapes' goals, for each optimizer.
EMBEDDING_RATIOS: tuple[RatioDef, ...] = (
    RatioDef(
        "limit_sharded_vs_limit", "limit_sharded", "limit", "limit, sharded as the PS / bytes-inclusive limit", {}
    ),
    *_embedding_ratios("sgd", "SGD"),
    *_embedding_ratios("adam", "Adam"),
    RatioDef(
        "checkpoint_stall",
        "tfps_adam_ckpt:longest_step",
        "tfps_adam:longest_step",
        "Adam: longest step while checkpoints are written / longest step without",
        {},
        at_most=True,
    ),
    RatioDef(
        "checkpoint_stall_p99",
        "tfps_adam_ckpt:p99_step",
        "tfps_adam:p99_step",
        "Adam: 99th percentile step while checkpoints are written / without",
        {},
        at_most=True,
    ),
)
# Cost that does not grow with the table: the large shape over the small one, paired by repeat.
SCALE = ("10M", "2M")
SCALE_RATIOS: tuple[RatioDef, ...] = tuple(
    r
    for opt, name in (("sgd", "SGD"), ("adam", "Adam"))
    for r in (
        RatioDef(f"{opt}_examples", f"tfps_{opt}", f"tfps_{opt}", f"tfps {name} examples/s, 10M / 2M", {"*": 0.8}),
        RatioDef(
            f"{opt}_worker_rss",
            f"tfps_{opt}:worker_peak_rss",
            f"tfps_{opt}:worker_peak_rss",
            f"tfps {name} worker peak RSS, 10M / 2M",
            {"*": 1.2},
            at_most=True,
        ),
    )
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


def verdict(value: float | None, goal: float | None, at_most: bool = False) -> dict[str, Any]:
    """Whether a median ratio meets its goal (>= goal, or <= goal when `at_most`), and by how much it misses."""
    sign = "≤" if at_most else "≥"
    if goal is None:
        return {"goal": None, "met": None, "missed_by_pct": None, "text": ""}
    if value is None:
        return {"goal": goal, "met": None, "missed_by_pct": None, "text": f"not measured (goal {sign} {goal:g}×)"}
    if (value <= goal) if at_most else (value >= goal):
        return {"goal": goal, "met": True, "missed_by_pct": 0.0, "text": f"met (goal {sign} {goal:g}×)"}
    missed = abs(value - goal) / goal * 100.0
    text = f"missed by {missed:.0f}% (goal {sign} {goal:g}×)"
    return {"goal": goal, "met": False, "missed_by_pct": round(missed, 1), "text": text}


def paired(
    repeats: list[dict[str, float | None]],
    numerator: str,
    denominator: str,
    label: str,
    goal: float | None,
    at_most: bool = False,
    over: list[dict[str, float | None]] | None = None,
) -> dict[str, Any]:
    """One ratio: its value within each repeat, their median, and the verdict against `goal`.
    The denominators come from `over`'s repeats when given (another shape's, paired by repeat)."""
    values = [ratio(r.get(numerator), d.get(denominator)) for r, d in zip(repeats, over or repeats, strict=False)]
    med = median(values)
    return {"label": label, "values": values, "median": med, **verdict(med, goal, at_most)}


def _paired(repeats: list[dict], rdef: RatioDef, shape: str, over: list[dict] | None = None) -> dict[str, Any]:
    return paired(repeats, rdef.numerator, rdef.denominator, rdef.label, rdef.goal(shape), rdef.at_most, over)


def summarize_shape(
    shape: str, repeats: list[dict[str, float | None]], ratios: tuple[RatioDef, ...] = RATIOS
) -> dict[str, Any]:
    """The median of every measured figure and, for each ratio, the per-repeat (paired) values and their median."""
    keys = list(dict.fromkeys(k for r in repeats for k in r))
    medians = {key: median([r.get(key) for r in repeats]) for key in keys}
    return {
        "repeats": repeats,
        "medians": medians,
        "ratios": {rdef.key: _paired(repeats, rdef, shape) for rdef in ratios},
    }


def summarize_scale(rows: dict[str, list[dict]]) -> dict[str, Any] | None:
    """The large embedding shape over the small one, repeat by repeat; None unless both ran."""
    big, small = SCALE
    if big not in rows or small not in rows:
        return None
    return {rdef.key: _paired(rows[big], rdef, big, over=rows[small]) for rdef in SCALE_RATIOS}


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
    groups = [*report.get("shapes", {}).values(), *report.get("embedding", {}).get("shapes", {}).values()]
    entries = [r for s in groups for r in s["ratios"].values()]
    entries += list((report.get("embedding", {}).get("scale") or {}).values())
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


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value / (1 << 20):,.1f}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def _ms_pair(first: float | None, second: float | None) -> str:
    return "–" if first is None and second is None else f"{_ms(first)} / {_ms(second)}"


def _ratio_row(table, shape: str, entry: dict[str, Any], label: str | None = None) -> None:
    per = " ".join(_fmt(v) for v in entry["values"])
    table.add_row(shape, label or entry["label"], per, _fmt(entry["median"]), _status_markup(entry))


def _dense_table(shapes: dict[str, Any]):
    from rich.table import Table

    rates = Table(title="dense shapes: examples/s (median of repeats; each repeat measures all of them back to back)")
    rates.add_column("shape")
    rates.add_column("params", justify="right")
    rates.add_column("workers × PS", justify="center")
    for label in SYSTEMS.values():
        rates.add_column(label, justify="right")
    for name, shape in shapes.items():
        cfg = shape["config"]
        rates.add_row(
            name, f"{cfg['params']:,}", f"{cfg['workers']} × {cfg['ps']}",
            *[_fmt_rate(shape["medians"].get(s)) for s in SYSTEMS],
        )  # fmt: skip
    return rates


def _embedding_table(embedding: dict[str, Any]):
    from rich.table import Table

    table = Table(
        title="large embeddings: medians of repeats (MiB: bytes per worker step, peak RSS; ms: worker 0's steps)"
    )
    for col in (
        "shape",
        "system",
        "examples/s",
        "wire MiB/step",
        "PS peak RSS",
        "PS state",
        "worker peak RSS",
        "median ms",
        "p99 / longest ms",
    ):
        table.add_column(col, justify="left" if col in ("shape", "system") else "right")
    for name, shape in embedding["shapes"].items():
        med = shape["medians"]
        for key, label in EMBEDDING_SYSTEMS.items():
            opt = key.rsplit("_", 2)[1] if key.startswith("tfps_adam") else key.rsplit("_", 1)[-1]
            wire = med.get(f"{key}:wire_bytes_per_step", med.get(f"{key}:bytes_per_step"))
            state = (
                med.get(f"state_{opt}:shard") if not key.startswith("limit") else None
            )  # the limit's process holds whole tables
            table.add_row(
                name,
                label,
                _fmt_rate(med.get(key)),
                _mib(wire),
                _mib(med.get(f"{key}:ps_peak_rss")),
                _mib(state),
                _mib(med.get(f"{key}:worker_peak_rss")),
                _ms(med.get(f"{key}:median_step")),
                _ms_pair(med.get(f"{key}:p99_step"), med.get(f"{key}:longest_step")),
            )
    return table


def _cpu_table(report: dict[str, Any]):
    """Each run's CPU per worker step (`CPU_LEGEND`); None when no run measured it."""
    from rich.table import Table

    table = Table(title="CPU per worker step: medians of repeats (core-ms)")
    for col in ("shape", "system", "workers", "PS", "total"):
        table.add_column(col, justify="left" if col in ("shape", "system") else "right")
    groups = [
        (report.get("shapes", {}), SYSTEMS),
        ((report.get("embedding") or {}).get("shapes", {}), EMBEDDING_SYSTEMS),
    ]
    for shapes, systems in groups:
        for name, shape in shapes.items():
            med = shape["medians"]
            for key, label in systems.items():
                worker, ps = med.get(f"{key}:worker_cpu_ms_per_step"), med.get(f"{key}:ps_cpu_ms_per_step")
                if worker is None and ps is None:
                    continue
                total = worker + ps if worker is not None and ps is not None else None
                table.add_row(name, label, _fmt(worker), _fmt(ps), _fmt(total))
    return table if table.row_count else None


def _machine_line(machine: dict[str, Any]) -> str:
    """bench/machine.py's description, in one line."""
    cpu = machine.get("cpu") or "unknown CPU"
    detail = [x for x in (machine.get("cpu_signature"), machine.get("mhz") and f"{machine['mhz']} MHz") if x]
    parts = [f"{cpu} ({', '.join(detail)})" if detail else cpu]
    if machine.get("cpus"):
        parts.append(f"{machine['cpus']} CPUs")
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']:g} GiB")
    parts += [f"{name} {size}" for name, size in (machine.get("caches") or {}).items()]
    if machine.get("kernel"):
        parts.append(f"Linux {machine['kernel']}")
    line = ", ".join(parts)
    if machine.get("load"):
        line += f"; load average {machine['load'][0]:.2f} at the start"
    if machine.get("load_at_end"):
        line += f", {machine['load_at_end'][0]:.2f} at the end"
    return line


def _print_machine(report: dict[str, Any], console) -> None:
    if report.get("machine"):
        console.print(f"machine: {_machine_line(report['machine'])}", soft_wrap=True)


def render(report: dict[str, Any], console) -> None:
    """Print the report as rich tables on `console`."""
    from rich.table import Table

    _print_machine(report, console)
    embedding = report.get("embedding")
    for table, legend in (
        (report.get("shapes") and _dense_table(report["shapes"]), LEGEND),
        (embedding and _embedding_table(embedding), EMBEDDING_LEGEND),
        (_cpu_table(report), CPU_LEGEND),
    ):
        if table:
            console.print(table)
            console.print(legend)

    ratios = Table(title="ratios (paired within a repeat; median over repeats)")
    for col in ("shape", "ratio"):
        ratios.add_column(col)
    ratios.add_column("per repeat", justify="right")
    ratios.add_column("median", justify="right")
    ratios.add_column("goal")
    for name, shape in [*report.get("shapes", {}).items(), *(embedding or {}).get("shapes", {}).items()]:
        for entry in shape["ratios"].values():
            _ratio_row(ratios, name, entry)
    for entry in ((embedding or {}).get("scale") or {}).values():
        _ratio_row(ratios, " / ".join(SCALE), entry)
    if "goodput" in report:
        gp = report["goodput"]
        med = gp["median_mib_per_second"]
        label = f"{gp['ratio']['label']} ({_fmt_rate(med['tfps'])} / {_fmt_rate(med['raw_tcp'])} MiB/s)"
        for key in ("ratio", "grpc_ratio", "tfps_vs_grpc"):
            _ratio_row(ratios, "goodput", gp[key], label if key == "ratio" else None)
    console.print(ratios)

    for error in report.get("errors", []):
        console.print(f"[yellow]measurement failed:[/yellow] {error}")
    counts = goals_summary(report)
    console.print(f"goals: {counts['met']} met, {counts['missed']} missed, {counts['not_measured']} not measured")
