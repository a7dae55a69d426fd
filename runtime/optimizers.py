"""The optimizer of one PS shard, on the shard's arrays: NumPy for dense parameters, C kernels
for embedding rows (runtime/_rows.c). The PS process does not import TensorFlow: its import
alone is ~600 MiB of resident memory, more than a 2M-row embedding shard's parameters.

Dense parameters and their slots are never changed in place: each update makes new arrays
and the shard swaps them in, so a reply or a checkpoint that holds the previous arrays keeps
a consistent snapshot without a copy. Sparse gradients (embedding rows) are summed per unique
row and update the table and its slots in place, only those rows; Adam's rows are updated
"lazily" (only the touched rows' moments move).
"""
from __future__ import annotations

import numpy as np

from tfps.api.spec import OptimizerName, OptimizerSpec

from . import _rows

SLOTS = {
    OptimizerName.SGD: (),
    OptimizerName.MOMENTUM: ("momentum",),
    OptimizerName.ADAM: ("m", "v"),
    OptimizerName.ADAGRAD: ("accumulator",),
}
_F32 = np.float32


def sum_duplicates(rows: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, each once; their values, summed over repeats)."""
    if len(rows) < 2 or bool((rows[1:] > rows[:-1]).all()):  # already sorted and unique, as workers send them
        return rows, values
    uniq, inverse = np.unique(rows, return_inverse=True)
    if len(uniq) == len(rows):
        return rows, values
    summed = np.zeros((len(uniq), *values.shape[1:]), np.float32)
    np.add.at(summed, inverse.reshape(-1), values)
    return uniq, summed


class ShardOptimizer:
    def __init__(self, spec: OptimizerSpec):
        self.spec = spec
        self.name = spec.name
        self._lr = _F32(spec.learning_rate)
        self._momentum = _F32(spec.momentum)
        self._b1, self._b2 = _F32(spec.beta1), _F32(spec.beta2)
        self._eps = _F32(spec.epsilon)

    def slot_names(self) -> tuple[str, ...]:
        return SLOTS[self.name]

    def initial_slot(self, slot: str, shape) -> np.ndarray:
        # Written whole now, not left as fresh zero pages: faulting those in at random rows
        # (2 MiB huge pages, compacted on demand) made the first steps of a large table's
        # Adam tens of times slower.
        return np.full(shape, self.spec.initial_accumulator if slot == "accumulator" else 0.0, np.float32)

    def _adam_rate(self, t: int) -> np.float32:
        return _F32(self.spec.learning_rate * np.sqrt(1 - self.spec.beta2 ** t) / (1 - self.spec.beta1 ** t))

    def apply_dense(self, var: np.ndarray, slots: dict[str, np.ndarray], grad: np.ndarray, t: int
                    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One update with `grad`; `t` (1-based) counts this shard's updates (Adam's bias
        correction). Returns the new variable and slots; the given arrays are left as they were."""
        if grad.dtype != np.float32:
            grad = grad.astype(np.float32)  # bfloat16 off the wire
        name, lr = self.name, self._lr
        new = np.empty_like(var)
        if name is OptimizerName.SGD:
            np.multiply(grad, lr, out=new)
            np.subtract(var, new, out=new)
            return new, {}
        if name is OptimizerName.MOMENTUM:
            accum = slots["momentum"] * self._momentum
            accum += grad
            np.multiply(accum, lr, out=new)
            np.subtract(var, new, out=new)
            return new, {"momentum": accum}
        if name is OptimizerName.ADAM:
            m, v = _adam_moments(slots["m"].copy(), slots["v"].copy(), grad, self._b1, self._b2)
            _scaled_step(m, v, self._adam_rate(t), self._eps, out=new)
            np.subtract(var, new, out=new)
            return new, {"m": m, "v": v}
        if name is OptimizerName.ADAGRAD:
            accum = np.square(grad)
            accum += slots["accumulator"]
            _scaled_step(grad, accum, lr, self._eps, out=new)
            np.subtract(var, new, out=new)
            return new, {"accumulator": accum}
        raise ValueError(name)  # pragma: no cover - the spec's enum is closed

    def apply_sparse(self, var: np.ndarray, slots: dict[str, np.ndarray], rows: np.ndarray, values: np.ndarray, t: int) -> None:
        """Update only `rows` (local row numbers, may repeat: repeated rows are summed) of
        `var` and its slots, in place."""
        self.apply_rows(var, slots, *sum_duplicates(rows, values), t)

    def apply_rows(self, var: np.ndarray, slots: dict[str, np.ndarray], rows: np.ndarray, grad: np.ndarray, t: int) -> None:
        """`apply_sparse` for rows given once each (`sum_duplicates`' output): one pass over
        them in C (runtime/_rows.c: the same float operations as `apply_dense`, row by row)."""
        if grad.dtype != np.float32:
            grad = grad.astype(np.float32)
        name, lr = self.name, self._lr
        if name is OptimizerName.SGD:
            _rows.sgd(var, rows, grad, lr)
        elif name is OptimizerName.MOMENTUM:
            _rows.momentum(var, slots["momentum"], rows, grad, lr, self._momentum)
        elif name is OptimizerName.ADAM:
            _rows.adam(var, slots["m"], slots["v"], rows, grad, self._b1, self._b2, self._adam_rate(t), self._eps)
        elif name is OptimizerName.ADAGRAD:
            _rows.adagrad(var, slots["accumulator"], rows, grad, lr, self._eps)
        else:  # pragma: no cover
            raise ValueError(name)


def _adam_moments(m, v, grad, b1, b2) -> tuple[np.ndarray, np.ndarray]:
    """b1*m + (1-b1)*g and b2*v + (1-b2)*g², computed into `m` and `v` (fresh arrays the caller owns)."""
    m *= b1
    m += grad * (1 - b1)
    v *= b2
    v += np.square(grad) * (1 - b2)
    return m, v


def _scaled_step(num, den, rate, eps, out) -> np.ndarray:
    """rate * num / (sqrt(den) + eps), into `out`: Adam's step (m, v) and Adagrad's (g, accum)."""
    np.sqrt(den, out=out)
    out += eps
    np.divide(num, out, out=out)
    out *= rate
    return out
