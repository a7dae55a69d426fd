"""What a tfps Embedding (runtime/keras_layers.py) learns from the runtime, without Keras:
whether the model is being built to be trained (its table then stays on the PS), and the table
or rows, and ids, that a forward hands it (runtime/keras_model.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_local = threading.local()  # tables_on_ps's flag and the tables a forward hands its layers


@contextlib.contextmanager
def tables_on_ps() -> Iterator[None]:
    """Models built inside keep a tfps Embedding's table on the PS (one row in its place here)."""
    before = getattr(_local, "on_ps", False)
    _local.on_ps = True
    try:
        yield
    finally:
        _local.on_ps = before


def tables_on_ps_now() -> bool:
    return getattr(_local, "on_ps", False)


def given_table(layer) -> tuple[Any, Any] | None:
    """(table or its rows, ids or None: the layer's own inputs) that a forward hands `layer`."""
    return getattr(_local, "tables", {}).get(id(layer))


@contextlib.contextmanager
def giving(tables: dict) -> Iterator[None]:
    """While a forward runs: per layer (by id), the table or rows and the ids `given_table` hands it."""
    before = getattr(_local, "tables", {})
    _local.tables = tables
    try:
        yield
    finally:
        _local.tables = before
