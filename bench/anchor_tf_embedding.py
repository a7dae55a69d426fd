"""Anchor: TensorFlow's own ParameterServerStrategy on the wide-and-deep click model.

`python -m tfps.bench.anchor_tf_embedding --vocab 2000000 --dim 64 --optimizer adam` trains,
as TF's parameter-server tutorial does, Keras `Embedding` layers whose tables a variable
partitioner splits over the PS, with a Keras optimizer, async (ClusterCoordinator), on the
examples and forward pass of tfps's `wide-deep`. It prints one JSON line with the
steady-state examples/s. Keras 3 cannot train a partitioned (Sharded) variable, so this
anchor runs Keras 2 (the `tf-keras` package): its processes, and only they, have
TF_USE_LEGACY_KERAS=1 (`ENV`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .anchor_tf_pss import per_worker_iterator, pss_cluster, run_window, say
from .embedding import EmbeddingShape, load

MODULE = "tfps.bench.anchor_tf_embedding"
ENV = {"TF_USE_LEGACY_KERAS": "1"}


def _dataset(model, batch: int, offset: int):
    import numpy as np
    import tensorflow as tf

    train, _ = model.data()
    shift = (offset * batch) % len(train)
    ids, dense, y = (np.roll(a, -shift, axis=0) for a in (train.x["ids"], train.x["dense"], train.y))
    return tf.data.Dataset.from_tensor_slices(((ids, dense), y)).repeat().batch(batch, drop_remainder=True).prefetch(2)


def _keras_model(tf, shape: EmbeddingShape):
    keras = tf.keras  # Keras 2 under TF_USE_LEGACY_KERAS=1
    ids = keras.Input((shape.fields,), dtype="int64")
    dense = keras.Input((shape.dense_dim,), dtype="float32")
    emb = keras.layers.Embedding(
        shape.rows, shape.dim, embeddings_initializer=keras.initializers.RandomNormal(stddev=0.05)
    )(ids)
    h = keras.layers.Concatenate()([keras.layers.Reshape((shape.fields * shape.dim,))(emb), dense])
    for width in shape.hidden:
        h = keras.layers.Dense(width, activation="relu")(h)
    deep = keras.layers.Dense(1)(h)
    wide = keras.layers.Embedding(shape.rows, 1, embeddings_initializer="zeros")(ids)
    logits = keras.layers.Add()([deep, keras.layers.Lambda(lambda w: tf.reduce_sum(w, axis=1))(wide)])
    return keras.Model([ids, dense], logits)


def measure(args: argparse.Namespace) -> dict:
    import tensorflow as tf

    shape = EmbeddingShape("anchor", args.vocab, dim=args.dim, batch=args.batch, workers=args.workers, ps=args.ps)
    model = load(shape, args.seed)
    with pss_cluster(args) as (strategy, coordinator, watch):
        with strategy.scope():
            net = _keras_model(tf, shape)
            optimizer = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam}[args.optimizer](
                args.learning_rate
            )
        say(f"model built; peak resident: {watch}")
        iterator = per_worker_iterator(
            strategy, coordinator, lambda ctx: _dataset(model, args.batch, ctx.input_pipeline_id if ctx else 0)
        )

        @tf.function
        def step_fn(it):
            def replica_fn(features, y):
                with tf.GradientTape() as tape:
                    logits = net(features, training=True)
                    loss = tf.reduce_mean(
                        tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.reshape(y, [-1, 1]), logits=logits)
                    )
                grads = tape.gradient(loss, net.trainable_variables)
                optimizer.apply_gradients(zip(grads, net.trainable_variables, strict=True))
                return loss

            features, y = next(it)
            return strategy.run(replica_fn, args=(features, y))

        steps, elapsed, loss = run_window(coordinator, step_fn, iterator, args)
        tables = [
            [v.name, v.shape.as_list(), v.device]
            for v in net.trainable_variables
            if v.shape[0] >= shape.rows // args.ps
        ]
        watch.sample()
        say(f"done; peak resident: {watch}")
    return {
        "system": f"tf_pss_{args.optimizer}",
        "steps": steps,
        "seconds": elapsed,
        "examples_per_second": steps * args.batch / elapsed,
        "loss": loss,
        "tables": tables,  # the partitioned tables' pieces and their PS
        "keras": type(net).__module__.split(".")[0],  # tf_keras: Keras 2
        "ps_peak_rss": watch.peak("ps"),  # the largest of TF's PS processes
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--batch", type=int, default=512, help="per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.partition = True
    os.environ.update(ENV)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(json.dumps(measure(args)), flush=True)
    os._exit(0)  # the servers are gone: skip TF's teardown of the remote context


if __name__ == "__main__":
    sys.exit(main())
