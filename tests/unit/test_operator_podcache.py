"""The pod cache the reconcile passes read instead of listing: what the watch and our own writes
put in it, in which order, and that what it keeps is enough for every decision."""

from __future__ import annotations

from tfps.api.spec import TrainingJob
from tfps.operator import builders, kueue
from tfps.operator.config import OperatorConfig
from tfps.operator.podcache import PodCache, slim
from tfps.operator.status import PodView

JOB = ("ns", "j")


def _job():
    return TrainingJob.model_validate(
        {
            "apiVersion": "tfps.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "j", "namespace": "ns", "uid": "uid-j", "generation": 1},
            "spec": {"replicaSpecs": {"PS": {"replicas": 1}, "Worker": {"replicas": 2}}, "training": {}},
        }
    )


def _pod(index=0, rv=10, uid=None, phase="Running", **meta):
    pod = builders.desired_pods(_job(), OperatorConfig())[1 + index]  # worker `index`
    pod["metadata"].update(uid=uid or f"uid-w{index}", resourceVersion=str(rv), **meta)
    pod["status"] = {
        "phase": phase,
        "podIP": "198.18.192.7",
        "hostIP": "198.18.128.1",
        "qosClass": "Burstable",
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"},
        ],
        "containerStatuses": [
            {
                "name": "tensorflow",
                "restartCount": 2,
                "image": "x",
                "imageID": "y",
                "state": {"terminated": {"exitCode": 3, "reason": "Error", "message": '{"step": 5}'}},
            }
        ],
    }
    return pod


def _names(cache):
    return sorted((p["metadata"]["name"], p["metadata"]["resourceVersion"]) for p in cache.pods(JOB))


def test_slim_keeps_every_fact_a_decision_reads():
    pod = _pod(finalizers=["kueue.x-k8s.io/managed"], annotations={kueue.RETRIABLE: "true"})
    kept = slim(pod)
    assert PodView.from_pod(kept) == PodView.from_pod(pod)
    assert kueue.release_patches([kept], "uid-j", ending=True, delete=["j-worker-0"]) == kueue.release_patches(
        [pod], "uid-j", ending=True, delete=["j-worker-0"]
    )
    assert (
        "spec" not in kept and "hostIP" not in kept["status"] and "image" not in kept["status"]["containerStatuses"][0]
    )


def test_a_job_no_pass_listed_has_no_entry_and_events_before_the_list_are_ignored():
    cache = PodCache()
    cache.observe(_pod())
    assert cache.pods(JOB) is None
    cache.replace(JOB, [], "5")
    assert cache.pods(JOB) == []
    cache.observe(_pod(rv=12))
    assert _names(cache) == [("j-worker-0", "12")]


def test_an_older_event_never_overwrites_a_newer_state():
    cache = PodCache()
    cache.replace(JOB, [_pod(rv=20)], "20")
    cache.observe(_pod(rv=15, phase="Pending"))
    assert _names(cache) == [("j-worker-0", "20")] and cache.pods(JOB)[0]["status"]["phase"] == "Running"


def test_replace_keeps_what_the_watch_brought_after_the_list_and_drops_the_rest():
    cache = PodCache()
    cache.replace(JOB, [_pod(0, rv=10), _pod(1, rv=11)], "11")
    cache.observe(_pod(1, rv=30))  # changed after the next list was read
    cache.replace(JOB, [_pod(1, rv=25)], "25")  # worker 0 is gone (its DELETED event was missed)
    assert _names(cache) == [("j-worker-1", "30")]


def test_a_deletion_removes_only_that_pod_and_a_late_create_answer_does_not_revive_it():
    cache = PodCache()
    cache.replace(JOB, [], "1")
    cache.observe(_pod(rv=40, uid="new"))  # the recreated pod, same name
    cache.forget(_pod(rv=35, uid="old"))  # the old one's DELETED event, late
    assert _names(cache) == [("j-worker-0", "40")]
    cache.forget(_pod(rv=50, uid="new"))
    cache.observe(_pod(rv=40, uid="new"))  # our create's answer, after its deletion event
    assert cache.pods(JOB) == []


def test_a_pod_we_deleted_counts_as_deleting_until_its_events_say_more():
    cache = PodCache()
    cache.replace(JOB, [_pod(phase="Failed")], "10")
    cache.mark_deleting(JOB, "j-worker-0")
    assert PodView.from_pod(cache.pods(JOB)[0]).deleting
    cache.drop(JOB)
    assert cache.pods(JOB) is None


def test_an_entry_older_than_the_relist_period_reads_as_none(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("tfps.operator.podcache.time.monotonic", lambda: clock[0])
    cache = PodCache()
    cache.replace(JOB, [_pod()], "10")
    clock[0] += 299
    assert cache.pods(JOB, max_age=300) is not None
    clock[0] += 2
    assert cache.pods(JOB, max_age=300) is None and cache.pods(JOB) is not None


def test_the_pod_watch_selects_every_pod_the_operator_makes_and_only_those():
    """The operator's pod watch filters on the API server (handlers.POD_SELECTOR): a label the
    builders stop setting would leave every job without pod events."""
    from tfps.operator.handlers import POD_SELECTOR

    def selects(labels: dict) -> bool:
        for term in POD_SELECTOR.split(","):
            key, eq, value = term.partition("=")
            if key not in labels or (eq and labels[key] != value):
                return False
        return True

    pods = builders.desired_pods(_job(), OperatorConfig())
    assert pods and all(selects(p["metadata"]["labels"]) for p in pods)
    other = dict(pods[0]["metadata"]["labels"])
    del other["tfps.io/job-name"]
    assert not selects(other) and not selects({"app": "web"})


def test_pod_events_fill_the_cache_and_wake_the_job_only_on_a_change_that_matters():
    from types import SimpleNamespace

    from tfps.operator.handlers import NEW_POD, PodState, pod_changed

    cache = PodCache()
    cache.replace(JOB, [], "5")
    shared = SimpleNamespace(controller=SimpleNamespace(pods=cache), pod_state={})
    created = _pod(rv=6, phase="Pending")
    created["status"] = {"phase": "Pending"}
    assert pod_changed(shared, "ADDED", created) is None  # the pass that created it knows
    assert shared.pod_state == {"uid-w0": NEW_POD}
    assert _names(cache) == [("j-worker-0", "6")]
    running = _pod(rv=7)
    assert pod_changed(shared, "MODIFIED", running) == JOB
    assert shared.pod_state["uid-w0"] == PodState(
        phase="Running", deleting=False, restarts=2, unschedulable=True, gated=False
    )
    assert pod_changed(shared, "MODIFIED", _pod(rv=8)) is None  # nothing a decision reads changed
    assert pod_changed(shared, "DELETED", _pod(rv=9)) == JOB
    assert cache.pods(JOB) == [] and shared.pod_state == {}


class _FakeKube:
    """A scripted API for the watch loop's resume and restart logic only (the real watch runs
    against the real API server in every operator integration test)."""

    def __init__(self, streams):
        self.streams, self.watched, self.versions = list(streams), [], 0

    def pods_version(self, namespace, selector):
        self.versions += 1
        return f"v{self.versions}"

    def watch_pods(self, namespace, selector, version, seconds):
        self.watched.append(version)
        result = self.streams.pop(0) if self.streams else None
        if result is None:
            self.watch.stop()
            return
        if isinstance(result, Exception):
            raise result
        yield from result


def _event(type_, rv):
    return {"type": type_, "object": {"metadata": {"resourceVersion": rv, "name": f"p{rv}"}}}


def test_the_pod_watch_resumes_where_it_stopped_and_starts_again_after_a_gap(monkeypatch):
    from kubernetes.client.rest import ApiException

    from tfps.operator import podwatch

    monkeypatch.setattr(podwatch, "RETRY_SECONDS", 0.0)
    kube = _FakeKube(
        [
            [_event("ADDED", "11"), _event("BOOKMARK", "15")],  # the API server ends the watch: resume at 15
            [_event("MODIFIED", "16")],
            ConnectionResetError("gone"),  # resume at 16
            ApiException(status=410, reason="too old"),  # a gap: start again from now
            [_event("DELETED", "30")],
        ]
    )
    events, gaps = [], []
    watch = podwatch.PodWatch(
        kube,
        ["ns"],
        "a=b",
        300,
        lambda t, p: events.append((t, p["metadata"]["resourceVersion"])),
        lambda: gaps.append(len(events)),
    )
    kube.watch = watch
    watch._run("ns")
    assert kube.watched == ["v1", "15", "16", "16", "v2", "30"]
    assert events == [("ADDED", "11"), ("MODIFIED", "16"), ("DELETED", "30")]
    assert gaps == [0, 2]
