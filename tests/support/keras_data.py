"""A user's Keras model and its data, as the tests that train one from files write them: a small
wide-and-deep (a string feature through StringLookup and an Embedding, numeric features through
BatchNormalization) over synthetic examples whose label is a linear teacher over the numbers plus
a per-category offset. Import as `from support.keras_data import MODEL, examples, ...`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

ACCURACY_AT_LEAST = 0.85  # the teacher's labels are noiseless; a model that learned nothing scores about 0.5
CATEGORIES = ["red", "green", "blue", "black"]
OFFSET = {"red": 1.5, "green": -1.5, "blue": 0.5, "black": -0.5}

# The module a user writes; modelArgs: {"colours": CATEGORIES}.
MODEL = textwrap.dedent(
    """
    import keras


    def wide_deep(model_args, seed):
        numeric = keras.Input((2,), name="x", dtype="float32")
        colour = keras.Input((1,), name="colour", dtype="string")
        ids = keras.layers.StringLookup(vocabulary=model_args["colours"], name="lookup")(colour)
        embedded = keras.layers.Flatten()(keras.layers.Embedding(len(model_args["colours"]) + 1, 4, name="emb")(ids))
        deep = keras.layers.BatchNormalization(name="bn")(numeric)
        h = keras.layers.Dense(16, activation="relu", name="hidden")(keras.layers.Concatenate()([deep, embedded]))
        out = keras.layers.Dense(1, activation="sigmoid", name="out")(h)
        model = keras.Model({"x": numeric, "colour": colour}, out)
        model.compile(loss="binary_crossentropy", metrics=["accuracy"])
        return model
    """
)

# The same model with the table on the PS: modelArgs' `rows` sizes it (the lookup's ids reach only the first few).
TFPS_MODEL = MODEL.replace("import keras\n", "import keras\nfrom tfps.runtime.keras_layers import Embedding\n").replace(
    'keras.layers.Embedding(len(model_args["colours"]) + 1,',
    'Embedding(model_args.get("rows", len(model_args["colours"]) + 1),',
)


def examples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(numbers, colours, labels) of n examples."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)).astype(np.float32)
    colour = rng.choice(CATEGORIES, n)
    logit = 2.0 * x[:, 0] - 1.0 * x[:, 1] + np.array([OFFSET[c] for c in colour])
    return x, colour, (logit > 0).astype(np.int64)


def write_tfrecord(path: Path, x, colour, y, compression: str | None = None) -> None:
    """The examples as tf.train.Example records, readable by every user (pods run as another uid)."""
    import tensorflow as tf

    options = tf.io.TFRecordOptions(compression_type=compression or "")
    with tf.io.TFRecordWriter(str(path), options) as writer:
        for i in range(len(y)):
            feature = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                "colour": tf.train.Feature(bytes_list=tf.train.BytesList(value=[colour[i].encode()])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
            }
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    Path(path).chmod(0o644)
