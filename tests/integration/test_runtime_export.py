"""Worker 0 exports the trained model as a SavedModel (spec.training.exportPath) that
serves the same predictions the evaluation measured."""

import pytest
import tensorflow as tf

from tfps.api.spec import TrainingSpec
from tfps.runtime.inprocess import InProcessCluster

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model, args", [("digits-mlp", {}), ("wide-deep", {"vocabSize": 2000, "fields": 4})])
def test_exported_model_serves_the_trained_parameters(tmp_path, model, args):
    training = TrainingSpec.model_validate(
        {
            "model": model,
            "modelArgs": args,
            "steps": 150,
            "batchSize": 32,
            "optimizer": {"name": "adam", "learningRate": 0.01},
            "exportPath": str(tmp_path / "export"),
        }
    )
    with InProcessCluster(training, num_ps=2, num_workers=1) as cluster:
        _, result = cluster.train()
        test = cluster.model().data()[1]
    loaded = tf.saved_model.load(result["export_path"])
    serve = loaded.signatures["serving_default"]
    probs = serve(**{k: tf.constant(v) for k, v in test.x.items()})["probabilities"].numpy()
    pred = probs.argmax(axis=1) if probs.shape[1] > 1 else (probs[:, 0] > 0.5).astype(test.y.dtype)
    assert abs(float((pred == test.y).mean()) - result["accuracy"]) < 1e-6
    assert result["accuracy"] > 0.6
