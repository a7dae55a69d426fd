"""`tfps bench`: tfps against its anchors, measured side by side in one run.

For each shape (issue 3: the 670k MLP with 2 workers × 1 PS, the 5.8M MLP with 2 workers ×
2 PS, batch 128) each repeat measures, back to back: the compute-only ceiling, TensorFlow's
own ParameterServerStrategy (async), tfps async and tfps sync, and tfps async with
bfloat16 on the wire (spec.training.wireDtype). Ratios are taken within a
repeat (paired) and the report gives their median over repeats, next to issue 3's goals.
Then PS push+pull goodput against raw TCP loopback, also in pairs. Every measurement runs
in its own processes on 127.0.0.1; this process only orchestrates (no TensorFlow).

Same work on every side: tfps's built-in `mlp` (parameters, initial values, synthetic
data), plain SGD with one learning rate, no periodic checkpoints; TF's strategy splits
large variables across its PS with MinSizePartitioner, as TF's tutorial does.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from . import report, tfps_side
from .mlp import SHAPES, Shape
from .procs import MeasurementError, module_cmd, run_json

# tfps's runs in each repeat: (consistency mode, spec.training.wireDtype)
TFPS_RUNS = (("async", "float32"), ("sync", "float32"), ("async", "bfloat16"))
QUICK = {"seconds": 3.0, "warmup_seconds": 1.0, "repeats": 1, "goodput_mib": 16.0, "raw_mib": 64}
ANCHOR_STARTUP_S = 150.0  # allowance for starting the anchor's processes on a busy machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="which shapes (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="paired repeats per shape; the report gives the median ratio")
    parser.add_argument("--seconds", type=float, default=15.0, help="timed window of each measurement, after warm-up")
    parser.add_argument("--warmup-seconds", type=float, default=3.0, help="untimed steps before each anchor's window")
    parser.add_argument("--quick", action="store_true", help="a few seconds per measurement, one repeat (a smoke run)")
    parser.add_argument("--goodput-mib", type=float, default=64.0, help="model size pushed and pulled for goodput (MiB)")
    parser.add_argument("--raw-mib", type=int, default=256, help="raw TCP: MiB sent per measurement")
    parser.add_argument("--no-goodput", action="store_true", help="skip the goodput pair")
    parser.add_argument("--learning-rate", type=float, default=0.01, help="SGD learning rate, same on every side")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object instead of tables")
    parser.add_argument("--output", help="also write the JSON report to this file")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The effective run settings (`--quick` overrides the time knobs)."""
    out = {
        "shapes": list(args.shapes),
        "repeats": args.repeats,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "goodput_mib": args.goodput_mib,
        "raw_mib": args.raw_mib,
        "goodput": not args.no_goodput,
        "learning_rate": args.learning_rate,
        "quick": args.quick,
    }
    if args.quick:
        out.update(QUICK)
    if out["repeats"] < 1 or out["seconds"] <= 0:
        raise ValueError("--repeats must be >= 1 and --seconds > 0")
    return out


def measure_anchor(module: str, shape: Shape, cfg: dict, extra: list[str] = ()) -> dict:
    cmd = module_cmd(
        module, *shape.cli_args, "--seconds", str(cfg["seconds"]), "--warmup-seconds", str(cfg["warmup_seconds"]),
        "--learning-rate", str(cfg["learning_rate"]), *extra,
    )  # fmt: skip
    timeout = ANCHOR_STARTUP_S + 4 * (cfg["seconds"] + cfg["warmup_seconds"])
    return run_json(cmd, timeout, f"{module.rsplit('.', 1)[-1]} ({shape.name})")


def measure_shape_once(
    shape: Shape, cfg: dict, hints: dict[str, float], progress: Callable[[str], None]
) -> tuple[dict, list[str]]:
    """One repeat of one shape: every system back to back. Returns examples/s and errors."""
    row: dict[str, float | None] = {}
    errors: list[str] = []

    def attempt(system: str, fn: Callable[[], dict]) -> None:
        t0 = time.monotonic()
        try:
            result = fn()
            row[system] = float(result["examples_per_second"])
            progress(f"{shape.name} {report.SYSTEMS[system]}: {row[system]:,.0f} examples/s ({time.monotonic() - t0:.0f} s)")
        except (MeasurementError, KeyError, ValueError, TypeError) as err:
            row[system] = None
            errors.append(f"{shape.name} {system}: {err}")
            progress(f"{shape.name} {report.SYSTEMS[system]}: FAILED: {err}")

    attempt("ceiling", lambda: measure_anchor("tfps.bench.ceiling", shape, cfg))
    attempt("tf_pss", lambda: measure_anchor("tfps.bench.anchor_tf_pss", shape, cfg, ["--ps", str(shape.ps)]))
    for mode, wire_dtype in TFPS_RUNS:
        key = tfps_side.system_key(mode, wire_dtype)
        # Size the run from the last tfps rate of this kind (else TF's): about `seconds`
        # of steady state plus the warm-up that tfps local excludes.
        rate = hints.get(key) or row.get("tf_pss") or row.get("ceiling") or 1000.0
        examples = rate * (cfg["seconds"] + cfg["warmup_seconds"]) * 1.15

        def run_tfps(mode=mode, rate=rate, examples=examples, wire_dtype=wire_dtype) -> dict:
            return tfps_side.measure(shape, mode, examples, rate, cfg["learning_rate"], wire_dtype=wire_dtype)

        attempt(key, run_tfps)
        if row.get(key):
            hints[key] = row[key]
    return row, errors


def measure_goodput(cfg: dict) -> tuple[list[dict], list[str]]:
    cmd = module_cmd(
        "tfps.bench.goodput", "--mib", str(cfg["goodput_mib"]), "--raw-mib", str(cfg["raw_mib"]),
        "--seconds", str(cfg["seconds"]), "--repeats", str(cfg["repeats"]),
    )  # fmt: skip
    try:
        result = run_json(cmd, ANCHOR_STARTUP_S + cfg["repeats"] * (cfg["seconds"] * 3 + 30), "goodput")
        return result["pairs"], []
    except (MeasurementError, KeyError) as err:
        return [{"raw_tcp": None, "tfps": None}], [f"goodput: {err}"]


def build_report(cfg: dict, rows: dict[str, list[dict]], goodput: list[dict] | None, errors: list[str], wall: float) -> dict:
    shapes = {}
    for name, repeats in rows.items():
        shape = SHAPES[name]
        shapes[name] = {
            "config": {
                "params": shape.params, "layers": [shape.input_dim, *shape.hidden, shape.classes],
                "batch": shape.batch, "workers": shape.workers, "ps": shape.ps,
            },  # fmt: skip
            **report.summarize_shape(name, repeats),
        }
    out: dict[str, Any] = {"settings": cfg, "shapes": shapes}
    if goodput is not None:
        out["goodput"] = report.summarize_goodput(goodput)
    out["errors"] = errors
    out["goals"] = report.goals_summary(out)
    out["wall_seconds"] = round(wall, 1)
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    cfg = settings(args)
    console = Console(stderr=True) if args.json else Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)  # logs and pipes: keep each row on one line
    status = Console(stderr=True, log_path=False)

    def progress(text: str) -> None:
        status.log(text)

    start = time.monotonic()
    rows: dict[str, list[dict]] = {name: [] for name in cfg["shapes"]}
    hints: dict[str, dict[str, float]] = {name: {} for name in cfg["shapes"]}
    errors: list[str] = []
    for rep in range(cfg["repeats"]):
        for name in cfg["shapes"]:
            progress(f"repeat {rep + 1}/{cfg['repeats']}, shape {name}")
            row, errs = measure_shape_once(SHAPES[name], cfg, hints[name], progress)
            rows[name].append(row)
            errors += errs
    goodput = None
    if cfg["goodput"]:
        progress("goodput: tfps PS push+pull vs raw TCP loopback")
        goodput, errs = measure_goodput(cfg)
        errors += errs
    result = build_report(cfg, rows, goodput, errors, time.monotonic() - start)
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        report.render(result, console)
    return 1 if errors else 0
