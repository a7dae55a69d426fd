"""What tests share: waiting for an event, reading Prometheus metrics, loading hack/ scripts.

Importable as `support` (pytest puts tests/ on sys.path for tests/conftest.py). A test waits
for the event that proves the behaviour with `wait_for`, never sleeps and then asserts that
nothing happened.
"""
from __future__ import annotations

import importlib.util
import sys
import time
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, TypeVar

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


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
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


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
