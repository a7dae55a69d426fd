"""The PS optimizers (TensorFlow fused training ops) against the textbook update rules."""
import numpy as np
import pytest
import tensorflow as tf

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
    var = tf.Variable(W0)
    slots = {s: tf.Variable(opt.initial_slot(s, W0.shape)) for s in opt.slot_names()}
    return spec, opt, var, slots


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_dense_update_matches_the_textbook_rule(name):
    spec, opt, var, slots = _setup(name)
    for t, g in enumerate(GRADS, start=1):
        opt.apply_dense(var, slots, tf.constant(g), t)
    np.testing.assert_allclose(var.numpy(), reference(name, spec, W0, GRADS), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_sparse_update_moves_only_the_touched_rows(name):
    spec, opt, var, slots = _setup(name)
    rows = np.array([4, 1, 4], np.int64)  # a repeated row is summed
    values = RNG.normal(size=(3, 3)).astype(np.float32)
    opt.apply_sparse(var, slots, rows, values, 1)
    after = var.numpy()
    untouched = [0, 2, 3, 5]
    np.testing.assert_array_equal(after[untouched], W0[untouched])
    dense = np.zeros_like(W0)
    np.add.at(dense, rows, values)
    expected = reference(name, spec, W0, [dense])
    np.testing.assert_allclose(after[[1, 4]], expected[[1, 4]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_one_graph_call_for_all_variables_matches_op_by_op(name):
    spec, opt, var, slots = _setup(name)
    other = tf.Variable(W0[:2])
    other_slots = {s: tf.Variable(opt.initial_slot(s, (2, 3))) for s in opt.slot_names()}
    apply = opt.dense_applier({"a": var, "b": other}, {"a": slots, "b": other_slots})
    for t, g in enumerate(GRADS, start=1):
        apply({"a": g, "b": g[:2]}, t)
    expected = reference(name, spec, W0, GRADS)
    np.testing.assert_allclose(var.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(other.numpy(), expected[:2], rtol=1e-5, atol=1e-6)
