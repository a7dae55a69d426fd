"""tfps's side of the benchmark: a generated TrainingJob run by `tfps local --json`.

The manifest trains the shape's built-in model (`mlp`, or `wide-deep` for the embedding
shapes) with its sizes, batch, workers and PS, the same optimizer as the anchors, no periodic
checkpoints unless asked. `tfps local` reports the steady-state examples/s (start-up
excluded), the bytes through the PS, each process's peak RSS and worker 0's step times.
"""

from __future__ import annotations

import math
import tempfile

import yaml

from .procs import MeasurementError, module_cmd, run_json

MIN_STEPS = 50
NO_CHECKPOINT_STEPS = 1_000_000_000
STARTUP_ALLOWANCE_S = 120.0  # importing TensorFlow is slow when the processes share busy cores


def steps_for(mode: str, shape, examples: float) -> int:
    """spec.training.steps that train about `examples` examples.

    `steps` counts PS versions: in sync mode one version is a step of every worker, in async
    and bounded mode one version is one worker's push."""
    per_version = shape.batch * (shape.workers if mode == "sync" else 1)
    return max(MIN_STEPS, math.ceil(examples / per_version))


def examples_for(rate: float, cfg: dict) -> float:
    """Examples for a run at about `rate` examples/s that measures at least `seconds` of steady
    state after as much warm-up as the anchors get: `tfps local`'s examples/s leaves out the
    first tenth of the steps, so that tenth lasts at least `warmup_seconds`."""
    from tfps.runtime.metrics import WARM_UP_ONE_IN

    seconds = max(cfg["seconds"] + cfg["warmup_seconds"], WARM_UP_ONE_IN * cfg["warmup_seconds"])
    return rate * seconds * 1.15


def manifest(
    shape,
    mode: str,
    steps: int,
    learning_rate: float = 0.01,
    seed: int = 0,
    wire_dtype: str = "float32",
    optimizer: str = "sgd",
    every_steps: int = NO_CHECKPOINT_STEPS,
) -> dict:
    """The TrainingJob that `tfps local` runs for one measurement (`shape`: bench/mlp.py's or bench/embedding.py's)."""
    suffix = ("" if wire_dtype == "float32" else f"-{wire_dtype}") + ("" if optimizer == "sgd" else f"-{optimizer}")
    return {
        "apiVersion": "tfps.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": f"bench-{shape.name.lower().replace('.', '-')}-{mode}{suffix}"},
        "spec": {
            "replicaSpecs": {
                "PS": {"replicas": shape.ps, "restartPolicy": "Never"},
                "Worker": {"replicas": shape.workers, "restartPolicy": "Never"},
            },
            "training": {
                "model": shape.model,
                "modelArgs": shape.model_args,
                "seed": seed,
                "optimizer": {"name": optimizer, "learningRate": learning_rate},
                "batchSize": shape.batch,
                "steps": steps,
                "consistency": {"mode": mode},
                "wireDtype": wire_dtype,
                # by default no periodic checkpoints, as on the anchors' side (tfps local writes them by default)
                "checkpoint": {"everySteps": every_steps, "everySeconds": NO_CHECKPOINT_STEPS},
            },
            "runPolicy": {"backoffLimit": 0},
        },
    }


def measure(shape, mode: str, examples: float, expected_rate: float, learning_rate: float = 0.01, **options) -> dict:
    """Run the manifest (`options`: manifest's seed, wire_dtype, optimizer, every_steps) for about
    `examples` examples; `expected_rate` (examples/s) sizes the timeout."""
    timeout = STARTUP_ALLOWANCE_S + 8 * examples / max(expected_rate, 1.0)
    job = manifest(shape, mode, steps_for(mode, shape, examples), learning_rate, **options)
    training = job["spec"]["training"]
    optimizer, wire_dtype = training["optimizer"]["name"], training["wireDtype"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="tfps-bench-") as fh:
        yaml.safe_dump(job, fh)
        fh.flush()
        cmd = module_cmd("tfps.cli.main", "local", fh.name, "--json", "--no-progress")
        result = run_json(cmd, timeout, f"tfps local ({shape.name}, {mode}, {optimizer})")
    rate = result.get("examples_per_second")
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise MeasurementError(f"tfps local ({shape.name}, {mode}): no examples_per_second in {result}")
    if not result.get("succeeded", True):
        raise MeasurementError(f"tfps local ({shape.name}, {mode}): {result.get('reason')}")
    return {"system": system_key(mode, wire_dtype), **result, **_per_step(result, mode, shape)}


def _per_step(result: dict, mode: str, shape) -> dict:
    """Bytes through the PS per worker step, the largest PS's and worker's peak RSS, step times."""
    rss, steps = result.get("peak_rss_bytes") or {}, result.get("step_seconds") or {}
    worker_steps = (result.get("steps") or 0) * (shape.workers if mode == "sync" else 1)
    return {
        "wire_bytes_per_step": result["wire_bytes"] / worker_steps
        if result.get("wire_bytes") and worker_steps
        else None,
        "ps_peak_rss": max((v for k, v in rss.items() if k.startswith("ps-") and v), default=None),
        "worker_peak_rss": max((v for k, v in rss.items() if k.startswith("worker-") and v), default=None),
        "longest_step": steps.get("max"),  # worker 0's, past its first tenth
        "p99_step": steps.get("p99"),
        "median_step": steps.get("median"),
        **{f"{kind}_cpu_ms_per_step": (result.get("cpu_ms_per_step") or {}).get(kind) for kind in ("worker", "ps")},
    }


def system_key(mode: str, wire_dtype: str = "float32") -> str:
    """The report's key for a tfps run (report.SYSTEMS)."""
    return f"tfps_{mode}" + ("" if wire_dtype == "float32" else "_bf16")
