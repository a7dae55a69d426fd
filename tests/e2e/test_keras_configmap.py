"""A user's Keras model shipped without an image build, on the real node: its module is in a
ConfigMap mounted at /models in the PS and Worker pods (spec.training.modulePath), its training
files are TFRecord written here into a hostPath directory mounted in the workers. One job (1 PS,
2 workers) trains a StringLookup + tfps Embedding model to the stated accuracy and succeeds; a
second, whose module raises ImportError, fails at once with a condition that quotes the error
instead of restarting its pods."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from support import wait_for
from support.keras_data import ACCURACY_AT_LEAST, CATEGORIES, TFPS_MODEL, examples, write_tfrecord

from tfps.api.spec import API_GROUP, API_VERSION, PLURAL, manifest_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL_MOUNT, DATA_MOUNT = "/models", "/data"

BROKEN_ERROR = "this model needs the feature store client"
BROKEN = f"raise ImportError({BROKEN_ERROR!r})\n"


@pytest.fixture
def data_dir():
    """Training files on this machine, where the pods (uid 10001) can read them: not under
    pytest's tmp_path, whose root only root may enter."""
    root = Path("/var/tmp") / f"tfps-e2e-keras-{uuid.uuid4().hex[:8]}"
    for sub in ("train", "eval"):
        (root / sub).mkdir(parents=True)
        (root / sub).chmod(0o755)
    root.chmod(0o755)
    x, colour, y = examples(3000, 1)
    for k in range(2):
        write_tfrecord(root / "train" / f"part-{k}.tfrecord", x[k::2], colour[k::2], y[k::2])
    write_tfrecord(root / "eval" / "part-0.tfrecord", *examples(600, 2))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _template(config_map: str, data_dir: Path | None = None) -> dict:
    mounts = [{"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True}]
    volumes = [{"name": "models", "configMap": {"name": config_map}}]
    if data_dir is not None:
        mounts.append({"name": "data", "mountPath": DATA_MOUNT, "readOnly": True})
        volumes.append({"name": "data", "hostPath": {"path": str(data_dir), "type": "Directory"}})
    return {"spec": {"containers": [{"name": "tensorflow", "volumeMounts": mounts}], "volumes": volumes}}


def _job(name: str, config_map: str, module: str, data_dir: Path) -> dict:
    data = {
        "train": {"files": f"{DATA_MOUNT}/train/*.tfrecord", "format": "tfrecord"},
        "eval": {"files": f"{DATA_MOUNT}/eval/*.tfrecord", "format": "tfrecord"},
        "label": "label",
    }
    return manifest_for(
        name,
        {
            "replicaSpecs": {
                "PS": {"replicas": 1, "restartPolicy": "OnFailure", "template": _template(config_map)},
                "Worker": {"replicas": 2, "restartPolicy": "OnFailure", "template": _template(config_map, data_dir)},
            },
            "training": {
                "model": f"{module}:wide_deep",
                "modulePath": [MODEL_MOUNT],
                "modelArgs": {"colours": CATEGORIES},
                "optimizer": {"name": "adam", "learningRate": 0.01},
                "batchSize": 32,
                "steps": 300,
                "data": data,
            },
            "runPolicy": {"backoffLimit": 3, "activeDeadlineSeconds": 540},
        },
    )


def test_a_keras_model_from_a_configmap_trains_and_a_broken_one_fails_quoting_its_error(
    cluster, namespace, release, data_dir
):
    core = client.CoreV1Api(cluster.api)
    custom = client.CustomObjectsApi(cluster.api)
    for name, files in (("user-model", {"ctr_model.py": TFPS_MODEL}), ("broken-model", {"broken_model.py": BROKEN})):
        core.create_namespaced_config_map(namespace, {"metadata": {"name": name}, "data": files})
    for body in (
        _job("keras-cm", "user-model", "ctr_model", data_dir),
        _job("keras-broken", "broken-model", "broken_model", data_dir),
    ):
        custom.create_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, body)

    def finished(name: str):
        got = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name).get("status") or {}
        return got if got.get("phase") in ("Succeeded", "Failed") else None

    broken = wait_for("the broken job to finish", lambda: finished("keras-broken"), timeout=240, interval=0.5)
    assert broken["phase"] == "Failed", json.dumps(broken, indent=1)
    failed = next(c for c in broken["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ModelLoadFailed", failed
    assert f"ImportError: {BROKEN_ERROR}" in failed["message"] and "broken_model.py, line 1" in failed["message"]
    assert broken.get("restartCount", 0) <= 1, broken  # no crash loop: at most the kubelet's one restart seen
    print(f"broken model: {failed['message']}")

    status = wait_for("the job to finish", lambda: finished("keras-cm"), timeout=480, interval=1)
    assert status["phase"] == "Succeeded", (
        json.dumps(status, indent=1),
        cluster.pod_log(namespace, "keras-cm-worker-0")[-3000:],
    )
    progress = status.get("progress") or {}
    assert progress.get("step") == 300, progress
    assert progress.get("accuracy", 0) >= ACCURACY_AT_LEAST, progress
    print(f"keras model from a ConfigMap: accuracy {progress['accuracy']:.3f}, AUC {progress.get('auc')}")
