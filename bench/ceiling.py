"""Anchor: the compute-only ceiling.

`python -m tfps.bench.ceiling --hidden 512,512 --workers 2 --seconds 15` starts the same
number of worker processes as the PS runs, each computing gradients of the same MLP on
the same data and batch with no PS at all, and prints one JSON line with their aggregate
examples/s. Each child warms up, says READY, and starts its timed window only when all
are ready (GO on stdin), so the windows overlap.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from . import mlp
from .anchor_tf_pss import add_model_arguments
from .procs import child_env, module_cmd

MODULE = "tfps.bench.ceiling"


def child(args: argparse.Namespace) -> None:
    import tensorflow as tf

    hidden = mlp.parse_hidden(args.hidden)
    model = mlp.load(args.input_dim, hidden, args.classes, args.seed)
    params = [tf.Variable(v) for v in mlp.initial_values(model, args.seed)]
    batches = iter(mlp.tf_dataset(model, args.batch, offset=args.index))

    @tf.function
    def grad_step(x, y):
        with tf.GradientTape() as tape:
            loss = mlp.loss_fn(model, params, x, y)
        return loss, tape.gradient(loss, params)

    warm_start = time.perf_counter()
    for step in range(1_000_000):  # a few steps (tracing), then until the warm-up time is spent
        loss, grads = grad_step(*next(batches))
        grads[-1].numpy()
        if step >= 2 and time.perf_counter() - warm_start >= args.warmup_seconds:
            break
    print("READY", flush=True)
    sys.stdin.readline()  # GO
    steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        loss, grads = grad_step(*next(batches))
        grads[-1].numpy()  # wait for the step, as a worker would before pushing
        steps += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"steps": steps, "seconds": elapsed, "examples_per_second": steps * args.batch / elapsed}), flush=True)


def measure(args: argparse.Namespace) -> dict:
    hidden = mlp.parse_hidden(args.hidden)
    base = [
        "--child", "--input-dim", str(args.input_dim), "--hidden", args.hidden, "--classes", str(args.classes),
        "--batch", str(args.batch), "--seconds", str(args.seconds), "--warmup-seconds", str(args.warmup_seconds),
        "--seed", str(args.seed),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            module_cmd(MODULE, *base, "--index", str(i)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), text=True,
        )  # fmt: skip
        for i in range(args.workers)
    ]
    try:
        for proc in procs:
            if not any(line.strip() == "READY" for line in _until_ready(proc)):
                raise RuntimeError(f"a ceiling worker did not start (exit code {proc.wait()})")
        for proc in procs:
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=args.seconds * 4 + 60)
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {
        "system": "ceiling",
        "examples_per_second": sum(r["examples_per_second"] for r in results),
        "per_worker": [r["examples_per_second"] for r in results],
        "seconds": max(r["seconds"] for r in results),
        "workers": args.workers,
        "params": mlp.param_count(args.input_dim, hidden, args.classes),
    }


def _until_ready(proc: subprocess.Popen):
    for line in proc.stdout:
        yield line
        if line.strip() == "READY":
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.child:
        child(args)
    else:
        print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
