"""Placement of a model's parameters on the PS shards.

Pure and deterministic: every PS and every worker computes the same plan from the model's
parameter shapes and the number of PS, so nothing needs to be agreed over the wire.
- Embedding tables (sparse) are partitioned by rows across all PS.
- A dense variable larger than half a PS's fair share is partitioned by rows across all PS.
- The rest go whole, largest first, to the least-loaded PS.
A worker routes each batch's table ids to the PS that hold their rows, each id once (`batch_ids`,
`route_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from . import wire
from .models import Param

try:
    from ._rows import unique as _unique
except ImportError:  # the package built without its C kernels (runtime/_rows.c): NumPy's unique
    _unique = None


@dataclass(frozen=True)
class Part:
    name: str  # the name on the wire and in checkpoints
    var: str  # the model parameter it belongs to
    ps: int
    start: int  # rows [start, stop) of the parameter
    stop: int
    shape: tuple[int, ...]
    sparse: bool
    init: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class Placement:
    parts: tuple[Part, ...]
    num_ps: int

    def for_ps(self, index: int) -> list[Part]:
        return [p for p in self.parts if p.ps == index]

    def parts_of(self, var: str) -> list[Part]:
        """The parts of parameter `var`, in row order (do not change the list)."""
        return self._by_var.get(var, [])

    @cached_property
    def _by_var(self) -> dict[str, list[Part]]:  # looked up several times a step by each worker
        out: dict[str, list[Part]] = {}
        for part in sorted(self.parts, key=lambda p: p.start):
            out.setdefault(part.var, []).append(part)
        return out

    def split_push(
        self, dense_vars: list[str], grads: dict[str, np.ndarray], routes: dict
    ) -> list[dict[str, np.ndarray]]:
        """Per PS, the gradients of a worker's push, as its Step carries them: each dense
        variable's (`dense_vars`, in the model's order; a slice per part where it is split), then
        each table part's pushed rows, as local indices and their gradients' rows (`routes`: per
        table, `route_rows`' output for the batch's distinct ids, which `grads[table]` follows)."""
        out: list[dict[str, np.ndarray]] = [dict() for _ in range(self.num_ps)]
        for name in dense_vars:
            grad, parts = grads[name], self.parts_of(name)
            for part in parts:
                out[part.ps][part.name] = grad if len(parts) == 1 else grad[part.start : part.stop]
        for name, table_routes in routes.items():
            grad = grads[name]
            for part, positions, local in table_routes:
                out[part.ps][f"{part.name}:indices"] = local.astype(np.int64, copy=False)
                out[part.ps][f"{part.name}:values"] = grad[positions[0] : positions[-1] + 1]
        return out

    def rows_asked(self, routes: dict) -> list[dict[str, np.ndarray]]:
        """Per PS, the rows a worker asks back of each of its table parts (`routes` as `split_push`'s)."""
        out: list[dict[str, np.ndarray]] = [dict() for _ in range(self.num_ps)]
        for table_routes in routes.values():
            for part, _, local in table_routes:
                out[part.ps][f"{part.name}:rows"] = local
        return out

    def load(self) -> list[int]:
        loads = [0] * self.num_ps
        for p in self.parts:
            loads[p.ps] += p.size
        return loads


def _row_splits(rows: int, n: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, rows, n + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=False)]


def place(params: list[Param], num_ps: int) -> Placement:
    if num_ps < 1:
        raise ValueError("at least one PS is needed")
    total = sum(p.size for p in params)
    threshold = total / (2 * num_ps)
    parts: list[Part] = []
    loads = [0] * num_ps
    whole = []
    for p in params:
        split = num_ps > 1 and p.shape and p.shape[0] >= num_ps and (p.sparse or p.size > threshold)
        if not split:
            whole.append(p)
            continue
        for k, (a, b) in enumerate(_row_splits(p.shape[0], num_ps)):
            part = Part(f"{p.name}/part-{k}", p.name, k, a, b, (b - a, *p.shape[1:]), p.sparse, p.init)
            parts.append(part)
            loads[k] += part.size
    for p in sorted(whole, key=lambda q: (-q.size, q.name)):
        k = min(range(num_ps), key=lambda i: (loads[i], i))
        rows = p.shape[0] if p.shape else 1
        parts.append(Part(p.name, p.name, k, 0, rows, tuple(p.shape), p.sparse, p.init))
        loads[k] += p.size
    return Placement(tuple(parts), num_ps)


def initial_part(part: Part, param: Param, seed: int) -> np.ndarray:
    """The part's rows of the parameter's deterministic initial value (only those rows are made)."""
    return param.initial_value(seed) if not part.shape else param.initial_rows(seed, part.start, part.stop)


def route_rows(parts: list[Part], ids: np.ndarray) -> list[tuple[Part, range, np.ndarray]]:
    """Split sorted unique ids of one sparse parameter by part (`parts` in row order, as
    `Placement.parts_of` gives them): (part, positions in ids, local rows) for each part with ids."""
    bounds = np.searchsorted(
        ids, [row for part in parts for row in (part.start, part.stop)]
    ).tolist()  # one call for all
    return [
        (part, range(lo, hi), ids[lo:hi] - part.start)
        for part, lo, hi in zip(parts, bounds[::2], bounds[1::2], strict=True)
        if hi > lo
    ]


def batch_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A batch's distinct ids, increasing, and where each id is among them, in an aligned array
    of the ids' shape (TensorFlow reads it in place): NumPy's unique(ids, return_inverse=True).
    In C (runtime/_rows.c) through a hash table, which finds them in one pass where NumPy sorts
    every id."""
    inverse = wire.aligned_array(ids.shape, np.int64)
    flat = np.ascontiguousarray(ids, np.int64).reshape(-1)
    if _unique is None:
        uniq, found = np.unique(flat, return_inverse=True)
        inverse[...] = found.reshape(ids.shape)
        return uniq, inverse
    uniq = np.empty(len(flat), np.int64)
    return uniq[: _unique(flat, uniq, inverse)], inverse
