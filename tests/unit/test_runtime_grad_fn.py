"""The worker's gradient function (runtime/worker.py `make_grad_fn`): one trace per input
dtypes, called with its inputs flattened, gives the gradients a plain GradientTape does."""
import numpy as np
import pytest
import tensorflow as tf

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
        loss, grads = grad_fn({k: tf.constant(v) for k, v in shuffled.items()}, {k: tf.constant(v) for k, v in x.items()},
                              tf.constant(y))
        want_loss, want = _taped(model, params, x, y)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
        assert set(grads) == set(params)
        for name, grad in grads.items():
            np.testing.assert_allclose(np.asarray(grad), np.asarray(tf.convert_to_tensor(want[name])), rtol=1e-5, atol=1e-7)
    assert len(rows_seen) > 1  # the same trace served batches of different row counts
