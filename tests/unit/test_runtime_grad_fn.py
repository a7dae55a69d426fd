"""The worker's gradient function (runtime/worker.py `make_grad_fn`): one trace per input
dtypes, called with its inputs flattened, gives the gradients a plain GradientTape does, a
table's rows summed (runtime/_rows.c `segment_sum`) bit for bit as TensorFlow sums them."""

import numpy as np
import pytest
import tensorflow as tf

from tfps.runtime import _rows
from tfps.runtime.models import BatchSource, load_model
from tfps.runtime.worker import loss_fn, make_grad_fn

ARGS = {"vocabSize": 2_000, "fields": 4, "embeddingDim": 8, "hidden": [16], "samples": 1024, "testSamples": 0}


def _inputs(model, batches, step: int, rng) -> tuple[dict, dict, np.ndarray]:
    """A batch with its ids remapped onto the batch's unique ids, and those rows of each table
    (a different number of rows each batch), as a worker has them."""
    x, y = batches(step)
    params = {}
    for p in model.params:
        if p.sparse:
            uniq, inverse = np.unique(x[p.feature].reshape(-1), return_inverse=True)
            params[p.name] = rng.standard_normal((len(uniq), *p.shape[1:])).astype(np.float32)
            remapped = inverse.reshape(x[p.feature].shape).astype(np.int64)
        else:
            params[p.name] = rng.standard_normal(p.shape).astype(np.float32) * 0.1
    return params, {**x, model.sparse_params[0].feature: remapped}, y


def _taped(model, params, x, y):
    tensors = {k: tf.constant(v) for k, v in params.items()}
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        loss = loss_fn(model.loss, model.forward(tensors, {k: tf.constant(v) for k, v in x.items()}), tf.constant(y))
    return loss, tape.gradient(loss, tensors)


def test_flattened_calls_give_the_tapes_gradients_for_batches_of_any_row_count():
    model = load_model("wide-deep", ARGS, 0)
    train, _ = model.data()
    batches, rng = BatchSource(train, 0, 64, 0, 1), np.random.default_rng(0)
    grad_fn = make_grad_fn(model)
    rows_seen = set()
    for step in range(3):
        params, x, y = _inputs(model, batches, step, rng)
        rows_seen.add(len(params[model.sparse_params[0].name]))
        # the parameters in another key order than the trace's: the flattening sorts them
        shuffled = dict(reversed(list(params.items())))
        loss, grads = grad_fn(
            {k: tf.constant(v) for k, v in shuffled.items()}, {k: tf.constant(v) for k, v in x.items()}, tf.constant(y)
        )
        want_loss, want = _taped(model, params, x, y)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
        assert set(grads) == set(params)
        for name, grad in grads.items():
            np.testing.assert_allclose(
                np.asarray(grad), np.asarray(tf.convert_to_tensor(want[name])), rtol=1e-5, atol=1e-7
            )
        for table in model.sparse_params:  # one row per id looked up, repeats too: summed as TensorFlow sums them
            slices = want[table.name]
            assert isinstance(slices, tf.IndexedSlices)
            summed = np.empty(grads[table.name].shape, np.float32)
            _rows.segment_sum(
                slices.values.numpy().reshape(len(slices.values), -1),
                slices.indices.numpy().astype(np.int64),
                summed.reshape(len(summed), -1),
            )
            np.testing.assert_array_equal(summed, tf.convert_to_tensor(slices).numpy())
    assert len(rows_seen) > 1  # the same trace served batches of different row counts


def test_segment_sum_adds_each_ids_row_into_its_table_row_and_refuses_a_row_outside():
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = np.full((3, 3), 7.0, np.float32)  # overwritten, not added to
    _rows.segment_sum(values, np.array([2, 0, 2, 2], np.int64), out)
    np.testing.assert_array_equal(out, [[3, 4, 5], [0, 0, 0], [0 + 6 + 9, 1 + 7 + 10, 2 + 8 + 11]])
    with pytest.raises(ValueError, match="row 3 is outside the table's 3 rows"):
        _rows.segment_sum(values, np.array([0, 1, 3, 0], np.int64), out)
    with pytest.raises(ValueError, match="indices"):
        _rows.segment_sum(values, np.array([0, 1], np.int64), out)
    with pytest.raises(TypeError, match="int64"):
        _rows.segment_sum(values, np.array([0, 1, 2, 0], np.int32), out)


def test_segment_sum_takes_subnormal_floats_as_zero_as_tensorflows_sum_does():
    values = np.full((4, 3), 1e-39, np.float32)
    indices = np.array([0, 0, 1, 2], np.int64)
    out = np.empty((3, 3), np.float32)
    _rows.segment_sum(values, indices, out)
    np.testing.assert_array_equal(out, tf.math.unsorted_segment_sum(values, indices, 3).numpy())
    np.testing.assert_array_equal(out, 0)
