"""Anchor: the compute-only ceiling.

`python -m tfps.bench.ceiling --hidden 512,512 --workers 2 --seconds 15` starts the same
number of worker processes as the PS runs, each computing gradients of the same MLP on
the same data and batch with no PS at all (TensorFlow's thread pools sized as `tfps local`
sizes a replica's), and prints one JSON line with their aggregate examples/s. Each child
warms up, says READY, and starts its timed window only when all are ready (GO on stdin),
so the windows overlap.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import mlp
from .anchor_tf_pss import add_model_arguments
from .procs import (
    add_processes_argument,
    child_or_orchestrator,
    flag_args,
    module_cmd,
    run_together,
    size_tf_threads,
    timed_window,
)

MODULE = "tfps.bench.ceiling"


def child(args: argparse.Namespace) -> None:
    import tensorflow as tf

    from tfps.runtime.process import freeze_startup_objects

    threads = size_tf_threads(args.processes)
    hidden = mlp.parse_hidden(args.hidden)
    model = mlp.load(args.input_dim, hidden, args.classes, args.seed)
    params = [tf.Variable(v) for v in mlp.initial_values(model, args.seed)]
    batches = iter(mlp.tf_dataset(model, args.batch, offset=args.index))
    freeze_startup_objects()

    @tf.function
    def grad_step(x, y):
        with tf.GradientTape() as tape:
            loss = mlp.loss_fn(model, params, x, y)
        return loss, tape.gradient(loss, params)

    def step() -> None:
        loss, grads = grad_step(*next(batches))
        grads[-1].numpy()  # wait for the step, as a worker would before pushing

    steps, elapsed, _ = timed_window(step, args.warmup_seconds, args.seconds)
    print(
        json.dumps(
            {
                "steps": steps,
                "seconds": elapsed,
                "examples_per_second": steps * args.batch / elapsed,
                "threads": threads,
            }
        ),
        flush=True,
    )


def measure(args: argparse.Namespace) -> dict:
    hidden = mlp.parse_hidden(args.hidden)
    options = {
        "--input-dim": args.input_dim,
        "--hidden": args.hidden,
        "--classes": args.classes,
        "--batch": args.batch,
        "--seconds": args.seconds,
        "--warmup-seconds": args.warmup_seconds,
        "--seed": args.seed,
        "--processes": args.processes,
    }
    base = ["--child", *flag_args(options)]
    results = run_together(
        [module_cmd(MODULE, *base, "--index", str(i)) for i in range(args.workers)], args.seconds * 4 + 60
    )
    return {
        "system": "ceiling",
        "examples_per_second": sum(r["examples_per_second"] for r in results),
        "per_worker": [r["examples_per_second"] for r in results],
        "seconds": max(r["seconds"] for r in results),
        "workers": args.workers,
        "threads": results[0]["threads"],
        "params": mlp.param_count(args.input_dim, hidden, args.classes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    add_processes_argument(parser)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    return child_or_orchestrator(parser.parse_args(argv), child, measure)


if __name__ == "__main__":
    sys.exit(main())
