"""A user's Keras model (Keras 3, built, not trained) as a ModelDef's fields (models.load_model
makes the ModelDef), so that the PS and worker paths train it as they train any other model.

- Each trainable variable is a Param named by its `path` ("dense/kernel"), initialised with the
  model's own weights: the model is built under `keras.utils.set_random_seed(seed)`, so every
  process that builds it (a PS's child, each worker) gets the same values.
- `forward` is `model.stateless_call(trainable, non_trainable, features, training=True)` on the
  parameters the worker pulled. The non-trainable state (BatchNormalization's moving statistics,
  dropout's seed) is the worker's own: each step's new values are written back into this
  process's model, the PS never sees them, and worker 0's go into the evaluation and the export.
- The loss is the model's compiled loss (`model.loss`), with its `from_logits`; an uncompiled
  model gets binary cross-entropy for one output unit and sparse categorical cross-entropy for
  more. How evaluation reads the outputs ("sigmoid" or "softmax") follows from the loss.
- A `tfps.runtime.keras_layers.Embedding`'s table is a sparse Param, pulled and updated by rows.
  Its ids are a model input, or computed from the inputs by layers without trainable weights
  (StringLookup, IntegerLookup, Hashing): `derive` computes them from a batch before its rows
  are pulled, as the feature `<layer name>:ids`, which the worker remaps onto the batch's rows.
  Built for training, the layer keeps one row in the table's place; the export builds the
  model again with whole tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .keras_tables import giving

# Compiled losses by name -> how evaluation reads the outputs.
_BINARY = {"binary_crossentropy", "binary_focal_crossentropy"}
_CLASSES = {"sparse_categorical_crossentropy"}
_PROBABILITY_ACTIVATIONS = {"sigmoid", "softmax"}


def seeded(seed: int, build: Callable[[], Any]):
    """`build()` under Keras's global seed, in a fresh Keras session (layer names counted from
    the start): the same seed gives the same variable paths and initial weights."""
    import keras

    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    return build()


def _input_spec(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError(
            f"Keras model {model.name!r} has no defined inputs: build it on keras.Input(...) "
            "(a Sequential model starts with keras.Input)"
        )
    out = {}
    for tensor in inputs:
        shape = tuple(tensor.shape[1:])
        out[tensor.name] = (str(tensor.dtype), shape)
    return out


def _loss(model) -> tuple[str, bool, Any]:
    """(kind, from_logits, Keras loss object or function) of the model's training loss."""
    import keras

    compiled = getattr(model, "loss", None)
    units = model.outputs[0].shape[-1] if getattr(model, "outputs", None) else None
    if compiled is None:  # not compiled: cross-entropy on what the last layer's activation gives
        activation = getattr(getattr(model.layers[-1], "activation", None), "__name__", "linear")
        from_logits = activation not in _PROBABILITY_ACTIVATIONS
        if units == 1:
            return "sigmoid", from_logits, keras.losses.BinaryCrossentropy(from_logits=from_logits)
        return "softmax", from_logits, keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    if isinstance(compiled, (list, tuple, dict)):
        raise ValueError("a Keras model with several losses (several outputs) is not supported yet")
    loss = keras.losses.get(compiled)
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        name, from_logits = config.get("name", ""), bool(config.get("from_logits", False))
    else:
        name, from_logits = getattr(loss, "__name__", ""), False
    kind = "sigmoid" if name in _BINARY else "softmax" if name in _CLASSES else "other"
    return kind, from_logits, loss


def _objective(kind: str, loss) -> Callable:
    import keras
    import tensorflow as tf

    per_example = not isinstance(loss, keras.losses.Loss)

    def objective(y, outputs):
        if kind == "sigmoid":  # 0/1 labels, one per output unit
            y = tf.reshape(tf.cast(y, outputs.dtype), tf.shape(outputs))
        elif kind == "other":
            y = tf.cast(y, outputs.dtype)
        value = loss(y, outputs)
        return tf.reduce_mean(value) if per_example else value

    return objective


def _table_init(layer) -> str:
    """The Param initialiser of a PS-held table: the PS draws its rows, as the layer's initialiser would."""
    init = layer.embeddings_initializer
    config, kind = init.get_config(), type(init).__name__
    if kind == "RandomUniform" and np.isclose(config["minval"], -config["maxval"]):
        return f"uniform:{config['maxval']}"
    if kind == "RandomNormal" and config.get("mean", 0.0) == 0.0:
        return f"normal:{config['stddev']}"
    if kind == "Zeros":
        return "zeros"
    raise ValueError(
        f"tfps Embedding {layer.name!r}: embeddings_initializer {kind} is not supported "
        "(use 'uniform', RandomUniform(-a, a), RandomNormal(0, s) or 'zeros')"
    )


def _tables(model) -> list[tuple[Any, Any]]:
    """(layer, the KerasTensor of its ids) of each tfps Embedding in the model."""
    from .keras_layers import Embedding

    found = []
    for layer in model._flatten_layers(include_self=False):
        if not isinstance(layer, Embedding):
            continue
        if len(layer._inbound_nodes) != 1:
            raise ValueError(f"tfps Embedding {layer.name!r} must be applied once in the model (its ids feed its rows)")
        found.append((layer, layer.input))
    return found


def _derive(model, tables: list, model_inputs: Callable) -> Callable[[dict], dict] | None:
    """`derive(features)`: the features plus each table's ids (`<layer>:ids`), computed by the
    model's layers between its inputs and the table, which must have no trainable weights."""
    import keras
    import tensorflow as tf

    if not tables:
        return None
    by_input = {id(t): t.name for t in model.inputs}
    copied = {f"{layer.name}:ids": by_input[id(ids)] for layer, ids in tables if id(ids) in by_input}
    computed = [(f"{layer.name}:ids", ids, layer) for layer, ids in tables if id(ids) not in by_input]
    ids_model = None
    if computed:
        ids_model = keras.Model(model._inputs_struct, [ids for _, ids, _ in computed])
        if ids_model.trainable_weights:
            names = ", ".join(layer.name for _, _, layer in computed)
            raise ValueError(
                f"the ids of tfps Embedding {names} depend on trainable weights: its input must be a model "
                "input or come from one through layers without trainable weights (StringLookup, Hashing, ...)"
            )
    rows = {f"{layer.name}:ids": layer.input_dim for layer, _ in tables}

    def derive(features: dict) -> dict:
        out = dict(features)
        for key, name in copied.items():
            out[key] = np.asarray(features[name], np.int64)
        if ids_model is not None:
            values = ids_model(model_inputs({k: tf.convert_to_tensor(v) for k, v in features.items()}))
            for (key, _, _), value in zip(computed, tf.nest.flatten(values), strict=True):
                out[key] = np.asarray(value, np.int64)
        for key, limit in rows.items():
            if out[key].size and (out[key].min() < 0 or out[key].max() >= limit):
                raise ValueError(f"{key}: ids outside [0, {limit}) in a batch")
        return out

    return derive


def from_keras(model) -> dict[str, Any]:
    """The ModelDef fields of a built Keras model (see the module's docstring); `params` as
    the keyword arguments of each Param."""
    import tensorflow as tf

    inputs = _input_spec(model)
    trainable = list(model.trainable_variables)
    names = [v.path for v in trainable]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"Keras model {model.name!r}: variables share a path ({', '.join(repeated)}); name the layers")
    tables = _tables(model)
    on_ps = {layer.embeddings.path: layer for layer, _ in tables}
    params = [
        dict(
            name=v.path,
            shape=(on_ps[v.path].input_dim, on_ps[v.path].output_dim),
            init=_table_init(on_ps[v.path]),
            sparse=True,
            feature=f"{on_ps[v.path].name}:ids",
        )
        if v.path in on_ps
        else dict(
            name=v.path, shape=tuple(int(d) for d in v.shape), init="given", value=np.asarray(v.numpy(), np.float32)
        )
        for v in trainable
    ]
    state = list(model.non_trainable_variables)
    structure = getattr(model, "_inputs_struct", None)
    kind, from_logits, loss = _loss(model)

    def values_of(params: dict) -> list:
        # a table's variable keeps its own value: the layer takes the table (or its rows) from `giving`
        return [
            v.value if name in on_ps else tf.cast(params[name], v.dtype)
            for name, v in zip(names, trainable, strict=True)
        ]

    def model_inputs(features: dict):
        if structure is None or len(inputs) == 1 and not isinstance(structure, (dict, list, tuple)):
            return features[next(iter(inputs))]
        return tf.nest.map_structure(lambda t: features[t.name], structure)

    def forward(params: dict, features: dict):
        given = {id(layer): (params[name], features[f"{layer.name}:ids"]) for name, layer in on_ps.items()}
        with giving(given):
            outputs, new_state = model.stateless_call(
                values_of(params), [v.value for v in state], model_inputs(features), training=True
            )
        for variable, value in zip(state, new_state, strict=True):
            variable.assign(value)  # this worker's own moving statistics (see the module's docstring)
        return tf.cast(outputs, tf.float32)

    def infer(params: dict, features: dict):
        with giving({id(layer): (params[name], None) for name, layer in on_ps.items()}):
            outputs, _ = model.stateless_call(
                values_of(params), [v.value for v in state], model_inputs(features), training=False
            )
        return tf.cast(outputs, tf.float32)

    return dict(
        params=params,
        forward=forward,
        infer=infer,
        loss=kind,
        objective=_objective(kind, loss),
        outputs="logits" if from_logits else "probabilities",
        name=model.name,
        inputs=inputs,
        derive=_derive(model, tables, model_inputs),
        extra={"keras": model, "model_inputs": model_inputs, "trainable": trainable, "tables_on_ps": bool(tables)},
    )


def export_keras(model, params: dict, path: str) -> None:
    """A SavedModel of the Keras model with the trained parameters (and this worker's
    non-trainable state), its serving signature mapping the features to probabilities."""
    import keras
    import tensorflow as tf

    keras_model = model.extra["keras"]
    if model.extra.get("tables_on_ps"):  # built again with whole tables, the worker's state copied into it
        state = {v.path: v for v in keras_model.non_trainable_variables}
        keras_model = model.extra["rebuild"]()
        for variable in keras_model.non_trainable_variables:
            variable.assign(state[variable.path])
    for variable in keras_model.trainable_variables:
        variable.assign(np.asarray(params[variable.path], np.float32).astype(variable.dtype))
    spec = {
        name: tf.TensorSpec([None, *shape], tf.as_dtype(dtype), name=name)
        for name, (dtype, shape) in model.inputs.items()
    }
    to_probabilities = {"sigmoid": tf.sigmoid, "softmax": tf.nn.softmax}.get(model.loss, tf.identity)

    def serve(features):
        outputs = tf.cast(keras_model(model.extra["model_inputs"](features), training=False), tf.float32)
        return {"probabilities": outputs if model.outputs == "probabilities" else to_probabilities(outputs)}

    archive = keras.export.ExportArchive()
    archive.track(keras_model)
    archive.add_endpoint("serve", serve, input_signature=[spec])
    archive.write_out(path, verbose=False)
