"""A user's own Keras model trained by the PS runtime from their own files: `tfps local`'s
LocalRun (1 PS, 2 workers, real processes on loopback) trains a small wide-and-deep Keras model
(a string feature through StringLookup and a plain Embedding, numeric features through
BatchNormalization) from TFRecord, Parquet and CSV files the test writes (synthetic data: a
linear teacher over the numeric features plus a per-category offset), evaluates it on the eval
files and exports it; bad files fail or are skipped as training.data.onBadRecord says. The same
model with tfps's own Embedding (its table on the PS, moved by rows) trains as well on 2 PS and
2 async workers, and a worker beside a lone PS holds only the rows of a 2M-row table it touched."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from support.keras_data import ACCURACY_AT_LEAST, CATEGORIES, MODEL, TFPS_MODEL, examples, write_tfrecord

from tfps.api.spec import TrainingJob, manifest_for
from tfps.runtime.local import LocalRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

AUC_AT_LEAST = 0.9


def _write_parquet(path, x, colour, y):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": list(x), "colour": colour, "label": y}), str(path), row_group_size=200)


def _write_csv(path, x, colour, y):
    with gzip.open(path, "wt") as fh:
        fh.write("x0,x1,colour,label\n")
        for i in range(len(y)):
            fh.write(f"{x[i, 0]},{x[i, 1]},{colour[i]},{y[i]}\n")


FORMATS = {
    "tfrecord": (write_tfrecord, "tfrecord", None),
    "parquet": (_write_parquet, "parquet", None),
    "csv": (_write_csv, "csv.gz", "gzip"),
}


def _write(tmp_path, fmt: str, files: int = 3, train: int = 3000, evals: int = 600) -> dict:
    write, suffix, compression = FORMATS[fmt]
    (tmp_path / "train").mkdir()
    (tmp_path / "eval").mkdir()
    x, colour, y = examples(train, 1)
    for k in range(files):
        write(tmp_path / "train" / f"part-{k}.{suffix}", x[k::files], colour[k::files], y[k::files])
    write(tmp_path / "eval" / f"part-0.{suffix}", *examples(evals, 2))
    source = {"format": fmt, **({"compression": compression} if compression else {})}
    return {
        "train": {"files": str(tmp_path / "train" / f"*.{suffix}"), **source},
        "eval": {"files": str(tmp_path / "eval" / f"*.{suffix}"), **source},
        "label": "label",
    }


# A CSV column holds one value: the model takes its two numbers as two inputs.
CSV_MODEL = MODEL.replace(
    'numeric = keras.Input((2,), name="x", dtype="float32")',
    'x0, x1 = keras.Input((1,), name="x0"), keras.Input((1,), name="x1")\n'
    "    numeric = keras.layers.Concatenate()([x0, x1])",
).replace('{"x": numeric, "colour": colour}', '{"x0": x0, "x1": x1, "colour": colour}')


def _job(tmp_path, data: dict, steps: int = 300, model: str = MODEL, ps: int = 1, **training) -> LocalRun:
    (tmp_path / "usermodel.py").write_text(model)
    spec = {
        "replicaSpecs": {"PS": {"replicas": ps}, "Worker": {"replicas": 2}},
        "runPolicy": {"backoffLimit": 0},
        "training": {
            "model": "usermodel:wide_deep",
            "modelArgs": {"colours": CATEGORIES},
            "optimizer": {"name": "adam", "learningRate": 0.01},
            "batchSize": 32,
            "steps": steps,
            "data": data,
            **training,
        },
    }
    job = TrainingJob.model_validate(manifest_for("keras-files", spec))
    return LocalRun(job, workdir=tmp_path / "work", env={"PYTHONPATH": str(tmp_path)})


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_keras_model_trains_from_files_to_the_stated_accuracy(tmp_path, fmt):
    data = _write(tmp_path, fmt)
    run = _job(tmp_path, data, model=CSV_MODEL if fmt == "csv" else MODEL, exportPath=str(tmp_path / "export"))
    result = run.run()
    assert result["succeeded"], json.dumps(result.get("logs"), indent=1)[-4000:]
    assert result["steps"] == 300
    assert result["accuracy"] >= ACCURACY_AT_LEAST, result
    assert result["auc"] > result["accuracy"] - 0.1, result
    print(f"{fmt}: accuracy {result['accuracy']:.3f}, AUC {result['auc']:.3f}")
    _check_export(tmp_path / "export", fmt)


def _check_export(path, fmt: str) -> None:
    import tensorflow as tf

    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    x, colour, y = examples(400, 3)
    features = {"colour": tf.constant(colour.reshape(-1, 1))}
    if fmt == "csv":
        features.update(x0=tf.constant(x[:, :1]), x1=tf.constant(x[:, 1:]))
    else:
        features["x"] = tf.constant(x)
    probabilities = serve(**features)["probabilities"].numpy().reshape(-1)
    assert ((probabilities > 0.5) == y).mean() >= ACCURACY_AT_LEAST


def test_a_tfps_embedding_trains_as_well_as_a_plain_one_on_two_ps_and_async_workers(tmp_path):
    """The same data, seed and steps; the tfps layer's table is a sparse parameter split over both PS."""
    figures = {}
    for name, model in (("plain", MODEL), ("tfps", TFPS_MODEL)):
        root = tmp_path / name
        root.mkdir()
        run = _job(root, _write(root, "tfrecord"), model=model, ps=2, consistency={"mode": "async"})
        result = run.run()
        assert result["succeeded"], json.dumps(result.get("logs"), indent=1)[-4000:]
        assert result["accuracy"] >= ACCURACY_AT_LEAST and result["auc"] >= AUC_AT_LEAST, (name, result)
        figures[name] = result
        print(f"{name} Embedding: accuracy {result['accuracy']:.3f}, AUC {result['auc']:.3f}")
    assert abs(figures["tfps"]["auc"] - figures["plain"]["auc"]) <= 0.05, figures


def test_a_worker_holds_only_the_touched_rows_of_a_2m_row_table_and_the_export_holds_it_whole(tmp_path, monkeypatch):
    """A worker in this process beside a lone PS: its Keras variable is one row, the rows it pulls
    are those of its batches' ids; the export has the PS's whole table and predicts as the PS's
    parameters do."""
    import tensorflow as tf
    from support import lone_shard

    from tfps.api.spec import TrainingSpec
    from tfps.runtime.metrics import Identity, WorkerMetrics
    from tfps.runtime.models import load_model
    from tfps.runtime.ps import serve
    from tfps.runtime.worker import Worker, export_saved_model

    rows = 2_000_000
    (tmp_path / "usermodel.py").write_text(TFPS_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = {"colours": CATEGORIES, "rows": rows}
    training = TrainingSpec.model_validate(
        {
            "model": "usermodel:wide_deep",
            "modelArgs": args,
            "optimizer": {"name": "sgd", "learningRate": 0.1},
            "consistency": {"mode": "async"},
            "batchSize": 32,
            "steps": 20,
            "data": _write(tmp_path, "tfrecord", files=1, train=640, evals=64),
        }
    )
    model = load_model("usermodel:wide_deep", args, training.seed)
    table = next(p for p in model.params if p.sparse)
    assert (table.name, table.shape, table.feature) == ("emb/embeddings", (rows, 4), "emb:ids")
    shard = lone_shard(model.params, training, job="keras-rows")
    server, port = serve(shard, "127.0.0.1:0")
    try:
        metrics = WorkerMetrics(Identity("keras-rows", "default", "worker", 0))
        worker = Worker(model, training, [f"127.0.0.1:{port}"], 1, 0, metrics, pipeline=False)
        worker.pull()
        for _ in range(10):
            worker.train_step()
            # the lookup's ids are 0..4: never more rows than that, and no whole table anywhere in the worker
            assert worker.rows[table.name].shape[0] <= len(CATEGORIES) + 1
            assert table.name not in worker.params
        keras_table = next(v for v in model.extra["keras"].trainable_variables if v.path == table.name)
        assert tuple(keras_table.shape) == (1, 4)
        params = worker.full_params()
        assert params[table.name].shape == (rows, 4)
        assert not np.array_equal(params[table.name][:5], table.initial_rows(training.seed, 0, 5))  # trained
        export_saved_model(model, params, {}, str(tmp_path / "export"))
        worker.close()
    finally:
        server.stop(None)
        shard.close()
    exported = tf.saved_model.load(str(tmp_path / "export"))
    assert any(tuple(v.shape) == (rows, 4) for v in exported.variables)
    x, colour, _ = examples(64, 3)
    features = {"x": x, "colour": colour.reshape(-1, 1).astype(object)}
    served = exported.signatures["serving_default"](**{k: tf.constant(v) for k, v in features.items()})
    expected = model.predict({k: tf.constant(v) for k, v in params.items()}, features).numpy()
    np.testing.assert_allclose(served["probabilities"].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_glob_matching_no_file_fails_the_job_naming_it(tmp_path):
    data = _write(tmp_path, "tfrecord", files=1, train=200, evals=50)
    data["train"]["files"] = str(tmp_path / "nowhere" / "*.tfrecord")
    result = _job(tmp_path, data, steps=20).run()
    assert not result["succeeded"]
    assert "no file matches" in result["logs"]["worker-0"] and data["train"]["files"] in result["logs"]["worker-0"]


def _corrupt(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a flipped byte: the record's checksum no longer holds
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_a_corrupt_tfrecord_is_skipped_and_counted_or_fails_naming_the_file(tmp_path, policy):
    data = _write(tmp_path, "tfrecord", files=2, train=1000, evals=200)
    bad = tmp_path / "train" / "part-0.tfrecord"
    _corrupt(bad)
    data.update(onBadRecord=policy, epochs=1)
    run = _job(tmp_path, data, steps=100, consistency={"mode": "async"})
    result = run.run()
    log = (run.workdir / "worker-0.log").read_text()
    if policy == "fail":
        assert not result["succeeded"]
        assert str(bad) in log and "onBadRecord: fail" in log
    else:
        assert result["succeeded"], json.dumps(result.get("logs"), indent=1)[-4000:]
        assert f"skipped 1 bad record(s) in {bad}" in log
