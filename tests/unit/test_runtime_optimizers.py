"""The PS optimizers (NumPy) against the textbook update rules."""
import ml_dtypes
import numpy as np
import pytest

from tfps.runtime.optimizers import ShardOptimizer
from tfps.api.spec import OptimizerSpec

RNG = np.random.default_rng(0)
W0 = RNG.normal(size=(6, 3)).astype(np.float32)
GRADS = [RNG.normal(size=(6, 3)).astype(np.float32) for _ in range(3)]


def reference(name: str, spec: OptimizerSpec, w, grads):
    w = w.astype(np.float64).copy()
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    acc = np.full_like(w, spec.initial_accumulator)
    lr = spec.learning_rate
    for t, g in enumerate(grads, start=1):
        if name == "sgd":
            w -= lr * g
        elif name == "momentum":
            m = spec.momentum * m + g
            w -= lr * m
        elif name == "adam":
            m = spec.beta1 * m + (1 - spec.beta1) * g
            v = spec.beta2 * v + (1 - spec.beta2) * g * g
            lr_t = lr * np.sqrt(1 - spec.beta2 ** t) / (1 - spec.beta1 ** t)
            w -= lr_t * m / (np.sqrt(v) + spec.epsilon)
        elif name == "adagrad":
            acc += g * g
            w -= lr * g / (np.sqrt(acc) + spec.epsilon)
    return w


def _setup(name):
    spec = OptimizerSpec(name=name, learning_rate=0.05)
    opt = ShardOptimizer(spec)
    var = W0.copy()
    slots = {s: opt.initial_slot(s, W0.shape) for s in opt.slot_names()}
    return spec, opt, var, slots


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_dense_update_matches_the_textbook_rule(name):
    spec, opt, var, slots = _setup(name)
    for t, g in enumerate(GRADS, start=1):
        before = {"var": var.copy(), **{s: a.copy() for s, a in slots.items()}}
        new_var, new_slots = opt.apply_dense(var, slots, g, t)
        # the given arrays are left as they were: a reader holding them keeps a consistent copy
        np.testing.assert_array_equal(var, before["var"])
        for s, a in slots.items():
            np.testing.assert_array_equal(a, before[s])
        var, slots = new_var, {**slots, **new_slots}
    np.testing.assert_allclose(var, reference(name, spec, W0, GRADS), rtol=1e-5, atol=1e-6)


def test_a_bfloat16_dense_gradient_is_applied_as_float32():
    spec, opt, var, slots = _setup("sgd")
    grad = GRADS[0].astype(ml_dtypes.bfloat16)
    new_var, _ = opt.apply_dense(var, slots, grad, 1)
    np.testing.assert_allclose(new_var, reference("sgd", spec, W0, [grad.astype(np.float32)]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", [[4, 1, 4], [1, 4, 4], [1, 4], [4, 1]])  # a repeated row is summed, in any order
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_sparse_update_moves_only_the_touched_rows(name, order):
    spec, opt, var, slots = _setup(name)
    rows = np.array(order, np.int64)
    values = RNG.normal(size=(len(rows), 3)).astype(np.float32)
    opt.apply_sparse(var, slots, rows, values, 1)
    after = var
    untouched = [0, 2, 3, 5]
    np.testing.assert_array_equal(after[untouched], W0[untouched])
    dense = np.zeros_like(W0)
    np.add.at(dense, rows, values)
    expected = reference(name, spec, W0, [dense])
    np.testing.assert_allclose(after[[1, 4]], expected[[1, 4]], rtol=1e-5, atol=1e-6)
