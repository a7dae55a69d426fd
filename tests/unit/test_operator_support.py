"""Small pure parts of the operator: progress from PS metrics, status merge patches,
operator metrics and configuration. (The chart's rendering of the configuration is loaded by
tests/unit/test_chart.py::test_operator_config_is_what_the_operator_reads, with helm.)"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError
from support import sample

from tfps.operator import progress
from tfps.operator.config import OperatorConfig
from tfps.operator.controller import CountsDelay
from tfps.operator.metrics import OperatorMetrics
from tfps.operator.status import counts_only, merge_patch
from tfps.runtime.metrics import Identity, PSMetrics


def _page(step: int, loss: float, examples: int, index: int = 0) -> str:
    m = PSMetrics(Identity("j", "ns", "ps", index))
    m.global_step.set(step)
    m.loss.set(loss)
    m.examples.inc(examples)
    return generate_latest(m.registry).decode()


def test_progress_from_the_runtimes_own_ps_metrics():
    pages = [progress.parse(_page(100, 0.5, 6400)), progress.parse(_page(98, 0.6, 6300, index=1))]
    first = progress.combine(pages, at=10.0)
    assert (first.step, first.loss, first.examples) == (100, 0.5, 6400)
    assert progress.to_status(first, None, "t") == {"step": 100, "loss": 0.5, "updateTime": "t"}
    later = progress.combine([progress.parse(_page(150, 0.4, 9600))], at=12.0)
    assert progress.to_status(later, first, "t")["examplesPerSecond"] == 1600.0


def test_progress_without_ps_pages_is_none():
    assert progress.combine([{}], at=1.0) is None


def test_merge_patch_removes_and_nests():
    old = {"a": 1, "b": {"x": 1, "y": 2}, "c": [1]}
    new = {"a": 1, "b": {"x": 1}, "c": [1, 2], "d": "new"}
    assert merge_patch(old, new) == {"b": {"y": None}, "c": [1, 2], "d": "new"}
    assert merge_patch(new, new) == {}


def test_a_change_of_pod_counts_alone_waits_and_goes_out_with_the_next_change():
    now = [100.0]
    delay = CountsDelay(1.0, clock=lambda: now[0])
    job = ("ns", "j")
    counts = {"psReady": "1/2", "replicaStatuses": {"PS": {"active": 1}}}
    assert counts_only(counts) and not counts_only({}) and not counts_only({**counts, "phase": "Running"})
    assert delay.wait(job, counts) == 1.0  # first seen: held for the whole delay
    now[0] += 0.4
    assert delay.wait(job, {"psReady": "2/2"}) == pytest.approx(0.6)  # still counted from the first
    now[0] += 0.6
    assert delay.wait(job, {"psReady": "2/2"}) == 0.0  # due: written
    assert delay.wait(job, counts) == 1.0  # a new change waits again
    assert delay.wait(job, {**counts, "phase": "Running"}) == 0.0  # with a phase change: at once
    assert delay.wait(job, counts) == 1.0  # and the wait starts over after that write
    delay.forget(job)
    assert delay.wait(("ns", "other"), {}) == 0.0


def test_operator_metrics_count_jobs_by_phase():
    m = OperatorMetrics()
    m.job_phase(("ns", "a"), "Running")
    m.job_phase(("ns", "b"), "Running")
    m.job_phase(("ns", "a"), "Succeeded")
    m.job_phase(("ns", "b"), None)
    text = generate_latest(m.registry).decode()
    assert sample(text, "tfps_operator_jobs", phase="Succeeded") == 1
    assert sample(text, "tfps_operator_jobs", phase="Running") == 0  # b was deleted, a moved on


def test_config_rejects_a_mistyped_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("imagez: {}\n")
    with pytest.raises(ValidationError, match="imagez"):
        OperatorConfig.load(path)


def test_credentials_are_refreshed_at_most_once_per_period():
    """The operator's API client re-reads its token every few seconds, not before every call."""
    from tfps.operator.kube import throttled

    now, calls = [0.0], []
    refresh = throttled(calls.append, 5.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 4.9, 5.0, 6.0, 11.0):
        now[0] = t
        refresh(t)
    assert calls == [0.0, 5.0, 11.0]


def test_api_client_refreshes_credentials_through_its_loader_only_once_per_period(tmp_path, monkeypatch):
    """With a kubeconfig token, requests still go through the loader's refresh (a token with an
    expiry is re-read), but 50 requests in a row rewrite the configuration once, not 50 times."""
    from tfps.operator import kube

    config = tmp_path / "kubeconfig"
    config.write_text("""
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: first}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
""")
    loader = kube.kube_config.kube_config.KubeConfigLoader
    rewrites, set_config = [], loader._set_config
    monkeypatch.setattr(loader, "_set_config", lambda self, conf: (rewrites.append(1), set_config(self, conf)))
    monkeypatch.setattr(kube.kube_config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    default = kube.client.Configuration.get_default_copy()
    try:
        api = kube.api_client()
    finally:
        kube.client.Configuration.set_default(default)
    rewrites.clear()
    tokens = {api.configuration.auth_settings()["BearerToken"]["value"] for _ in range(50)}
    assert tokens == {"Bearer first"}
    assert len(rewrites) == 1
