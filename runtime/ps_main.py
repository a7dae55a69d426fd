"""`tfps ps`: the parameter-server pod entry point (no required arguments).

Serves its shard until SIGTERM, then stops gracefully, writes a last checkpoint and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from .process import add_pod_arguments, freeze_startup_objects, start_pod_process, user_code_failed

log = logging.getLogger("tfps.ps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pod_arguments(parser, "address to listen on (default: $TFPS_BIND_ADDRESS)")


def run(args: argparse.Namespace) -> int:
    from .auth import ServerSecurity

    # The PS runs on NumPy alone, and its request threads take turns under the GIL: one arena.
    started = start_pod_process("ps", ServerSecurity.from_env, tensorflow=False, one_arena=True)
    if started is None:
        return 2
    cfg, security = started
    index = cfg.cluster.task_index
    bind = args.bind or cfg.bind_address
    metrics_port = args.metrics_port or cfg.metrics_port

    from .metrics import Identity, PSMetrics
    from .models import UserCodeError, load_params, use_module_path
    from .ps import Shard, serve
    from .sharding import place

    # A user's model is built in a child process: the PS itself never imports TensorFlow.
    use_module_path(cfg.training.module_path)
    try:
        params = load_params(cfg.training.model, cfg.training.model_args, cfg.training.seed)
    except UserCodeError as err:
        return user_code_failed(cfg, "ps", err)
    plan = place(params, len(cfg.cluster.ps))
    metrics = PSMetrics(Identity(cfg.job, cfg.namespace, "ps", index))
    metrics.serve(metrics_port, bind)
    shard = Shard(
        plan.for_ps(index),
        {p.name: p for p in params},
        cfg.training,
        num_workers=max(1, len(cfg.cluster.workers)),
        index=index,
        metrics=metrics,
        checkpoint_root=cfg.training.checkpoint.path,
        worker_timeout=cfg.settings.worker_timeout_seconds,
        num_ps=len(cfg.cluster.ps),
    )
    server, port = serve(shard, cfg.listen_address(cfg.own_port), security=security, data_port=cfg.data_port)
    freeze_startup_objects()
    log.info(
        json.dumps(
            {
                "event": "serving",
                "address": cfg.listen_address(port),
                "data_port": server.data_port,
                "metrics_port": metrics_port,
                "step": shard.version,
                "parts": len(plan.for_ps(index)),
                "parameters": sum(p.size for p in plan.for_ps(index)),
                "mode": cfg.training.consistency.mode.value,
                "auth": security.material is not None,
                "tls": cfg.training.tls,
            }
        )
    )

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info(json.dumps({"event": "stopping", "step": shard.version}))
    server.stop(grace=5).wait()
    shard.checkpoint_now()
    shard.close()
    return 0
