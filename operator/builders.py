"""Pure manifest builders: a TrainingJob and the operator's config in, dicts out, no I/O.

The user's pod template is the base; the operator fills what it leaves out (image, args,
ports, resources, security context) and owns what must agree with TF_CONFIG and the
Service (names, hostname/subdomain, labels, the runtime's environment variables).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from tfps.api import naming, semantics, tfconfig
from tfps.api.spec import ReplicaType, TrainingJob

from . import gang, security
from .config import OperatorConfig
from .meta import job_labels, object_meta


def build_service(job: TrainingJob, config: OperatorConfig) -> dict[str, Any]:
    """The headless Service that gives every pod `<pod>.<job>.<ns>.svc`."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, naming.service_name(job.name), job_labels(job)),
        "spec": {
            "clusterIP": "None",
            "selector": naming.job_selector(job.name),
            # Pods must resolve each other before they are Ready: the PS waits for workers.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": naming.GRPC_PORT_NAME, "port": config.ports.grpc, "targetPort": config.ports.grpc},
                {"name": naming.DATA_PORT_NAME, "port": config.ports.data, "targetPort": config.ports.data},
                {"name": naming.METRICS_PORT_NAME, "port": config.ports.metrics, "targetPort": config.ports.metrics},
            ],
        },
    }


def _runtime_env(job: TrainingJob, rtype: ReplicaType, index: int, config: OperatorConfig) -> list[dict]:
    cfg = tfconfig.tf_config(
        job.name,
        job.namespace,
        job.spec,
        rtype,
        index,
        address=lambda t, i: f"{naming.dns_name(job.name, job.namespace, t, i)}:{config.ports.grpc}",
    )
    env = [
        {"name": naming.ENV_TF_CONFIG, "value": json.dumps(cfg, separators=(",", ":"))},
        {"name": naming.ENV_JOB_NAME, "value": job.name},
        {"name": naming.ENV_NAMESPACE, "value": job.namespace},
    ]
    if job.spec.training is not None:
        env.append(
            {
                "name": naming.ENV_TRAINING,
                "value": json.dumps(job.spec.training.to_manifest(), separators=(",", ":"), sort_keys=True),
            }
        )
    # No bind address: a pod's servers listen on every address of its own network namespace, so
    # `kubectl port-forward` (which dials localhost inside the pod) and localhost probes reach them.
    env.append({"name": naming.ENV_METRICS_PORT, "value": str(config.ports.metrics)})
    if rtype is ReplicaType.PS:
        env.append({"name": naming.ENV_DATA_PORT, "value": str(config.ports.data)})
    return env


def _merge_named(ours: list[dict], theirs: list[dict], key: str, ours_win: bool) -> list[dict]:
    """Merge two lists of named items (env, ports, volumes) by `key`."""
    theirs_by = {item.get(key): item for item in theirs}
    ours_by = {item.get(key): item for item in ours}
    merged = [ours_by[k] if ours_win and k in ours_by else item for k, item in theirs_by.items()]
    merged = [item for item in ours if item.get(key) not in theirs_by] + merged
    return merged


def _gpu_requested(resources: dict[str, Any]) -> bool:
    return any(naming.GPU_RESOURCE in (resources.get(part) or {}) for part in ("limits", "requests"))


def _container(job: TrainingJob, rtype: ReplicaType, index: int, config: OperatorConfig, user: dict) -> dict:
    """The operator's container, from the user's (a copy of the template's, changed in place)."""
    c = user
    c["name"] = naming.CONTAINER_NAME
    c.setdefault("image", config.images.for_type(rtype))
    c.setdefault("imagePullPolicy", config.images.pull_policy)
    args = semantics.built_in_args(job.spec, rtype)
    if args is not None and "command" not in c:
        c.setdefault("args", args)
    c["env"] = _merge_named(_runtime_env(job, rtype, index, config), c.get("env") or [], "name", ours_win=True)
    ports = [
        {"name": naming.GRPC_PORT_NAME, "containerPort": config.ports.grpc, "protocol": "TCP"},
        {"name": naming.METRICS_PORT_NAME, "containerPort": config.ports.metrics, "protocol": "TCP"},
    ]
    if rtype is ReplicaType.PS:
        ports.insert(1, {"name": naming.DATA_PORT_NAME, "containerPort": config.ports.data, "protocol": "TCP"})
    c["ports"] = _merge_named(ports, c.get("ports") or [], "name", ours_win=False)
    resources = c.get("resources") or copy.deepcopy(config.resources.get(rtype, {}))
    gpus = (resources.get("requests") or {}).get(naming.GPU_RESOURCE)
    if gpus is not None:  # extended resources must be limited to what is requested
        resources.setdefault("limits", {}).setdefault(naming.GPU_RESOURCE, gpus)
    if resources:
        c["resources"] = resources
    c.setdefault("securityContext", copy.deepcopy(config.container_security_context))
    if config.tmp_volume:
        mounts = c.get("volumeMounts") or []
        if not any(m.get("mountPath") == "/tmp" for m in mounts):
            c["volumeMounts"] = mounts + [{"name": "tmp", "mountPath": "/tmp"}]
    return c


def _quantities_as_strings(container: dict[str, Any]) -> dict[str, Any]:
    """`nvidia.com/gpu: 1` is how users write limits (and valid for the API server), but the
    kubernetes client only takes quantities as strings."""
    resources = container.get("resources")
    if not resources:
        return container
    fixed = {
        kind: {
            k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in (resources.get(kind) or {}).items()
        }
        for kind in ("limits", "requests")
        if kind in resources
    }
    return {**container, "resources": {**resources, **fixed}}


def build_pod(job: TrainingJob, rtype: ReplicaType, index: int, config: OperatorConfig) -> dict[str, Any]:
    """Pod `<job>-<type>-<index>`: the user's template with the operator's parts filled in."""
    replica = job.spec.replica_specs[rtype]
    template = copy.deepcopy(replica.template or {})
    user_spec: dict[str, Any] = template.get("spec") or {}
    name = naming.pod_name(job.name, rtype, index)

    containers = list(user_spec.get("containers") or [])
    main = next((c for c in containers if c.get("name") == naming.CONTAINER_NAME), None)
    tf_container = _container(job, rtype, index, config, main or {})
    containers = [tf_container if c is main else c for c in containers] if main else [tf_container, *containers]

    spec: dict[str, Any] = {**user_spec}
    spec["containers"] = [_quantities_as_strings(c) for c in containers]
    if spec.get("initContainers"):
        spec["initContainers"] = [_quantities_as_strings(c) for c in spec["initContainers"]]
    spec["hostname"] = name
    spec["subdomain"] = naming.service_name(job.name)
    spec["restartPolicy"] = semantics.kubelet_restart_policy(rtype, replica.restart_policy)
    spec.setdefault("enableServiceLinks", False)
    spec.setdefault("securityContext", copy.deepcopy(config.pod_security_context))
    if config.tmp_volume and any(
        m.get("name") == "tmp" and m.get("mountPath") == "/tmp" for m in tf_container.get("volumeMounts", [])
    ):
        spec["volumes"] = _merge_named(
            [{"name": "tmp", "emptyDir": {}}], spec.get("volumes") or [], "name", ours_win=False
        )
    if _gpu_requested(tf_container.get("resources") or {}):
        toleration = {"key": naming.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        tolerations = spec.get("tolerations") or []
        if not any(t.get("key") == naming.GPU_RESOURCE for t in tolerations):
            spec["tolerations"] = tolerations + [toleration]

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": object_meta(job, name, naming.replica_labels(job.name, rtype, index), template.get("metadata")),
        "spec": spec,
    }
    return security.secure_pod(gang.apply_to_pod(pod, job, rtype, config.scheduling))


def desired_pods(job: TrainingJob, config: OperatorConfig) -> list[dict[str, Any]]:
    """Every pod of the job, in creation order (tfps.api.semantics.REPLICA_ORDER)."""
    return [build_pod(job, rtype, i, config) for rtype, i in semantics.replicas(job.spec)]
