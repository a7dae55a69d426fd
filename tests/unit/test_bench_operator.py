"""The operator benchmarks' pure parts: percentiles, per-run figures, medians and goals, the
identical pod templates of both operators' jobs, the API server's counters."""

import io

import pytest
from rich.console import Console

from tfps.api.spec import TrainingJob
from tfps.bench import operator_apiserver as apiserver
from tfps.bench import operator_report as report
from tfps.bench import operator_scale as scale
from tfps.bench import training_operator as anchor

PLACEMENT = {"nodeSelector": {"type": "kwok"}, "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}]}


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert report.percentile(values, 0.5) == 51.0  # round(0.5 * 99) = 50 -> the 51st
    assert report.percentile(values, 0.99) == 99.0
    assert report.percentile([3.0], 0.99) == 3.0
    assert report.percentile([], 0.5) is None


def test_run_figures_from_timestamps():
    created = {"a": 0.0, "b": 1.0, "c": 2.0}
    out = report.run_figures(
        created,
        all_pods_created={"a": 1.0, "b": 3.0, "c": 6.0},
        running={"a": 2.0, "b": 4.0},
        pods_running={},
        succeeded={"a": 10.0, "b": 11.0, "c": 20.0},
        cleaned={"a": 12.0, "b": 13.0},
    )
    assert out["to_all_pods_created_p50"] == 2.0 and out["to_all_pods_created_p99"] == 4.0
    assert out["to_running_n"] == 2 and out["to_pods_running_p50"] is None
    assert out["all_succeeded_s"] == 20.0  # from the first create to the last job's success
    assert out["all_cleaned_s"] is None  # job c's PS pods never went


def _run(side, p99, cpu, rss=100.0):
    return {"side": side, "to_all_pods_created_p99": p99, "operator_cpu_s": cpu, "operator_peak_rss_mib": rss}


def test_goals_on_medians_against_both_anchors():
    runs = [
        _run("tfps", 10.0, 5.0),
        _run("tfps", 12.0, 6.0),
        _run("tfps", 50.0, 4.0),
        _run("stock", 30.0, 8.0),
        _run("stock", 20.0, 8.0),
        _run("stock", 40.0, 8.0),
        _run("raised", 10.0, 5.0),
        _run("raised", None, 5.0),
    ]
    out = report.summarize(runs)
    assert out["sides"]["tfps"]["median"]["to_all_pods_created_p99"] == 12.0
    assert out["sides"]["raised"]["median"]["to_all_pods_created_p99"] == 10.0  # a failed run does not count
    goals = {g["label"]: g for g in out["goals"]}
    assert goals["p99 to all pods created / stock"]["value"] == pytest.approx(0.4)
    assert goals["p99 to all pods created / stock"]["met"] is True
    assert goals["p99 to all pods created / raised"]["met"] is False  # 1.2 > 1.0
    assert goals["operator CPU / stock"]["met"] is True
    assert goals["tfps operator peak RSS (MiB)"]["met"] is True
    text = io.StringIO()
    report.render(out, Console(file=text, width=200))
    assert "tfps #3" in text.getvalue() and "missed" in text.getvalue()


def test_a_side_not_run_leaves_its_goals_unmeasured():
    goals = {g["label"]: g for g in report.summarize([_run("tfps", 1.0, 1.0)])["goals"]}
    assert goals["p99 to all pods created / stock"]["met"] is None


def test_both_operators_get_the_same_pod_templates():
    tpl = scale.templates(PLACEMENT, "tfps.io/kwok-succeed-after", "30s")
    tfps = scale.tfps_job("job-000", 2, 8, tpl)
    tfjob = anchor.tfjob("job-000", 2, 8, tpl)
    for ours, theirs in (("PS", "PS"), ("Worker", "Worker")):
        assert tfps["spec"]["replicaSpecs"][ours] == tfjob["spec"]["tfReplicaSpecs"][theirs]
    worker = tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]
    assert worker["metadata"]["annotations"] == {"tfps.io/kwok-succeed-after": "30s"}
    assert worker["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert (
        "annotations" not in tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"]["metadata"]
    )  # the PS never ends by itself
    assert tfjob["spec"]["runPolicy"]["cleanPodPolicy"] == tfps["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    TrainingJob.model_validate(
        {**tfps, "metadata": {"name": "job-000", "namespace": "ns"}}
    )  # tfps's own schema takes it


def test_tfjob_phase_is_its_last_true_condition():
    status = {
        "conditions": [
            {"type": "Created", "status": "True"},
            {"type": "Running", "status": "False"},
            {"type": "Succeeded", "status": "True"},
        ]
    }
    assert anchor.phase(status) == "Succeeded"
    assert anchor.phase({"conditions": [{"type": "Created", "status": "True"}]}) == "Created"
    assert anchor.phase(None) is None


def test_raised_build_takes_the_client_limit_flags_and_stock_does_not():
    stock, raised = anchor.argv("ns", False, 9443), anchor.argv("ns", True, 9443)
    assert "--namespace=ns" in stock and not any(a.startswith("--kube-api-qps") for a in stock)
    assert "--kube-api-qps=1000" in raised and "--controller-threads=4" in raised
    assert anchor.binary(True).parent.name.endswith("-raised")


def _requests(code: str, scope: str, subresource: str, verb: str, value: int) -> str:
    """One apiserver_request_total sample for pods, labelled as the API server labels it."""
    return (
        f'apiserver_request_total{{code="{code}",component="apiserver",group="",resource="pods",scope="{scope}",'
        f'subresource="{subresource}",verb="{verb}",version="v1"}} {value}'
    )


METRICS = "\n".join(
    [
        "# HELP apiserver_request_total x",
        _requests("201", "resource", "", "POST", 30),
        _requests("409", "resource", "", "POST", 2),
        _requests("200", "resource", "status", "PATCH", 7),
        _requests("200", "namespace", "", "WATCH", 4),
        'apiserver_flowcontrol_dispatched_requests_total{flow_schema="tfps-bench-operator",priority_level="exempt"} 41',
        'apiserver_flowcontrol_dispatched_requests_total{flow_schema="exempt",priority_level="exempt"} 1000',
        "",
    ]
)


def test_apiserver_counters():
    by = apiserver.requests_by(METRICS)
    assert by == {"POST pods": 32.0, "PATCH pods/status": 7.0, "WATCH pods": 4.0}
    assert apiserver.writes(by) == 39.0
    assert apiserver.diff(by, {"POST pods": 30.0, "WATCH pods": 4.0}) == {"POST pods": 2.0, "PATCH pods/status": 7.0}
    assert apiserver.flow_count(METRICS) == 41.0
    assert apiserver.flow_count("") is None
