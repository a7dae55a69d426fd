"""tfps's side of the benchmark: a generated TrainingJob run by `tfps local --json`.

The manifest trains the built-in `mlp` with the shape's sizes, batch, workers and PS, plain
SGD like the anchors, no periodic checkpoints. `tfps local` reports the steady-state
examples/s (start-up excluded) in its JSON result.
"""
from __future__ import annotations

import math
import tempfile

import yaml

from .mlp import MODEL, Shape
from .procs import MeasurementError, module_cmd, run_json

MIN_STEPS = 50
NO_CHECKPOINT_STEPS = 1_000_000_000
STARTUP_ALLOWANCE_S = 120.0  # processes importing TensorFlow on a busy 2-core machine


def steps_for(mode: str, shape: Shape, examples: float) -> int:
    """spec.training.steps that train about `examples` examples.

    `steps` counts PS versions: in sync mode one version is a step of every worker, in async
    and bounded mode one version is one worker's push."""
    per_version = shape.batch * (shape.workers if mode == "sync" else 1)
    return max(MIN_STEPS, math.ceil(examples / per_version))


def manifest(shape: Shape, mode: str, steps: int, learning_rate: float = 0.01, seed: int = 0, wire_dtype: str = "float32") -> dict:
    """The TrainingJob that `tfps local` runs for one measurement."""
    suffix = "" if wire_dtype == "float32" else f"-{wire_dtype}"
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
                "model": MODEL,
                "modelArgs": shape.model_args,
                "seed": seed,
                "optimizer": {"name": "sgd", "learningRate": learning_rate},
                "batchSize": shape.batch,
                "steps": steps,
                "consistency": {"mode": mode},
                "wireDtype": wire_dtype,
                # no periodic checkpoints, as on the anchors' side (tfps local writes them by default)
                "checkpoint": {"everySteps": NO_CHECKPOINT_STEPS},
            },
            "runPolicy": {"backoffLimit": 0},
        },
    }


def measure(shape: Shape, mode: str, examples: float, expected_rate: float, learning_rate: float = 0.01, seed: int = 0,
            wire_dtype: str = "float32") -> dict:
    """Run the manifest for about `examples` examples; `expected_rate` (examples/s) sizes the timeout."""
    steps = steps_for(mode, shape, examples)
    timeout = STARTUP_ALLOWANCE_S + 8 * examples / max(expected_rate, 1.0)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="tfps-bench-") as fh:
        yaml.safe_dump(manifest(shape, mode, steps, learning_rate, seed, wire_dtype), fh)
        fh.flush()
        cmd = module_cmd("tfps.cli.main", "local", fh.name, "--json", "--no-progress")
        result = run_json(cmd, timeout, f"tfps local ({shape.name}, {mode})")
    rate = result.get("examples_per_second")
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise MeasurementError(f"tfps local ({shape.name}, {mode}): no examples_per_second in {result}")
    if not result.get("succeeded", True):
        raise MeasurementError(f"tfps local ({shape.name}, {mode}): {result.get('reason')}")
    return {"system": system_key(mode, wire_dtype), **result}


def system_key(mode: str, wire_dtype: str = "float32") -> str:
    """The report's key for a tfps run (report.SYSTEMS)."""
    return f"tfps_{mode}" + ("" if wire_dtype == "float32" else "_bf16")
