"""The benchmark MLP and its synthetic data, taken from tfps's own built-in `mlp` model.

The anchors (TF's strategy, the compute-only ceiling) build on the same `ModelDef` that
`tfps local` trains (`tfps.runtime.models`): the same parameters and initial values, the
same forward pass, the same synthetic examples. Only the input pipeline is each side's own:
the anchors feed the examples through tf.data, as a TensorFlow user would.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "mlp"


@dataclass(frozen=True)
class Shape:
    """One dense benchmark configuration: an MLP's sizes, batch, workers and PS."""

    name: str
    input_dim: int
    hidden: tuple[int, ...]
    classes: int
    batch: int
    workers: int
    ps: int

    model = MODEL

    @property
    def model_args(self) -> dict:
        """`spec.training.modelArgs` of the built-in `mlp` (manifest field names)."""
        return {"inputDim": self.input_dim, "hidden": list(self.hidden), "classes": self.classes}

    @property
    def params(self) -> int:
        return param_count(self.input_dim, list(self.hidden), self.classes)

    @property
    def cli_args(self) -> list[str]:
        """The model flags of the anchor modules (`add_model_arguments`)."""
        return [
            "--input-dim", str(self.input_dim), "--hidden", ",".join(map(str, self.hidden)),
            "--classes", str(self.classes), "--batch", str(self.batch), "--workers", str(self.workers),
        ]  # fmt: skip


SHAPES = {
    "670k": Shape("670k", 784, (512, 512), 10, batch=128, workers=2, ps=1),
    "5.8M": Shape("5.8M", 784, (2048, 2048), 10, batch=128, workers=2, ps=2),
}


def param_count(input_dim: int, hidden: list[int], classes: int) -> int:
    dims = [input_dim, *hidden, classes]
    return sum(i * o + o for i, o in zip(dims[:-1], dims[1:], strict=False))


def parse_hidden(text: str) -> list[int]:
    return [int(w) for w in text.split(",") if w.strip()]


def load(input_dim: int, hidden: list[int], classes: int, seed: int = 0):
    """tfps's built-in `mlp` ModelDef for these sizes."""
    from tfps.runtime.models import load_model

    return load_model(MODEL, {"inputDim": input_dim, "hidden": hidden, "classes": classes}, seed)


def initial_values(model, seed: int = 0) -> list:
    """The parameters' initial values (numpy), in the model's order."""
    return [p.initial_value(seed) for p in model.params]


def loss_fn(model, params: list, x, y):
    """Mean softmax cross-entropy of the model's forward pass on one batch."""
    import tensorflow as tf

    logits = model.forward({p.name: v for p, v in zip(model.params, params, strict=True)}, {"x": x})
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def train_arrays(model):
    """The model's training split as (x, y) numpy arrays."""
    train, _ = model.data()
    return train.x["x"], train.y


def tf_dataset(model, batch: int, offset: int = 0):
    """An endless tf.data pipeline of (x, y) training batches (start rotated by `offset`)."""
    import numpy as np
    import tensorflow as tf

    x, y = train_arrays(model)
    shift = (offset * batch) % len(y)
    x, y = np.roll(x, -shift, axis=0), np.roll(y, -shift, axis=0)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True).prefetch(2)
