"""`tfps operator`: run the kopf operator for TrainingJobs."""

from __future__ import annotations

import argparse
import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor

from .config import OperatorConfig

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", help="operator configuration YAML (default: $TFPS_OPERATOR_CONFIG, else built-in defaults)"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--namespace", "-n", action="append", default=[], help="serve this namespace (repeatable)")
    where.add_argument(
        "--all-namespaces", "-A", action="store_true", help="serve every namespace (the default without --namespace)"
    )
    parser.add_argument("--metrics-port", type=int, default=8080, help="port of the operator's /metrics (0: off)")
    parser.add_argument(
        "--metrics-address", default="0.0.0.0", help="address the metrics and health endpoints listen on"
    )
    parser.add_argument("--health-port", type=int, default=8081, help="port of /healthz (0: off)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="full", choices=["full", "plain", "json"])
    parser.add_argument(
        "--peering", default="tfps", help="kopf peering object shared by the replicas that elect a leader"
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority: the highest live one is active (default: random, so replicas differ)",
    )
    parser.add_argument(
        "--peering-lifetime",
        type=int,
        default=30,
        help="seconds after which a silent replica is taken for dead and a standby takes over",
    )
    parser.add_argument("--standalone", action="store_true", help="no leader election (a single replica)")


def run(args: argparse.Namespace) -> int:
    import kopf

    from . import gang, handlers
    from .controller import Controller
    from .kube import Kube, api_client
    from .metrics import OperatorMetrics

    kopf.configure(
        verbose=args.log_level == "debug",
        quiet=args.log_level in ("warning", "error"),
        log_format={"full": kopf.LogFormat.FULL, "plain": kopf.LogFormat.PLAIN, "json": kopf.LogFormat.JSON}[
            args.log_format
        ],
    )
    logging.getLogger("tfps").setLevel(args.log_level.upper())
    if args.log_level != "debug":
        # kopf logs every event handler call ("Handler ... succeeded"): one line per pod event.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    config = OperatorConfig.load(args.config)
    kube = Kube(api_client(pool_size=config.reconcile_workers * 2))
    config = config.model_copy(update={"scheduling": gang.resolve(config.scheduling, kube.serves(*gang.WORKLOAD_API))})
    log.info(
        "gang scheduling: %s (for %s)",
        config.scheduling.gang.value,
        "every job" if config.scheduling.all_jobs else "jobs that set runPolicy.schedulingPolicy",
    )
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_address)

    namespaces = list(dict.fromkeys(args.namespace))
    standalone = args.standalone
    if not standalone:
        # kopf pauses without its peering object; create it, or run alone when the peering
        # CRDs are not installed at all.
        found = [kube.ensure_peering(args.peering, ns) for ns in (namespaces or [None])]
        if not all(found):
            log.warning(
                "kopf peering CRDs (crds/kopf-peering.yaml) are not installed: running standalone, no leader election"
            )
            standalone = True
    # Two replicas with equal priorities would both pause; a random one makes them differ.
    priority = args.priority if args.priority is not None else random.SystemRandom().randint(1, 2**31 - 1)

    registry = kopf.OperatorRegistry()
    handlers.register(registry)
    shared = handlers.Shared(
        controller=Controller(kube, config, metrics),
        config=config,
        metrics=metrics,
        executor=ThreadPoolExecutor(max_workers=config.reconcile_workers, thread_name_prefix="tfps-reconcile"),
        peering=handlers.Peering(args.peering, priority, args.peering_lifetime, standalone),
        namespaces=namespaces,
    )
    log.info(
        "tfps operator %s (pid %d, priority %d) serving %s",
        "standalone" if standalone else f"peering {args.peering!r}",
        os.getpid(),
        priority,
        ", ".join(namespaces) or "all namespaces",
    )
    kopf.run(
        registry=registry,
        memo=handlers.memo_for(shared),
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=f"http://{args.metrics_address}:{args.health_port}/healthz" if args.health_port else None,
    )
    return 0
