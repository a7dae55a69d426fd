"""Gang scheduling's pure parts: which jobs are gang-scheduled, the Workload or PodGroup each
backend gets, and what every pod carries to name its group. The objects themselves are checked
against the real API server (the Workload API) and the published PodGroup CRDs in
tests/integration/test_gang_scheduling.py."""

from __future__ import annotations

from tfps.api.spec import ReplicaType, TrainingJob
from tfps.operator import builders, gang
from tfps.operator.config import GangBackend, OperatorConfig, SchedulingSettings


def _job(policy: dict | None = None, chief: bool = False, evaluator: bool = False) -> TrainingJob:
    replicas = {"PS": {"replicas": 2}, "Worker": {"replicas": 6}}
    if chief:
        replicas["Chief"] = {"replicas": 1}
    if evaluator:
        replicas["Evaluator"] = {"replicas": 1}
    spec = {"replicaSpecs": replicas, "training": {"steps": 10}}
    if policy is not None:
        spec["runPolicy"] = {"schedulingPolicy": policy}
    return TrainingJob.model_validate(
        {
            "apiVersion": "tfps.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "ctr", "namespace": "ml", "uid": "u-1"},
            "spec": spec,
        }
    )


def _config(backend: GangBackend, **kw) -> OperatorConfig:
    return OperatorConfig(scheduling=SchedulingSettings(gang=backend, **kw))


def _pods(job: TrainingJob, config: OperatorConfig) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in builders.desired_pods(job, config)}


def test_only_jobs_that_ask_are_gang_scheduled_unless_all_jobs():
    settings = SchedulingSettings(gang=GangBackend.WORKLOAD)
    assert gang.backend_for(_job(), settings) is GangBackend.NONE
    assert gang.backend_for(_job({}), settings) is GangBackend.WORKLOAD
    assert gang.backend_for(_job(), settings.model_copy(update={"all_jobs": True})) is GangBackend.WORKLOAD
    assert gang.backend_for(_job({}), SchedulingSettings(gang=GangBackend.NONE)) is GangBackend.NONE


def test_auto_is_the_workload_api_when_served_else_none():
    auto = SchedulingSettings()
    assert auto.gang is GangBackend.AUTO
    assert gang.resolve(auto, workload_api_served=True).gang is GangBackend.WORKLOAD
    assert gang.resolve(auto, workload_api_served=False).gang is GangBackend.NONE
    assert gang.resolve(SchedulingSettings(gang=GangBackend.VOLCANO), True).gang is GangBackend.VOLCANO
    # never resolved (e.g. `tfps render`): no gang rather than a guess
    assert gang.backend_for(_job({}), auto) is GangBackend.NONE


def test_min_available_defaults_to_every_ps_worker_and_chief():
    assert gang.min_available(_job({})) == 8
    assert gang.min_available(_job({}, chief=True, evaluator=True)) == 9
    assert gang.min_available(_job({"minAvailable": 3})) == 3


def test_workload_names_the_job_and_every_gang_pod_points_at_it():
    job = _job({}, evaluator=True)
    workload = gang.group_object(job, GangBackend.WORKLOAD)
    assert workload["apiVersion"] == "scheduling.k8s.io/v1alpha1" and workload["kind"] == "Workload"
    assert workload["metadata"]["name"] == "ctr" and workload["metadata"]["namespace"] == "ml"
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert workload["spec"]["controllerRef"] == {"apiGroup": "tfps.io", "kind": "TrainingJob", "name": "ctr"}
    assert workload["spec"]["podGroups"] == [{"name": "training", "policy": {"gang": {"minCount": 8}}}]

    pods = _pods(job, _config(GangBackend.WORKLOAD))
    for name in ("ctr-ps-0", "ctr-ps-1", "ctr-worker-5"):
        assert pods[name]["spec"]["workloadRef"] == {"name": "ctr", "podGroup": "training"}
        assert "schedulerName" not in pods[name]["spec"]  # the default scheduler
    assert "workloadRef" not in pods["ctr-evaluator-0"]["spec"]


def test_coscheduling_podgroup_and_label():
    job = _job({"minAvailable": 5, "scheduleTimeoutSeconds": 60})
    group = gang.group_object(job, GangBackend.COSCHEDULING)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and group["kind"] == "PodGroup"
    assert group["spec"] == {"minMember": 5, "scheduleTimeoutSeconds": 60}
    pod = _pods(job, _config(GangBackend.COSCHEDULING))["ctr-worker-0"]
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "ctr"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert "workloadRef" not in pod["spec"]


def test_volcano_podgroup_queue_priority_and_annotation():
    job = _job({"queue": "research", "priorityClass": "high"})
    group = gang.group_object(job, GangBackend.VOLCANO)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {"minMember": 8, "queue": "research", "priorityClassName": "high"}
    pod = _pods(job, _config(GangBackend.VOLCANO, scheduler_name="my-volcano"))["ctr-ps-1"]
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "ctr"
    assert pod["spec"]["schedulerName"] == "my-volcano"
    assert pod["spec"]["priorityClassName"] == "high"


def test_priority_class_applies_without_a_gang_backend_and_never_overrides_the_template():
    job = TrainingJob.model_validate(
        {
            "apiVersion": "tfps.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "p", "namespace": "ml"},
            "spec": {
                "runPolicy": {"schedulingPolicy": {"priorityClass": "high"}},
                "training": {"steps": 1},
                "replicaSpecs": {
                    "PS": {"replicas": 1, "template": {"spec": {"priorityClassName": "ps-class"}}},
                    "Worker": {"replicas": 1},
                },
            },
        }
    )
    pods = _pods(job, _config(GangBackend.NONE))
    assert pods["p-ps-0"]["spec"]["priorityClassName"] == "ps-class"
    assert pods["p-worker-0"]["spec"]["priorityClassName"] == "high"
    assert gang.group_object(job, GangBackend.NONE) is None


def test_chart_style_config_reads_the_scheduling_block():
    config = OperatorConfig.model_validate(
        {"scheduling": {"gang": "coscheduling", "allJobs": True, "schedulerName": "sp", "queueing": "kueue"}}
    )
    assert config.scheduling.gang is GangBackend.COSCHEDULING and config.scheduling.all_jobs
    assert config.scheduling.scheduler_for(GangBackend.COSCHEDULING) == "sp"
    assert ReplicaType.EVALUATOR not in gang.GANG_TYPES
