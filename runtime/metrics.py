"""Prometheus metrics of PS and worker pods: the names the dashboard and alerts rely on.

Every series carries `job`, `namespace`, `replica_type` and `replica_index`, so a
dashboard can select one TrainingJob without relabeling. Base units, `_total` counters.
Each process serves its own registry on TFPS_METRICS_PORT (9090).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LABELS = ("job", "namespace", "replica_type", "replica_index")
WARM_UP_ONE_IN = 10  # examples/s and step times leave out the first tenth of the steps (warm-up)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


@dataclass(frozen=True)
class Identity:
    job: str
    namespace: str
    replica_type: str  # "ps" | "worker" | "chief" | "evaluator"
    replica_index: int

    def values(self) -> tuple[str, str, str, str]:
        return (self.job, self.namespace, self.replica_type, str(self.replica_index))


class _Bound:
    """Creates metrics in a private registry with this process's identity labels bound."""

    def __init__(self, identity: Identity, registry: CollectorRegistry | None = None):
        self.identity = identity
        self.registry = registry or CollectorRegistry()

    def _make(self, cls, name, doc, extra_labels=(), **kw):
        metric = cls(name, doc, LABELS + tuple(extra_labels), registry=self.registry, **kw)
        if extra_labels:
            # Caller binds the remaining labels per event: metric.labels(reason=...)
            return _PartiallyBound(metric, self.identity)
        return metric.labels(*self.identity.values())

    def _counter(self, name: str, doc: str, extra_labels: tuple[str, ...] = ()):
        return self._make(Counter, name, doc, extra_labels)

    def _gauge(self, name: str, doc: str):
        return self._make(Gauge, name, doc)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS):
        return self._make(Histogram, name, doc, buckets=buckets)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        return start_http_server(port, addr=addr, registry=self.registry)


class _PartiallyBound:
    def __init__(self, metric, identity: Identity):
        self._metric, self._identity = metric, identity

    def labels(self, **extra):
        return self._metric.labels(*self._identity.values(), *extra.values())


class WorkerMetrics(_Bound):
    def __init__(self, identity: Identity, registry: CollectorRegistry | None = None):
        super().__init__(identity, registry)
        self.steps = self._counter("tfps_worker_steps_total", "Training steps this worker completed")
        self.examples = self._counter("tfps_worker_examples_total", "Examples this worker computed gradients on")
        self.step_seconds = self._histogram("tfps_worker_step_seconds", "Wall time of one step (pull, compute, push)")
        self.push_seconds = self._histogram("tfps_worker_push_seconds", "Time to push gradients to all PS shards")
        self.pull_seconds = self._histogram("tfps_worker_pull_seconds", "Time to pull parameters from all PS shards")
        self.compute_seconds = self._histogram("tfps_worker_compute_seconds", "Time to compute gradients")
        self.loss = self._gauge("tfps_worker_loss", "Training loss of the last batch")
        self.input_wait_seconds = self._histogram(
            "tfps_worker_input_wait_seconds",
            "Time the training loop waited for its next batch from training.data's files",
        )
        self.bad_records = self._counter(
            "tfps_worker_bad_records_total",
            "Records of training.data's files skipped as unreadable (onBadRecord: skip)",
        )
        self.retries = self._counter("tfps_worker_rpc_retries_total", "PS calls retried after an unavailable PS")
        self.eval_accuracy = self._gauge(
            "tfps_worker_eval_accuracy", "Test-split accuracy of the final parameters (worker 0, at the end)"
        )
        self.eval_auc = self._gauge(
            "tfps_worker_eval_auc", "Test-split ROC AUC of the final parameters, binary models (worker 0, at the end)"
        )


class PSMetrics(_Bound):
    def __init__(self, identity: Identity, registry: CollectorRegistry | None = None):
        super().__init__(identity, registry)
        self.updates = self._counter("tfps_ps_updates_applied_total", "Optimizer updates applied to this shard")
        self.apply_seconds = self._histogram("tfps_ps_apply_seconds", "Time to apply one update to this shard")
        self.staleness = self._histogram(
            "tfps_ps_gradient_staleness",
            "Versions between a gradient's parameters and the shard's when applied",
            buckets=_STALENESS_BUCKETS,
        )
        self.bytes_in = self._counter("tfps_ps_received_bytes_total", "Bytes of gradients received")
        self.bytes_out = self._counter("tfps_ps_sent_bytes_total", "Bytes of parameters sent")
        self.version = self._gauge(
            "tfps_ps_parameter_version", "Version of this shard's parameters (updates applied since start of training)"
        )
        self.global_step = self._gauge("tfps_ps_global_step", "Training step reached (the job's progress)")
        self.loss = self._gauge("tfps_ps_loss", "Mean training loss reported with the last applied update")
        self.examples = self._counter("tfps_ps_examples_total", "Examples behind the gradients applied to this shard")
        self.workers_live = self._gauge("tfps_ps_workers_live", "Workers that pushed or pulled recently")
        self.rejected = self._counter(
            "tfps_ps_rejected_requests_total",
            "Requests refused (malformed, unauthenticated, ...)",
            extra_labels=("reason",),
        )
        self.checkpoints = self._counter("tfps_ps_checkpoints_total", "Checkpoints of this shard written")
        self.checkpoint_step = self._gauge("tfps_ps_checkpoint_step", "Step of the last checkpoint written or restored")
        self.restored = self._counter("tfps_ps_restores_total", "Times this shard was restored from a checkpoint")
        self.data_connections = self._gauge(
            "tfps_ps_data_connections", "Workers connected to this shard's data path (Steps over gRPC do not count)"
        )
        self.duplicates = self._counter(
            "tfps_ps_duplicate_pushes_total",
            "Retried pushes already applied (their reply was lost), answered without applying them again",
        )
