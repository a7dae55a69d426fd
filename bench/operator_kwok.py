"""kwok's fake nodes for the operator scale benchmark, kept apart from anyone else's: nodes with
a label of their own, played by a kwok of their own (hack/kwok.py runs one kwok per label, and
each deletes only its own nodes and leaves the blackhole route to the last one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

LABEL = ("tfps.io/bench-kwok", "operator-scale")


def placement(kwok) -> dict:
    return kwok.placement(LABEL)


def nodes(kwok, count: int, cpu: str, memory: str, gpus: int, pods: int) -> list[dict]:
    return [
        kwok.node_manifest(f"kwok-bench-{i}", cpu=cpu, memory=memory, gpus=gpus, pods=pods, label=LABEL)
        for i in range(count)
    ]


@contextlib.contextmanager
def running(kwok, kubeconfig: str | Path, manifests: list[dict], log_path: Path, timeout: float = 90) -> Iterator:
    """The benchmark's kwok and its nodes, Ready; on exit its nodes are deleted and it stops."""
    with kwok.running(kubeconfig, manifests, log_path, timeout, label=LABEL) as proc:
        yield proc
