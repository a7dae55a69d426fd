"""What tests share: waiting for an event, reading Prometheus metrics, loading hack/ scripts,
saying where a namespace's pods are when a test fails, glibc's heap accounting in a child
process, running `tfps local`, a lone PS shard, a TLS job and the PS's `serving` log records.

Importable as `support` (pytest puts tests/ on sys.path for tests/conftest.py). A test waits
for the event that proves the behaviour with `wait_for`, never sleeps and then asserts that
nothing happened.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# The start of a `python -c` script that reads glibc's own accounting of its heap:
# `libc.mallinfo2()` (hblkhd: mmapped bytes; fordblks: free bytes kept in the heap) and
# `libc.malloc_stats()` (one "Arena N:" section per arena, on stderr).
MALLINFO_PRELUDE = r"""
import ctypes
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
"""


def wait_for(what: str, fn: Callable[[], T], timeout: float = 30, interval: float = 0.2) -> T:
    """Poll until fn() is truthy and return it; fail with the last value seen. An exception
    that fn() raises fails the wait at once (fn should return a falsy value while not yet)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus exposition text, parsed by prometheus_client: (name, labels) -> value."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample `name` whose labels include `labels`; None when absent."""
    found = [v for (n, have), v in samples(text).items() if n == name and set(labels.items()) <= have]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else None


def scrape(port: int, host: str = "127.0.0.1") -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{host}:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def hack_module(name: str) -> ModuleType:
    """hack/<name>.py (or hack/<name with dashes>.py) as a module, loaded once."""
    key = f"tfps_hack_{name.replace('-', '_')}"
    if key in sys.modules:
        return sys.modules[key]
    path = REPO / "hack" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def pods_state(api, namespace: str) -> list[str]:
    """A line for each pod in `namespace` (`api`: a kubernetes ApiClient): its phase, its node or why
    it has none, the scheduling gates it still has, whether it is being deleted, and any other
    condition that is not True."""
    from kubernetes import client

    lines = [f"pods in {namespace}:"]
    for pod in client.CoreV1Api(api).list_namespaced_pod(namespace).items:
        conditions = pod.status.conditions or []
        scheduled = next((c for c in conditions if c.type == "PodScheduled"), None)
        why = f" ({scheduled.reason}: {scheduled.message})" if scheduled and scheduled.status != "True" else ""
        gates = [g.name for g in pod.spec.scheduling_gates or []]
        others = [(c.type, c.status, c.reason) for c in conditions if c.type != "PodScheduled" and c.status != "True"]
        lines.append(
            f"  {pod.metadata.name}: {pod.status.phase}, node {pod.spec.node_name or '-'}{why}"
            + (f", gates {gates}" if gates else "")
            + (", deleting" if pod.metadata.deletion_timestamp else "")
            + (f", {others}" if others else "")
        )
    return lines


def tfps_local(manifest: str | Path, timeout: float) -> dict:
    """`tfps local --json` run on a manifest file: its result, after it exited 0."""
    out = subprocess.run(
        [sys.executable, "-m", "tfps.cli.main", "local", str(manifest), "--json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def lone_shard(
    params, training, index: int = 0, num_ps: int | None = None, workers: int = 1, job: str = "t", **options
):
    """PS `index`'s Shard of `params` (as placed over `num_ps` PS, default one), outside any
    cluster, its metrics in a registry of its own unless `options` names one (`registry`); the
    other `options` are Shard's (checkpoint_root, ...)."""
    from tfps.runtime.metrics import Identity, PSMetrics
    from tfps.runtime.ps import Shard
    from tfps.runtime.sharding import place

    metrics = PSMetrics(Identity(job, "default", "ps", index), options.pop("registry", None))
    parts = place(params, num_ps or 1).for_ps(index)
    return Shard(parts, {p.name: p for p in params}, training, workers, index, metrics, num_ps=num_ps, **options)


def async_training(model: str, model_args: dict, optimizer: str = "sgd", learning_rate: float = 0.01, **fields):
    """An async TrainingSpec of a built-in model; `fields`: more of spec.training, by their
    manifest names (batchSize, steps, checkpoint, ...)."""
    from tfps.api.spec import TrainingSpec

    optimizer_spec = {"name": optimizer, "learningRate": learning_rate}
    return TrainingSpec.model_validate(
        {
            "model": model,
            "modelArgs": model_args,
            "optimizer": optimizer_spec,
            "consistency": {"mode": "async"},
            **fields,
        }
    )


def tls_training(steps: int) -> dict:
    """spec.training of the small job with TLS on that the security tests train, locally and on the node."""
    return {
        "model": "digits-mlp",
        "modelArgs": {"hidden": [32]},
        "steps": steps,
        "batchSize": 32,
        "optimizer": {"name": "adam", "learningRate": 0.01},
        "tls": True,
    }


def serving_records(log: str) -> list[dict]:
    """The JSON records of a PS's log that say what it serves (TLS, authentication)."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"serving"' in line]
