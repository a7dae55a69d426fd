"""A Keras model as a ModelDef (runtime/keras_model.py) and examples read from files
(runtime/filedata.py): the parameters and their initial values, the gradients against Keras's
own, the worker's non-trainable state, the sharding rule and the feature spec."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tfps.api.spec import DataSpec
from tfps.runtime.filedata import FileBatches, feature_spec, list_files, shard_files

MODEL = textwrap.dedent(
    """
    import keras


    def model(model_args, seed):
        x = keras.Input((3,), name="x")
        colour = keras.Input((1,), name="colour", dtype="string")
        onehot = keras.layers.StringLookup(vocabulary=["red", "blue"], output_mode="one_hot")(colour)
        h = keras.layers.Dense(4, activation="relu")(keras.layers.Concatenate()([x, onehot]))
        h = keras.layers.BatchNormalization()(h)
        out = keras.layers.Dense(model_args.get("units", 1), activation=model_args.get("activation", "sigmoid"))(h)
        m = keras.Model({"x": x, "colour": colour}, out)
        if model_args.get("loss"):
            m.compile(loss=model_args["loss"])
        return m
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "kerasmodel.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "kerasmodel:model"


def _batch(n=8):
    rng = np.random.default_rng(0)
    x = {"x": rng.normal(size=(n, 3)).astype(np.float32), "colour": np.array([["red"], ["blue"]] * (n // 2), object)}
    return x, (np.arange(n) % 2).astype(np.int64)


def test_a_keras_model_becomes_params_with_its_own_initial_weights(user_module):
    from tfps.runtime.models import load_model

    model = load_model(user_module, {"loss": "binary_crossentropy"}, seed=3)
    keras_model = model.extra["keras"]
    assert [p.name for p in model.params] == [v.path for v in keras_model.trainable_variables]
    for p, v in zip(model.params, keras_model.trainable_variables, strict=True):
        np.testing.assert_array_equal(p.initial_value(3), v.numpy())
    assert (model.loss, model.outputs) == ("sigmoid", "probabilities")
    assert model.inputs == {"x": ("float32", (3,)), "colour": ("string", (1,))}


def test_a_ps_gets_the_same_params_from_a_child_and_never_imports_tensorflow(user_module):
    """load_params builds the model in a child process; two PS get the same initial values."""
    code = (
        "import sys, pickle; from tfps.runtime.models import load_params\n"
        f"params = load_params({user_module!r}, {{}}, 5)\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n"
        "sys.stdout.buffer.write(pickle.dumps({p.name: p.initial_value(5) for p in params}))"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True) for _ in range(2)]
    import pickle

    first, second = (pickle.loads(r.stdout) for r in runs)
    assert first.keys() == second.keys() and "dense/kernel" in first
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])


@pytest.mark.parametrize(
    "args,kind",
    [
        ({"loss": "binary_crossentropy"}, "sigmoid"),
        ({"activation": None, "loss": "__logits__"}, "sigmoid"),
        ({"units": 3, "activation": "softmax", "loss": "sparse_categorical_crossentropy"}, "softmax"),
        ({"units": 3, "activation": None}, "softmax"),  # not compiled: cross-entropy on logits
    ],
)
def test_the_gradients_are_those_of_the_models_own_loss(user_module, args, kind):
    import keras
    import tensorflow as tf

    from tfps.runtime.models import load_model
    from tfps.runtime.worker import make_grad_fn

    if args.get("loss") == "__logits__":
        args = {**args, "loss": keras.losses.BinaryCrossentropy(from_logits=True)}
    model = load_model(user_module, args, seed=1)
    assert model.loss == kind
    keras_model = model.extra["keras"]
    x, y = _batch()
    if kind == "softmax":
        y = np.arange(8) % 3
    params = {p.name: tf.constant(p.initial_value(1)) for p in model.params}
    loss, grads = make_grad_fn(model)(params, {k: tf.constant(v) for k, v in x.items()}, tf.constant(y))

    reference = keras.losses.get(args["loss"]) if args.get("loss") else None
    if reference is None:
        reference = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        out = keras_model(x, training=True)
        labels = tf.cast(tf.reshape(y, (-1, 1)), tf.float32) if kind == "sigmoid" else y
        expected = tf.reduce_mean(reference(labels, out))
    expected_grads = tape.gradient(expected, keras_model.trainable_variables)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
    for v, g in zip(keras_model.trainable_variables, expected_grads, strict=True):
        np.testing.assert_allclose(grads[v.path].numpy(), g.numpy(), rtol=1e-4, atol=1e-6)


def test_a_workers_moving_statistics_follow_its_batches_and_serve_evaluation(user_module):
    import tensorflow as tf

    from tfps.runtime.models import Dataset, load_model
    from tfps.runtime.worker import evaluate, make_grad_fn

    model = load_model(user_module, {"loss": "binary_crossentropy"}, seed=1)
    moving_mean = next(v for v in model.extra["keras"].non_trainable_variables if "moving_mean" in v.path)
    before = moving_mean.numpy().copy()
    x, y = _batch()
    params = {p.name: tf.constant(p.initial_value(1)) for p in model.params}
    make_grad_fn(model)(params, {k: tf.constant(v) for k, v in x.items()}, tf.constant(y))
    after = moving_mean.numpy().copy()
    assert not np.allclose(before, after)  # the training step moved them
    figures = evaluate(model, {k: v.numpy() for k, v in params.items()}, Dataset(x, y))
    assert set(figures) == {"accuracy", "auc"}
    np.testing.assert_array_equal(moving_mean.numpy(), after)  # evaluation reads, never moves them


def test_files_go_to_workers_by_position_or_records_by_stride():
    files = [f"f{i}" for i in range(5)]
    assert shard_files(files, 1, 2) == (["f1", "f3"], 1)
    assert shard_files(files, 4, 5) == (["f4"], 1)
    assert shard_files(files[:2], 2, 3) == (["f0", "f1"], 3)


def test_the_feature_spec_comes_from_the_model_inputs_or_the_data_section():
    data = DataSpec.model_validate({"train": {"files": "x", "format": "csv"}, "label": "y"})
    inputs = {"x": ("float32", (3,)), "c": ("string", (1,))}
    assert feature_spec(data, inputs) == {**inputs, "y": ("int64", ())}
    explicit = DataSpec.model_validate(
        {
            "train": {"files": "x", "format": "csv"},
            "label": "y",
            "features": {"a": {"dtype": "int64"}, "y": {"dtype": "float32"}},
        }
    )
    assert feature_spec(explicit, inputs) == {"a": ("int64", ()), "y": ("float32", ())}
    with pytest.raises(ValueError, match="unknown dimension"):
        feature_spec(data, {"x": ("float32", (None,))})
    with pytest.raises(ValueError, match="compression 'gzip'"):
        DataSpec.model_validate({"train": {"files": "x", "format": "tfrecord", "compression": "gzip"}, "label": "y"})


def test_a_glob_matching_nothing_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches .*nothing-here"):
        list_files(str(tmp_path / "nothing-here" / "*.csv"))


def _csv(path, rows, header="a,c,y"):
    path.write_text(header + "\n" + "".join(f"{r}\n" for r in rows))


def test_csv_batches_every_record_once_per_epoch_and_counts_bad_lines(tmp_path):
    _csv(tmp_path / "0.csv", [f"{i},c{i % 3},{i % 2}" for i in range(50)] + ["oops,c,1"])
    _csv(tmp_path / "1.csv", [f"{i},c{i % 3},{i % 2}" for i in range(50, 100)])
    data = DataSpec.model_validate(
        {
            "train": {"files": str(tmp_path / "*.csv"), "format": "csv"},
            "label": "y",
            "shuffleBuffer": 16,
            "onBadRecord": "skip",
        }
    )
    spec = {"a": ("float32", ()), "c": ("string", (1,)), "y": ("int64", ())}
    bad = []
    batches = FileBatches(data, data.train, spec, 8, seed=0, epochs=2, on_bad_record=bad.append)
    seen = []
    step = 0
    while batches.has(step):
        x, y = batches(step)
        assert x["c"].shape == (len(y), 1) and x["c"].dtype == object
        seen += x["a"].tolist()
        step += 1
    assert sorted(seen) == sorted([float(i) for i in range(100)] * 2)
    assert seen[:100] != sorted(seen[:100])  # shuffled
    assert bad == [1, 1]  # the bad line, once per epoch


def test_a_missing_or_mistyped_feature_is_refused_naming_it(tmp_path):
    _csv(tmp_path / "0.csv", ["1,2,0"], header="a,b,y")
    data = DataSpec.model_validate({"train": {"files": str(tmp_path / "*.csv"), "format": "csv"}, "label": "y"})
    with pytest.raises(ValueError, match="feature 'c' is not a column"):
        FileBatches(data, data.train, {"a": ("float32", ()), "c": ("float32", ()), "y": ("int64", ())}, 4, 0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": ["x"], "y": [1]}), str(tmp_path / "0.parquet"))
    data = DataSpec.model_validate({"train": {"files": str(tmp_path / "*.parquet"), "format": "parquet"}, "label": "y"})
    with pytest.raises(ValueError, match="feature 'a'.*not readable as float32"):
        FileBatches(data, data.train, {"a": ("float32", ()), "y": ("int64", ())}, 4, 0)


TABLES_MODEL = textwrap.dedent(
    """
    import keras
    from tfps.runtime.keras_layers import Embedding


    def model(model_args, seed):
        colour = keras.Input((1,), name="colour", dtype="string")
        item = keras.Input((2,), name="item", dtype="int64")
        x = keras.Input((2,), name="x")
        layer = Embedding if model_args.get("tfps", True) else keras.layers.Embedding
        looked_up = keras.layers.StringLookup(vocabulary=["red", "blue"], name="lookup")(colour)
        if model_args.get("trained_ids"):  # ids from a trainable layer: refused
            looked_up = keras.layers.Dense(1, name="ids")(x)
        a = keras.layers.Flatten()(layer(3, 4, name="colour_emb")(looked_up))
        b = keras.layers.Flatten()(layer(model_args.get("rows", 2_000_000), 3, name="item_emb")(item))
        h = keras.layers.Dense(4, activation="relu", name="h")(keras.layers.Concatenate()([x, a, b]))
        out = keras.layers.Dense(1, activation="sigmoid", name="out")(h)
        m = keras.Model({"x": x, "colour": colour, "item": item}, out)
        m.compile(loss="binary_crossentropy")
        return m
    """
)


@pytest.fixture
def tables_module(tmp_path, monkeypatch):
    (tmp_path / "kerastables.py").write_text(TABLES_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kerastables:model"


def _ids_batch():
    x = {
        "x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2),
        "colour": np.array([["red"], ["blue"], ["pink"], ["red"]], object),
        "item": np.array([[5, 7], [1_999_999, 5], [0, 1], [7, 7]], np.int64),
    }
    return x, np.array([1, 0, 1, 0], np.int64)


def test_a_tfps_embedding_becomes_a_sparse_param_over_the_ids_that_reach_it(tables_module):
    from tfps.runtime.models import load_model

    model = load_model(tables_module, {}, seed=2)
    tables = {p.name: p for p in model.params if p.sparse}
    assert tables["colour_emb/embeddings"].shape == (3, 4) and tables["item_emb/embeddings"].shape == (2_000_000, 3)
    assert {p.feature for p in tables.values()} == {"colour_emb:ids", "item_emb:ids"}
    assert {p.init for p in tables.values()} == {"uniform:0.05"}  # Keras's default, drawn by the PS
    # built to be trained, the worker's Keras model keeps one row in each table's place
    shapes = {v.path: tuple(v.shape) for v in model.extra["keras"].trainable_variables}
    assert shapes["colour_emb/embeddings"] == (1, 4) and shapes["item_emb/embeddings"] == (1, 3)
    x, _ = _ids_batch()
    derived = model.derive(x)
    np.testing.assert_array_equal(derived["item_emb:ids"], x["item"])  # a model input: taken as it is
    np.testing.assert_array_equal(derived["colour_emb:ids"], [[1], [2], [0], [1]])  # the lookup's ids
    x["item"][0, 0] = 2_000_000
    with pytest.raises(ValueError, match=r"item_emb:ids: ids outside \[0, 2000000\)"):
        model.derive(x)
    rows = tables["item_emb/embeddings"].initial_rows(2, 1_999_990, 2_000_000)
    assert rows.shape == (10, 3) and np.abs(rows).max() <= 0.05


def test_ids_from_a_trainable_layer_are_refused(tables_module):
    from tfps.runtime.models import load_model

    with pytest.raises(ValueError, match="colour_emb depend on trainable weights"):
        load_model(tables_module, {"trained_ids": True}, seed=2)


def test_a_tfps_embeddings_rows_give_the_gradients_of_a_plain_embedding(tables_module):
    """The worker's view (the batch's rows, its ids remapped onto them) against the same model
    with plain Embeddings and whole tables holding the same values."""
    import tensorflow as tf

    from tfps.runtime.models import load_model
    from tfps.runtime.sharding import batch_ids
    from tfps.runtime.worker import make_grad_fn

    model = load_model(tables_module, {"rows": 2_000_000}, seed=2)
    plain = load_model(tables_module, {"rows": 2_000_000, "tfps": False}, seed=2)
    assert not plain.sparse_params
    whole = {p.name: p.initial_value(2) for p in model.params}
    x, y = _ids_batch()
    derived = model.derive(x)
    rows, features = {}, dict(derived)
    for p in model.sparse_params:
        uniq, features[p.feature] = batch_ids(derived[p.feature])
        rows[p.name] = whole[p.name][uniq]
    params = {k: tf.constant(rows.get(k, v)) for k, v in whole.items()}
    loss, grads = make_grad_fn(model)(params, {k: tf.constant(v) for k, v in features.items()}, tf.constant(y))
    plain_loss, plain_grads = make_grad_fn(plain)(
        {k: tf.constant(v) for k, v in whole.items()}, {k: tf.constant(v) for k, v in x.items()}, tf.constant(y)
    )
    np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
    for p in model.params:
        expected = np.asarray(plain_grads[p.name])
        if p.sparse:
            uniq, _ = batch_ids(derived[p.feature])
            assert np.asarray(grads[p.name]).shape[0] == len(uniq) <= p.shape[0]
            expected = expected[uniq]
        np.testing.assert_allclose(np.asarray(grads[p.name]), expected, rtol=1e-5, atol=1e-7)


def test_a_model_with_a_tfps_embedding_saves_and_loads_as_a_keras_file(tables_module, tmp_path):
    import keras
    import tensorflow as tf
    from kerastables import model as build

    from tfps.runtime.keras_layers import Embedding

    model = build({"rows": 50}, 0)  # built outside tfps: a whole table
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("item_emb"), Embedding)
    x, _ = _ids_batch()
    x["item"] %= 50
    x = {k: tf.constant(v) for k, v in x.items()}
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)
