"""`tfps bench`: tfps against its anchors, measured side by side in one run.

Dense shapes (the 670k MLP with 2 workers × 1 PS, the 5.8M MLP with 2 workers × 2 PS,
batch 128): each repeat measures, back to back, the bytes-inclusive limit with the optimizer's
update made by the answering process (async and sync; bench/limit.py), the compute-only
ceiling, TensorFlow's own ParameterServerStrategy (async), then tfps async, tfps sync and tfps
async with bfloat16 on the wire (spec.training.wireDtype) right between two measurements of the
bytes-inclusive limit, whose mean is the repeat's limit (procs.Repeat.bracket).

Large-embedding shapes (bench/embedding.py: wide-deep with a 2M- and a 10M-row table × 64
over 2 PS, batch 512, 2 workers, async): each repeat measures for SGD and for Adam the limit
with that optimizer's update of the touched rows and TF's strategy, then tfps SGD and Adam
between two measurements of the limit that moves only the touched rows' bytes, with the bytes
through the PS per step and each process's peak RSS; on the 2M shape tfps Adam once more while
checkpoints are written, for its longest step. The tfps runs inside a bracket take turns at
going first, repeat by repeat.

Ratios are taken within a repeat (paired) and the report gives their median over repeats,
next to the goals it states (bench/report.py). Then PS push+pull goodput against raw TCP
loopback, also in pairs. Every measurement runs in its own processes on 127.0.0.1; this
process only orchestrates (no TensorFlow).

Same work on every side: tfps's built-in models (parameters, synthetic data), the same
optimizer and learning rate, no periodic checkpoints; TF's strategy splits large variables
across its PS with MinSizePartitioner, as TF's tutorial does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from . import embedding, limit, machine, report, tfps_side
from .mlp import SHAPES, Shape
from .procs import ANCHOR_CRASH_RETRIES, CPU_FIGURES, MeasurementError, Repeat, module_cmd, run_json

# tfps's runs in each repeat: (consistency mode, spec.training.wireDtype)
TFPS_RUNS = (("async", "float32"), ("sync", "float32"), ("async", "bfloat16"))
QUICK = {
    "seconds": 3.0,
    "warmup_seconds": 1.0,
    "repeats": 1,
    "goodput_mib": 16.0,
    "raw_mib": 64,
    "embedding_shapes": [embedding.QUICK_SHAPE.name],
}
CHECKPOINT_SHAPES = ("2M", embedding.QUICK_SHAPE.name)  # the embedding shapes that also measure a checkpoint's stall
ANCHOR_STARTUP_S = 150.0  # allowance for starting the anchor's processes on a busy machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        nargs="*",
        choices=list(SHAPES),
        default=list(SHAPES),
        help="which dense shapes (default: all; the flag alone, with no shape: only the embedding ones)",
    )
    parser.add_argument(
        "--embedding-shapes",
        nargs="*",
        choices=list(embedding.SHAPES),
        default=list(embedding.SHAPES),
        help="which large-embedding shapes (default: all; the flag alone, with no shape: only the dense ones)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="paired repeats per shape; the report gives the median ratio"
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="timed window of each measurement, after warm-up")
    parser.add_argument("--warmup-seconds", type=float, default=3.0, help="untimed steps before each anchor's window")
    parser.add_argument("--quick", action="store_true", help="a few seconds per measurement, one repeat (a smoke run)")
    parser.add_argument(
        "--goodput-mib", type=float, default=64.0, help="model size pushed and pulled for goodput (MiB)"
    )
    parser.add_argument("--raw-mib", type=int, default=256, help="raw TCP: MiB sent per measurement")
    parser.add_argument("--no-goodput", action="store_true", help="skip the goodput pair")
    parser.add_argument("--learning-rate", type=float, default=0.01, help="SGD learning rate, same on every side")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object instead of tables")
    parser.add_argument("--output", help="also write the JSON report to this file (after every repeat, then whole)")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The effective run settings (`--quick` overrides the time knobs)."""
    out = {
        "shapes": list(args.shapes),
        "embedding_shapes": list(args.embedding_shapes),
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
    return run_json(cmd, timeout, f"{module.rsplit('.', 1)[-1]} ({shape.name})", crash_retries=ANCHOR_CRASH_RETRIES)


def measure_shape_once(
    shape: Shape, cfg: dict, hints: dict[str, float], progress: Callable[[str], None], repeat: int = 0
) -> tuple[dict, list[str]]:
    """One repeat of one shape: the limit + update (async, sync), the ceiling and TF's strategy,
    then tfps's runs right between two measurements of the bytes-inclusive limit
    (Repeat.bracket), in reverse order on odd repeats. Returns examples/s and errors."""
    rep = Repeat(shape.name, progress, report.SYSTEMS)
    for update in ("async", "sync"):
        rep.attempt(f"limit_update_{update}", lambda update=update: limit.run(shape, cfg, update), CPU_FIGURES)
    rep.attempt(
        "ceiling",
        lambda: measure_anchor("tfps.bench.ceiling", shape, cfg, ["--processes", str(shape.workers + shape.ps)]),
    )
    rep.attempt("tf_pss", lambda: measure_anchor("tfps.bench.anchor_tf_pss", shape, cfg, ["--ps", str(shape.ps)]))
    row = rep.row

    def run_one(mode: str, wire_dtype: str) -> None:
        key = tfps_side.system_key(mode, wire_dtype)
        # Size the run from the last tfps rate of this kind, else from the limit's (which tfps
        # cannot pass: the run is then at least as long as asked), to `seconds` of steady
        # state after the warm-up that tfps local leaves out (tfps_side.examples_for).
        rate = hints.get(key) or row.get("limit") or row.get("tf_pss") or row.get("ceiling") or 1000.0
        examples = tfps_side.examples_for(rate, cfg)
        rep.attempt(
            key,
            partial(tfps_side.measure, shape, mode, examples, rate, cfg["learning_rate"], wire_dtype=wire_dtype),
            ("wire_bytes_per_step", *CPU_FIGURES),
        )
        if row.get(key):
            hints[key] = row[key]

    def tfps_runs() -> None:
        for mode, wire_dtype in rep.in_turn(TFPS_RUNS, repeat):
            run_one(mode, wire_dtype)

    rep.bracket("limit", lambda: limit.run(shape, cfg), ("bytes_per_step", *CPU_FIGURES), tfps_runs)
    return row, rep.errors


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


def _embedding_shape(name: str) -> embedding.EmbeddingShape:
    return embedding.SHAPES.get(name) or embedding.QUICK_SHAPE


def build_report(
    cfg: dict,
    rows: dict[str, list[dict]],
    goodput: list[dict] | None,
    errors: list[str],
    wall: float,
    embedding_rows: dict[str, list[dict]] | None = None,
    host: dict | None = None,
) -> dict:
    shapes = {}
    for name, repeats in rows.items():
        shape = SHAPES[name]
        shapes[name] = {
            "config": {
                "params": shape.params,
                "layers": [shape.input_dim, *shape.hidden, shape.classes],
                "batch": shape.batch,
                "workers": shape.workers,
                "ps": shape.ps,
            },  # fmt: skip
            **report.summarize_shape(name, repeats),
        }
    out: dict[str, Any] = {"settings": cfg, "machine": host, "shapes": shapes}
    if embedding_rows:
        out["embedding"] = {
            "shapes": {
                name: {
                    "config": {**vars(_embedding_shape(name)), "params": _embedding_shape(name).params},
                    **report.summarize_shape(name, repeats, report.EMBEDDING_RATIOS),
                }
                for name, repeats in embedding_rows.items()
            },
            "scale": report.summarize_scale(embedding_rows),
        }
    if goodput is not None:
        out["goodput"] = report.summarize_goodput(goodput)
    out["errors"] = errors
    out["goals"] = report.goals_summary(out)
    out["wall_seconds"] = round(wall, 1)
    return out


def _write(path: str, result: dict) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)


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
    host = machine.describe()
    rows: dict[str, list[dict]] = {name: [] for name in cfg["shapes"]}
    emb_rows: dict[str, list[dict]] = {name: [] for name in cfg["embedding_shapes"]}
    hints: dict[str, dict[str, float]] = {name: {} for name in [*rows, *emb_rows]}
    errors: list[str] = []
    for rep in range(cfg["repeats"]):
        for name in cfg["shapes"]:
            progress(f"repeat {rep + 1}/{cfg['repeats']}, shape {name}")
            row, errs = measure_shape_once(SHAPES[name], cfg, hints[name], progress, rep)
            rows[name].append(row)
            errors += errs
        for name in cfg["embedding_shapes"]:
            progress(f"repeat {rep + 1}/{cfg['repeats']}, embedding shape {name}")
            row, errs = embedding.measure_once(
                _embedding_shape(name), cfg, hints[name], progress, name in CHECKPOINT_SHAPES, rep
            )
            emb_rows[name].append(row)
            errors += errs
        if args.output:  # every repeat so far, in case the run is cut short
            _write(args.output, build_report(cfg, rows, None, errors, time.monotonic() - start, emb_rows, host))
    goodput = None
    if cfg["goodput"]:
        progress("goodput: tfps PS push+pull vs raw TCP loopback")
        goodput, errs = measure_goodput(cfg)
        errors += errs
    host["load_at_end"] = machine.load()
    result = build_report(cfg, rows, goodput, errors, time.monotonic() - start, emb_rows, host)
    if args.output:
        _write(args.output, result)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        report.render(result, console)
    return 1 if errors else 0
