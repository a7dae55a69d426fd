"""The optimizer of one PS shard, on the shard's arrays, in C (runtime/_rows.c): each update one
pass over the variable, its slots and the gradient, where NumPy makes several. The PS process
does not import TensorFlow: its import alone takes more resident memory than a large embedding
shard's parameters.

Dense parameters and their slots are never changed in place: each update makes new arrays
and the shard swaps them in, so a reply or a checkpoint that holds the previous arrays keeps
a consistent snapshot without a copy. Sparse gradients (embedding rows) are summed per unique
row and update the table and its slots in place, only those rows; Adam's rows are updated
"lazily" (only the touched rows' moments move).
"""

from __future__ import annotations

import math

import numpy as np

from tfps.api.spec import OptimizerName, OptimizerSpec

from . import _rows
from .bfloat16 import as_float32

# Each optimizer's number in its C kernels (runtime/_rows.c) and its slots, in their order.
KERNELS = {
    OptimizerName.SGD: (0, ()),
    OptimizerName.MOMENTUM: (1, ("momentum",)),
    OptimizerName.ADAM: (2, ("m", "v")),
    OptimizerName.ADAGRAD: (3, ("accumulator",)),
}
_F32 = np.float32
_F32_DTYPE = np.dtype(np.float32)
_I64_DTYPE = np.dtype(np.int64)
_INT64_MAX = np.iinfo(np.int64).max  # check_rows' bound when only the order is asked


class NonFiniteGradient(ValueError):
    """A dense gradient with a NaN or an Inf: its update was computed and not kept."""


def sum_duplicates(rows: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, each once; their values, summed over repeats)."""
    if len(rows) < 2 or _increasing(rows):  # already sorted and unique, as workers send them
        return rows, values
    uniq, inverse = np.unique(rows, return_inverse=True)
    if len(uniq) == len(rows):
        return rows, values
    summed = np.zeros((len(uniq), *values.shape[1:]), np.float32)
    np.add.at(summed, inverse.reshape(-1), values)
    return uniq, summed


def _increasing(rows: np.ndarray) -> bool:
    """Whether `rows` are strictly increasing: one pass in C for the int64 rows a PS is sent
    (a tenth of NumPy's comparison and reduction, each call of which makes a temporary)."""
    if rows.dtype == _I64_DTYPE and rows.ndim == 1 and rows.flags.c_contiguous:
        return _rows.check_rows(rows, _INT64_MAX)
    return bool((rows[1:] > rows[:-1]).all())


class ShardOptimizer:
    def __init__(self, spec: OptimizerSpec):
        self.spec = spec
        self.name = spec.name
        self._kernel, self._slots = KERNELS[self.name]
        self._lr = _F32(spec.learning_rate)
        self._momentum = _F32(spec.momentum)
        self._b1, self._b2 = _F32(spec.beta1), _F32(spec.beta2)
        self._eps = _F32(spec.epsilon)
        self._rate: tuple[int, np.float32] = (-1, _F32(0))  # (t, _adam_rate(t)) of the latest update
        # The hyperparameters in the order of the kernels' arguments; Adam's (kernel_args) change with t.
        self._hyper = {
            OptimizerName.SGD: (self._lr, 0.0, 0.0, 0.0),
            OptimizerName.MOMENTUM: (self._lr, self._momentum, 0.0, 0.0),
            OptimizerName.ADAGRAD: (self._lr, self._eps, 0.0, 0.0),
        }.get(self.name)

    def slot_names(self) -> tuple[str, ...]:
        return self._slots

    def initial_slot(self, slot: str, shape) -> np.ndarray:
        # Written whole now, not left as fresh zero pages: faulting those in at random rows
        # (huge pages, compacted on demand) makes the first steps of a large table's Adam
        # far slower than the later ones.
        return np.full(shape, self.spec.initial_accumulator if slot == "accumulator" else 0.0, np.float32)

    def _adam_rate(self, t: int) -> np.float32:
        """Adam's step size at update `t`, made once for all of an update's parts (math.sqrt is
        NumPy's sqrt of the same float64, correctly rounded both: the same float32)."""
        rate = self._rate
        if rate[0] != t:
            rate = self._rate = (
                t,
                _F32(self.spec.learning_rate * math.sqrt(1 - self.spec.beta2**t) / (1 - self.spec.beta1**t)),
            )
        return rate[1]

    def kernel_args(self, t: int) -> tuple[int, tuple[float, float, float, float]]:
        """The optimizer as its C kernels take it at update `t` (runtime/_rows.c): its number
        and its hyperparameters in its kernels' order, as float32 values."""
        if self._hyper is None:  # Adam
            return self._kernel, (self._b1, self._b2, self._adam_rate(t), self._eps)
        return self._kernel, self._hyper

    def apply_dense(
        self,
        var: np.ndarray,
        slots: dict[str, np.ndarray],
        grad: np.ndarray,
        t: int,
        plus: np.ndarray | None = None,
        scale: float = 1.0,
        check: bool = True,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One update with the gradient (grad + plus) * scale (a sync step's mean, made in the
        same pass: the other workers' sum, the last worker's gradient, 1/n); `t` (1-based) counts
        this shard's updates (Adam's bias correction). Returns the new variable and slots, written
        in one pass in C; the given arrays are left as they were. With `check`, a gradient with a
        NaN or an Inf raises NonFiniteGradient (the same pass finds it)."""
        # Kept lean: a PS makes this call for each dense variable of every push, and on a small
        # variable (a bias) its Python took longer than the update.
        if grad.dtype is not _F32_DTYPE:
            grad = as_float32(grad)  # bfloat16 off the wire
        if plus is not None and plus.dtype is not _F32_DTYPE:
            plus = as_float32(plus)
        opt, hyper = self.kernel_args(t)
        finite, new, fresh = _rows.update_dense(opt, hyper, self._slots, var, slots, grad, plus, scale)
        if check and not finite:
            raise NonFiniteGradient("the gradient contains NaN or Inf")
        return new, fresh

    def apply_sparse(
        self, var: np.ndarray, slots: dict[str, np.ndarray], rows: np.ndarray, values: np.ndarray, t: int
    ) -> None:
        """Update only `rows` (local row numbers, may repeat: repeated rows are summed) of
        `var` and its slots, in place."""
        self.apply_rows(var, slots, *sum_duplicates(rows, values), t)

    def apply_rows(
        self, var: np.ndarray, slots: dict[str, np.ndarray], rows: np.ndarray, grad: np.ndarray, t: int
    ) -> None:
        """`apply_sparse` for rows given once each (`sum_duplicates`' output): one pass over
        them in C (runtime/_rows.c: the same float operations as `apply_dense`, row by row)."""
        if grad.dtype is not _F32_DTYPE:
            grad = as_float32(grad)
        opt, hyper = self.kernel_args(t)
        _rows.update_rows(opt, hyper, self._slots, var, slots, rows, grad)
