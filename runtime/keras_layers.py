"""Keras layers whose variables live on the PS.

`Embedding` takes the place of `keras.layers.Embedding` (the same constructor): trained by
tfps, its table is a sparse PS parameter, pulled and updated by rows, so a worker holds only
the rows its batches touch (runtime/keras_model.py finds the ids that reach it). Outside tfps
(`model.fit`, a loaded export) it is a plain Embedding.

    from tfps.runtime.keras_layers import Embedding
"""

from __future__ import annotations

import keras
from keras import ops

from . import keras_tables


@keras.saving.register_keras_serializable(package="tfps")
class Embedding(keras.layers.Embedding):
    """keras.layers.Embedding whose table stays on the PS when tfps trains the model."""

    def build(self, input_shape=None):
        if self.built or not keras_tables.tables_on_ps_now():
            super().build(input_shape)
            return
        # Built for training by tfps: the table is on the PS, so this process keeps one row in its place.
        self._embeddings = self.add_weight(shape=(1, self.output_dim), initializer="zeros", name="embeddings")
        self.built = True

    def call(self, inputs):
        given = keras_tables.given_table(self)
        if given is None:
            return super().call(inputs)
        table, ids = given
        ids = inputs if ids is None else ids
        if ids.dtype not in ("int32", "int64"):
            ids = ops.cast(ids, "int32")
        return ops.cast(ops.take(table, ids, axis=0), self.compute_dtype)
