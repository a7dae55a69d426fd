"""Pure manifest builders and `tfps render`: what the operator would create."""

from __future__ import annotations

import json

import yaml

from tfps.api import naming
from tfps.api.spec import ReplicaType, TrainingJob
from tfps.operator import builders
from tfps.operator.config import OperatorConfig
from tfps.operator.render import render


def _job(replica_specs=None, training=True, **spec) -> TrainingJob:
    body = {
        "apiVersion": "tfps.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "digits", "namespace": "ml", "uid": "u-1"},
        "spec": {"replicaSpecs": replica_specs or {"PS": {"replicas": 2}, "Worker": {"replicas": 4}}, **spec},
    }
    if training:
        body["spec"]["training"] = {
            "model": "digits-mlp",
            "steps": 50,
            "optimizer": {"name": "sgd", "learningRate": 0.1},
        }
    return TrainingJob.model_validate(body)


def _env(pod) -> dict:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "tensorflow"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_pods_for_2_ps_4_workers_have_exact_tf_config():
    pods = builders.desired_pods(_job(), OperatorConfig())
    assert [p["metadata"]["name"] for p in pods] == [
        "digits-ps-0",
        "digits-ps-1",
        "digits-worker-0",
        "digits-worker-1",
        "digits-worker-2",
        "digits-worker-3",
    ]
    cluster = {
        "ps": [f"digits-ps-{i}.digits.ml.svc:2222" for i in range(2)],
        "worker": [f"digits-worker-{i}.digits.ml.svc:2222" for i in range(4)],
    }
    for pod in pods:
        labels = pod["metadata"]["labels"]
        task = {"type": labels[naming.LABEL_TYPE], "index": int(labels[naming.LABEL_INDEX])}
        assert json.loads(_env(pod)["TF_CONFIG"]) == {"cluster": cluster, "task": task, "environment": "cloud"}
        assert pod["spec"]["hostname"] == pod["metadata"]["name"] and pod["spec"]["subdomain"] == "digits"
        assert labels[naming.LABEL_JOB] == "digits"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert pod["metadata"]["ownerReferences"][0]["controller"] is True


def test_runtime_env_args_ports_and_images():
    job = _job()
    ps, worker = (
        builders.build_pod(job, ReplicaType.PS, 0, OperatorConfig()),
        builders.build_pod(job, ReplicaType.WORKER, 1, OperatorConfig()),
    )
    (c_ps,), (c_w,) = ps["spec"]["containers"], worker["spec"]["containers"]
    assert (c_ps["image"], c_ps["args"]) == ("tfps/ps:0.1.0", ["ps"])
    assert (c_w["image"], c_w["args"]) == ("tfps/worker:0.1.0", ["worker"])
    env = _env(worker)
    assert json.loads(env["TFPS_TRAINING"]) == job.spec.training.to_manifest()
    assert json.loads(env["TFPS_TRAINING"])["optimizer"]["learningRate"] == 0.1
    assert "TFPS_BIND_ADDRESS" not in env  # every address of the pod's own namespace, localhost too
    assert (env["TFPS_JOB_NAME"], env["TFPS_NAMESPACE"], env["TFPS_METRICS_PORT"]) == ("digits", "ml", "9090")
    assert {p["containerPort"] for p in c_w["ports"]} == {2222, 9090}
    # the PS also serves its data path, and says where
    assert {(p["name"], p["containerPort"]) for p in c_ps["ports"]} == {
        ("tfps", 2222),
        ("tfps-data", 2223),
        ("metrics", 9090),
    }
    assert _env(ps)["TFPS_DATA_PORT"] == "2223" and "TFPS_DATA_PORT" not in env
    assert c_w["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "emptyDir": {}} in worker["spec"]["volumes"]
    assert worker["spec"]["restartPolicy"] == "OnFailure"


def test_user_template_wins_and_gpu_gets_a_toleration():
    template = {
        "metadata": {"labels": {"team": "ml"}, "annotations": {"a": "b"}},
        "spec": {
            "nodeSelector": {"gpu": "a100"},
            "containers": [
                {
                    "name": "tensorflow",
                    "image": "me/tf:1",
                    "resources": {"limits": {"nvidia.com/gpu": 2}},
                    "env": [{"name": "EXTRA", "value": "1"}, {"name": "TF_CONFIG", "value": "mine"}],
                },
                {"name": "sidecar", "image": "busybox"},
            ],
        },
    }
    job = _job({"PS": {"replicas": 1}, "Worker": {"replicas": 1, "restartPolicy": "ExitCode", "template": template}})
    pod = builders.build_pod(job, ReplicaType.WORKER, 0, OperatorConfig())
    tf, sidecar = pod["spec"]["containers"]
    assert tf["image"] == "me/tf:1" and sidecar == {"name": "sidecar", "image": "busybox"}
    assert tf["resources"] == {"limits": {"nvidia.com/gpu": "2"}}  # as the kubernetes client takes quantities
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["spec"]["nodeSelector"] == {"gpu": "a100"}
    assert pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["annotations"] == {"a": "b"}
    env = _env(pod)
    assert env["EXTRA"] == "1" and env["TF_CONFIG"] != "mine"  # TF_CONFIG must match the Service
    assert pod["spec"]["restartPolicy"] == "Never"  # ExitCode: the operator decides
    ps = builders.build_pod(job, ReplicaType.PS, 0, OperatorConfig())
    assert "tolerations" not in ps["spec"]


def test_own_program_without_training_gets_tf_config_only():
    template = {
        "spec": {"containers": [{"name": "tensorflow", "image": "me/prog:1", "command": ["python", "train.py"]}]}
    }
    job = _job(
        {"Chief": {"replicas": 1, "template": template}, "Worker": {"replicas": 2, "template": template}},
        training=False,
    )
    pod = builders.build_pod(job, ReplicaType.CHIEF, 0, OperatorConfig())
    (c,) = pod["spec"]["containers"]
    assert "args" not in c and c["command"] == ["python", "train.py"]
    assert "TFPS_TRAINING" not in _env(pod)
    assert json.loads(_env(pod)["TF_CONFIG"])["cluster"]["chief"] == ["digits-chief-0.digits.ml.svc:2222"]


def test_service_is_headless_and_selects_the_job():
    svc = builders.build_service(_job(), OperatorConfig())
    assert svc["metadata"]["name"] == "digits" and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {naming.LABEL_JOB: "digits"}
    assert svc["spec"]["publishNotReadyAddresses"] is True


def test_config_changes_images_and_ports(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "images: {ps: reg.local/ps:2, worker: reg.local/w:2}\nports: {grpc: 3333, data: 3334, metrics: 9191}\n"
    )
    config = OperatorConfig.load(path)
    pod = builders.build_pod(_job(), ReplicaType.PS, 1, config)
    (c,) = pod["spec"]["containers"]
    assert c["image"] == "reg.local/ps:2" and {p["containerPort"] for p in c["ports"]} == {3333, 3334, 9191}
    assert _env(pod)["TFPS_DATA_PORT"] == "3334"
    assert json.loads(_env(pod)["TF_CONFIG"])["cluster"]["ps"][1] == "digits-ps-1.digits.ml.svc:3333"


def test_render_prints_service_then_pods(tmp_path):
    manifest = tmp_path / "job.yaml"
    body = _job().model_dump(by_alias=True, exclude_none=True, mode="json")
    del body["metadata"]["uid"], body["metadata"]["namespace"]
    manifest.write_text(yaml.safe_dump(body))
    docs = list(yaml.safe_load_all(render(str(manifest), namespace="team")))
    assert [d["kind"] for d in docs] == ["Service"] + ["Pod"] * 6
    assert all(d["metadata"]["namespace"] == "team" for d in docs)
    assert "ownerReferences" not in docs[1]["metadata"]


def test_tfps_render_command(tmp_path, capsys):
    from tfps.cli.main import main

    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "tfps.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": "r"},
                "spec": {"replicaSpecs": {"PS": {"replicas": 1}, "Worker": {"replicas": 2}}, "training": {}},
            }
        )
    )
    assert main(["render", str(manifest)]) == 0
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert names == ["r", "r-ps-0", "r-worker-0", "r-worker-1"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: tfps.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: b}\n"
        "spec: {replicaSpecs: {Worker: {}}, training: {}}\n"
    )
    assert main(["render", str(bad)]) == 1
    assert "replicaSpecs.PS" in capsys.readouterr().err
