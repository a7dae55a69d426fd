"""The operator's own Prometheus metrics, served on its own port (not the pods' 9090)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .status import PHASES


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("tfps_operator_jobs", "TrainingJobs served, by phase", ["phase"], registry=r)
        self.reconcile_seconds = Histogram(
            "tfps_operator_reconcile_seconds",
            "Time of one reconcile of a TrainingJob (API calls included)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.reconcile_errors = Counter(
            "tfps_operator_reconcile_errors_total", "Reconciles that failed and were retried", registry=r
        )
        self.pods_created = Counter("tfps_operator_pods_created_total", "Pods created", registry=r)
        self.pods_deleted = Counter(
            "tfps_operator_pods_deleted_total", "Pods deleted (cleanup, scale-down, suspend, restarts)", registry=r
        )
        self.pods_restarted = Counter(
            "tfps_operator_pods_restarted_total", "Failed pods recreated under their restartPolicy", registry=r
        )
        self._phase_of: dict[tuple[str, str], str] = {}
        for phase in PHASES:
            self.jobs.labels(phase).set(0)

    def job_phase(self, key: tuple[str, str], phase: str | None) -> None:
        """Record a job's phase (None: the job is gone) and refresh the per-phase gauge."""
        if phase is None:
            self._phase_of.pop(key, None)
        else:
            self._phase_of[key] = phase
        for p in PHASES:
            self.jobs.labels(p).set(sum(1 for v in self._phase_of.values() if v == p))

    def serve(self, port: int, addr: str = "0.0.0.0"):
        return start_http_server(port, addr=addr, registry=self.registry)
