"""Built-in models and the data order: same seed, same batches; sync sharding adds up."""

import numpy as np
import pytest

from tfps.runtime.models import BatchSource, Dataset, ModelDef, load_model


def test_n_workers_batches_union_is_the_single_worker_batch():
    data = Dataset({"x": np.arange(100, dtype=np.float32)[:, None]}, np.arange(100))
    single = BatchSource(data, seed=3, batch=24)
    parts = [BatchSource(data, seed=3, batch=8, worker=w, num_workers=3) for w in range(3)]
    for step in range(10):  # crosses epoch boundaries
        np.testing.assert_array_equal(np.concatenate([p.indices(step) for p in parts]), single.indices(step))


@pytest.mark.parametrize("batch", [7, 10, 64])
def test_batches_are_positions_of_each_epochs_permutation(batch):
    """Batch `s` of worker `w` is positions s*G + w*batch ... of the stream of epoch permutations,
    inside one epoch and across a boundary alike; each epoch shows every example once."""
    data = Dataset({"x": np.zeros((50, 1), np.float32)}, np.arange(50))
    workers = [BatchSource(data, 5, batch, worker=w, num_workers=2) for w in range(2)]
    stream = np.concatenate([np.random.default_rng([5, e]).permutation(50) for e in range(60)])
    for step in range(20):
        for w, source in enumerate(workers):
            start = (step * 2 + w) * batch
            np.testing.assert_array_equal(source.indices(step), stream[start : start + batch])
    assert sorted(stream[:50]) == list(range(50))


def test_same_seed_same_order_other_seed_other_order():
    data = Dataset({"x": np.zeros((50, 1), np.float32)}, np.arange(50))
    a, b, c = (BatchSource(data, s, 10) for s in (1, 1, 2))
    assert (a.indices(3) == b.indices(3)).all() and not (a.indices(3) == c.indices(3)).all()


def test_digits_has_a_held_out_test_split():
    train, test = load_model("digits-mlp", {}, seed=0).data()
    assert len(train) + len(test) == 1797 and 300 < len(test) < 400
    assert train.x["x"].shape[1] == 64 and train.x["x"].max() <= 1.0


def test_mlp_is_sized_by_model_args():
    model = load_model("mlp", {"inputDim": 20, "hidden": [8, 4], "classes": 3, "samples": 64, "testSamples": 16})
    assert [p.shape for p in model.params] == [(20, 8), (8,), (8, 4), (4,), (4, 3), (3,)]
    train, test = model.data()
    assert train.x["x"].shape == (64, 20) and len(test) == 16 and set(np.unique(train.y)) <= {0, 1, 2}


def test_initial_values_are_deterministic():
    p = load_model("digits-mlp").params[0]
    np.testing.assert_array_equal(p.initial_value(0), p.initial_value(0))
    assert not np.array_equal(p.initial_value(0), p.initial_value(1))


def test_user_model_by_module_and_function():
    model = load_model("test_runtime_models:tiny_model", {"n": 3})
    assert isinstance(model, ModelDef) and model.params[0].shape == (3, 2)
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model")


def tiny_model(model_args, seed):
    from tfps.runtime.models import Param

    n = model_args["n"]
    return ModelDef(
        params=[Param("w", (n, 2))],
        forward=lambda p, x: x["x"] @ p["w"],
        data=lambda: (Dataset({"x": np.ones((8, n), np.float32)}, np.zeros(8, np.int64)), None),
    )
