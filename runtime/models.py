"""Built-in models and the contract for a user's own (`package.module:function`).

A model is a `ModelDef`: its parameters (names, shapes, initialisers; embedding tables
marked `sparse`), a pure `forward(params, features) -> logits` written with TensorFlow ops,
and a `data()` callable returning the train and (optional) test splits as numpy arrays.
PS processes only read `params`; workers also call `forward` and `data`.

A user model is `function(model_args: dict, seed: int) -> ModelDef`, or a Keras model (built,
not trained), which runtime/keras_model.py turns into a ModelDef.

Sparse parameters are looked up with `tf.gather(params[name], features[feature])`: the
worker pulls only the rows a batch touches and hands `forward` those rows with the id
feature remapped onto them, so the same `forward` serves training (rows), evaluation and
export (whole tables).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tfps.api.semantics import USER_CODE_EXIT_CODE

from . import wire

INIT_BLOCK_ROWS = 1 << 16
SKIP_ROWS = 1 << 10


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    init: str = "glorot"  # "glorot" | "zeros" | "normal:<stddev>" | "uniform:<limit>" | "given" (`value`)
    sparse: bool = False  # an embedding table: pulled and updated by rows
    feature: str | None = None  # sparse only: the feature holding its ids
    # init "given": the initial value itself (a Keras model's own initialised weights)
    value: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def initial_value(self, seed: int) -> np.ndarray:
        """Deterministic in (seed, name): every PS and every test sees the same start."""
        return self.initial_rows(seed, 0, self.shape[0] if self.shape else 1)

    def initial_rows(self, seed: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the initial value, drawn block by block (INIT_BLOCK_ROWS rows,
        each block from its own seed), so a PS makes only its own rows of a large table, and
        the values do not depend on how the rows are split over PS."""
        if self.init == "given":
            if self.value is None or tuple(self.value.shape) != tuple(self.shape):
                raise ValueError(f"parameter {self.name}: init 'given' needs a value of shape {self.shape}")
            return np.array(self.value[start:stop] if self.shape else self.value, np.float32)
        if not self.shape:
            return self._draw(np.random.default_rng([seed, zlib.crc32(self.name.encode())]), ())
        first, last = start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)
        out = np.empty((stop - start, *self.shape[1:]), np.float32)
        for block in range(first, last):
            lo = block * INIT_BLOCK_ROWS
            hi = min(lo + INIT_BLOCK_ROWS, self.shape[0])
            rng = np.random.default_rng([seed, zlib.crc32(self.name.encode()), block])
            a, b = max(lo, start), min(hi, stop)
            # A block's rows are drawn in order, so its rows [a, b) are those that follow a - lo
            # skipped ones: drawn into place, without a temporary the size of a block.
            for skip in range(lo, a, SKIP_ROWS):
                self._draw(rng, (min(SKIP_ROWS, a - skip), *self.shape[1:]))
            self._draw(rng, (b - a, *self.shape[1:]), out[a - start : b - start])
        return out

    def _draw(self, rng: np.random.Generator, shape: tuple, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(shape, np.float32)
        if self.init == "zeros":
            out[...] = 0
        elif self.init.startswith("normal:"):
            rng.standard_normal(dtype=np.float32, out=out)
            out *= np.float32(self.init.split(":", 1)[1])
        elif self.init.startswith("uniform:"):  # in [-limit, limit)
            limit = np.float32(self.init.split(":", 1)[1])
            rng.random(dtype=np.float32, out=out)
            out *= 2 * limit
            out -= limit
        elif self.init == "glorot":
            fan_in, fan_out = (self.shape[0], self.shape[-1]) if len(self.shape) > 1 else (self.shape[0], self.shape[0])
            rng.random(dtype=np.float32, out=out)
            out *= 2
            out -= 1
            out *= np.float32(np.sqrt(6.0 / (fan_in + fan_out)))
        else:
            raise ValueError(f"parameter {self.name}: unknown initialiser {self.init!r}")
        return out


@dataclass
class Dataset:
    x: dict[str, np.ndarray]  # features, all with the same first dimension
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def take(self, idx: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The examples at `idx`, in aligned arrays (a worker's batch goes to TensorFlow without a copy)."""
        return {k: _take(v, idx) for k, v in self.x.items()}, _take(self.y, idx)


def _take(array: np.ndarray, idx: np.ndarray) -> np.ndarray:
    if array.dtype.hasobject:  # strings (Python objects) go to TensorFlow as tf.string, copied anyway
        return np.take(array, idx, axis=0)
    return np.take(array, idx, axis=0, out=wire.aligned_array((len(idx), *array.shape[1:]), array.dtype))


def _no_data() -> tuple[Dataset, Dataset | None]:
    raise ValueError("this model has no data() of its own: set spec.training.data")


@dataclass
class ModelDef:
    params: list[Param]
    forward: Callable[[dict, dict], Any]  # (params, features) -> logits, TensorFlow ops
    data: Callable[[], tuple[Dataset, Dataset | None]] = _no_data
    loss: str = "softmax"  # "softmax" (integer labels) | "sigmoid" (0/1 labels, one logit)
    name: str = "model"
    extra: dict = field(default_factory=dict)
    # The training loss `objective(y, outputs)`, in place of `loss`'s cross-entropy on logits
    # (a Keras model's compiled loss); `loss` still says how evaluation reads the outputs.
    objective: Callable[[Any, Any], Any] | None = None
    outputs: str = "logits"  # "logits" | "probabilities": what forward returns
    # forward for evaluation and export (no state updated, inference behaviour); default: forward
    infer: Callable[[dict, dict], Any] | None = None
    # Per feature its (dtype, per-example shape), for data read from files; default: none known
    inputs: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    # `derive(features) -> features`: a batch's features plus those the sparse tables' ids are
    # read from, where the model computes them (a Keras model's lookups); run before the rows are pulled
    derive: Callable[[dict], dict] | None = None

    def predict(self, params: dict, features: dict):
        return (self.infer or self.forward)(params, features)

    @property
    def sparse_params(self) -> list[Param]:
        return [p for p in self.params if p.sparse]


def _mlp_params(sizes: list[int], prefix: str = "dense") -> list[Param]:
    params = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
        params.append(Param(f"{prefix}_{i}/kernel", (fan_in, fan_out)))
        params.append(Param(f"{prefix}_{i}/bias", (fan_out,), init="zeros"))
    return params


def _mlp_forward(params: dict, h, layers: int, prefix: str = "dense"):
    import tensorflow as tf

    for i in range(layers):
        h = tf.matmul(h, params[f"{prefix}_{i}/kernel"]) + params[f"{prefix}_{i}/bias"]
        if i < layers - 1:
            h = tf.nn.relu(h)
    return h


def _dense_model(name: str, sizes: list[int], data: Callable) -> ModelDef:
    layers = len(sizes) - 1
    return ModelDef(
        params=_mlp_params(sizes),
        forward=lambda params, x: _mlp_forward(params, x["x"], layers),
        data=data,
        name=name,
    )


def digits_mlp(model_args: dict, seed: int) -> ModelDef:
    """scikit-learn's bundled 8x8 digits (no download), 20 % held out for the test split."""
    hidden = list(model_args.get("hidden", [128, 64]))
    test_fraction = float(model_args.get("testFraction", 0.2))

    def data():
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int64)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
        return Dataset({"x": xtr}, ytr), Dataset({"x": xte}, yte)

    return _dense_model("digits-mlp", [64, *hidden, 10], data)


def synthetic_mlp(model_args: dict, seed: int) -> ModelDef:
    """Synthetic classification, sized by modelArgs; for benchmarks. The inputs lie near a
    16-dimensional subspace and a linear teacher there sets the class, so a few thousand
    examples are enough to learn it."""
    input_dim = int(model_args.get("inputDim", 784))
    hidden = list(model_args.get("hidden", [512, 512]))
    classes = int(model_args.get("classes", 10))
    samples = int(model_args.get("samples", 8192))
    test_samples = int(model_args.get("testSamples", 1024))
    latent = int(model_args.get("latentDim", 16))

    def data():
        rng = np.random.default_rng(seed)
        mixing = rng.normal(size=(latent, input_dim)).astype(np.float32) / np.sqrt(latent)
        teacher = rng.normal(size=(latent, classes)).astype(np.float32)
        z = rng.normal(size=(samples + test_samples, latent)).astype(np.float32)
        x = (z @ mixing + 0.1 * rng.normal(size=(samples + test_samples, input_dim))).astype(np.float32)
        y = np.argmax(z @ teacher, axis=1).astype(np.int64)
        return Dataset({"x": x[:samples]}, y[:samples]), Dataset({"x": x[samples:]}, y[samples:])

    return _dense_model("mlp", [input_dim, *hidden, classes], data)


def wide_deep(model_args: dict, seed: int) -> ModelDef:
    """A click model: categorical ids through an embedding table (deep) and a per-id weight
    table (wide), both sparse; a few dense features. Synthetic, power-law id frequencies."""
    fields = int(model_args.get("fields", 8))
    vocab = int(model_args.get("vocabSize", 50_000))
    dim = int(model_args.get("embeddingDim", 16))
    dense_dim = int(model_args.get("denseDim", 8))
    hidden = list(model_args.get("hidden", [64, 32]))
    samples = int(model_args.get("samples", 32_768))
    test_samples = int(model_args.get("testSamples", 4096))
    per_field = vocab // fields
    sizes = [fields * dim + dense_dim, *hidden, 1]
    params = [
        Param("embedding", (per_field * fields, dim), init="normal:0.05", sparse=True, feature="ids"),
        Param("wide", (per_field * fields, 1), init="zeros", sparse=True, feature="ids"),
        *_mlp_params(sizes),
    ]

    def forward(p, x):
        import tensorflow as tf

        ids = x["ids"]
        emb = tf.reshape(tf.gather(p["embedding"], ids), [-1, fields * dim])
        deep = _mlp_forward(p, tf.concat([emb, x["dense"]], axis=1), len(sizes) - 1)
        wide = tf.reduce_sum(tf.gather(p["wide"], ids), axis=1)
        return deep + wide

    def data():
        rng = np.random.default_rng(seed)
        n = samples + test_samples
        ids = (rng.zipf(1.3, size=(n, fields)) - 1) % per_field + np.arange(fields) * per_field
        dense = rng.normal(size=(n, dense_dim)).astype(np.float32)
        id_weight = rng.normal(0, 1.0, size=per_field * fields).astype(np.float32)
        dense_weight = rng.normal(0, 0.5, size=dense_dim).astype(np.float32)
        logit = id_weight[ids].sum(axis=1) * 0.7 + dense @ dense_weight - 0.5
        y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        ids = ids.astype(np.int64)
        split = lambda a: (a[:samples], a[samples:])  # noqa: E731
        (itr, ite), (dtr, dte), (ytr, yte) = split(ids), split(dense), split(y)
        return Dataset({"ids": itr, "dense": dtr}, ytr), Dataset({"ids": ite, "dense": dte}, yte)

    return ModelDef(params=params, forward=forward, data=data, loss="sigmoid", name="wide-deep")


BUILTIN: dict[str, Callable[[dict, int], ModelDef]] = {
    "digits-mlp": digits_mlp,
    "mlp": synthetic_mlp,
    "wide-deep": wide_deep,
}


class UserCodeError(ValueError):
    """The user's model could not be loaded: its module does not import, the function is
    missing, raises, returns something else than a model, or a model tfps cannot train.
    Restarting will not fix it."""


def describe_user_error(name: str, err: BaseException) -> str:
    """One line that names the model, the error and where in the user's code it was raised."""
    where = ""
    ours = os.path.dirname(os.path.abspath(__file__))
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.startswith(("<frozen", ours)) and "/importlib/" not in f.filename
    ]
    if isinstance(err, SyntaxError) and err.filename:
        where = f" ({err.filename}, line {err.lineno})"
    elif frames:
        where = f" ({frames[-1].filename}, line {frames[-1].lineno})"
    return f"model {name}: {type(err).__name__}: {err}{where}"


def use_module_path(paths: list[str] | None) -> None:
    """Put spec.training.modulePath ahead of the import path, in this process and, through
    PYTHONPATH, in the processes it starts (load_params's child builds the model too)."""
    if not paths:
        return
    sys.path[:0] = [p for p in paths if p not in sys.path]
    rest = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, rest] if rest else paths)


def load_model(name: str, model_args: dict | None = None, seed: int = 0) -> ModelDef:
    """A built-in name or `package.module:function`."""
    model_args = model_args or {}
    if name in BUILTIN:
        return BUILTIN[name](model_args, seed)
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}: use one of {sorted(BUILTIN)} or 'package.module:function'")
    try:
        return _load_user_model(name, model_args, seed)
    except Exception as err:
        raise UserCodeError(describe_user_error(name, err)) from err


def _load_user_model(name: str, model_args: dict, seed: int) -> ModelDef:
    module_name, func_name = name.split(":", 1)
    function = getattr(importlib.import_module(module_name), func_name)
    build = lambda: function(model_args, seed)  # noqa: E731
    keras_first = "keras" in sys.modules  # the module imports Keras: build under its seed at once
    from .keras_tables import tables_on_ps

    with tables_on_ps():  # built to be trained: a tfps Embedding's table stays on the PS
        if keras_first:
            from .keras_model import seeded

            model = seeded(seed, build)
        else:
            model = build()
        if not isinstance(model, ModelDef) and _is_keras_model(model):
            from .keras_model import from_keras, seeded

            # Under the seed (built again if Keras came in late): every process starts from the same weights.
            fields = from_keras(model if keras_first else seeded(seed, build))
            model = ModelDef(params=[Param(**p) for p in fields.pop("params")], **fields)
            # the export's model, its tables whole
            model.extra["rebuild"] = lambda: seeded(seed, build)
    if not isinstance(model, ModelDef):
        raise TypeError(f"{name} returned {type(model).__name__}, not tfps.runtime.models.ModelDef or a keras.Model")
    return model


def _is_keras_model(obj: Any) -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, keras.Model)


def load_params(name: str, model_args: dict | None = None, seed: int = 0) -> list[Param]:
    """A model's parameters, for a PS. A user's model is built in a child process, so that the
    PS itself never imports what the model needs (TensorFlow and Keras for a Keras model): the
    child hands back the parameter list, with a Keras model's initial values."""
    if name in BUILTIN:
        return load_model(name, model_args, seed).params
    with tempfile.TemporaryDirectory(prefix="tfps-params-") as tmp:
        out = os.path.join(tmp, "params.pickle")
        args = [sys.executable, "-m", "tfps.runtime.models", name, json.dumps(model_args or {}), str(seed), out]
        done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        if done.returncode == USER_CODE_EXIT_CODE and os.path.exists(out + ".error"):
            with open(out + ".error") as fh:
                raise UserCodeError(fh.read())
        if done.returncode != 0:
            raise RuntimeError(f"building model {name} failed:\n{done.stdout[-4000:]}")
        with open(out, "rb") as fh:
            return pickle.load(fh)  # written by our own child just now


def _write_params(name: str, model_args: str, seed: str, out: str) -> int:
    try:
        model = load_model(name, json.loads(model_args), int(seed))
    except UserCodeError as err:
        traceback.print_exc()
        with open(out + ".error", "w") as fh:
            fh.write(str(err))
        return USER_CODE_EXIT_CODE
    with open(out, "wb") as fh:
        pickle.dump(model.params, fh, protocol=pickle.HIGHEST_PROTOCOL)
    return 0


class BatchSource:
    """Deterministic batches: the same seed gives the same data order.

    Global batch `s` is positions [s*G, (s+1)*G) of the stream of per-epoch permutations
    (G = batch * num_workers); worker w takes the w-th slice of B. So in sync mode N
    workers x batch B see exactly the examples of 1 worker x batch N*B.
    """

    def __init__(self, data: Dataset, seed: int, batch: int, worker: int = 0, num_workers: int = 1):
        self.data, self.seed, self.batch = data, seed, batch
        self.worker, self.num_workers = worker, num_workers
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        n = len(self.data)
        start = step * self.batch * self.num_workers + self.worker * self.batch
        epoch, offset = divmod(start, n)
        if offset + self.batch <= n:  # within one epoch, as most batches are
            return self._perm(epoch)[offset : offset + self.batch].copy()
        pos = np.arange(start, start + self.batch)
        epochs = pos // n
        out = np.empty(self.batch, np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(int(e))[pos[mask] % n]
        return out

    def __call__(self, step: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return self.data.take(self.indices(step))


if __name__ == "__main__":  # load_params's child: NAME MODEL_ARGS_JSON SEED OUT
    # through the package's module, so that the pickled parameters name its Param, not __main__'s
    from tfps.runtime.models import _write_params as write

    sys.exit(write(*sys.argv[1:5]))
