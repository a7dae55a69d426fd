"""`tfps worker`: the worker pod entry point (no required arguments).

Exits 0 once the job's step count is reached (worker 0 after evaluating, exporting when
spec.training.exportPath is set, and asking every PS for a final checkpoint); non-zero on a
fatal error (a PS unreachable for longer than the retry window, a refused request).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from .process import add_pod_arguments, freeze_startup_objects, start_pod_process, user_code_failed

log = logging.getLogger("tfps.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pod_arguments(parser, "address for the metrics server (default: $TFPS_BIND_ADDRESS)")


def run(args: argparse.Namespace) -> int:
    from .auth import ClientSecurity

    started = start_pod_process("worker", ClientSecurity.from_env)
    if started is None:
        return 2
    cfg, security = started
    index = cfg.cluster.task_index

    import grpc

    from .metrics import Identity, WorkerMetrics
    from .models import UserCodeError, load_model, use_module_path
    from .worker import Worker, use_gpu_memory_growth

    gpus = use_gpu_memory_growth()
    metrics = WorkerMetrics(Identity(cfg.job, cfg.namespace, "worker", index))
    metrics.serve(args.metrics_port or cfg.metrics_port, args.bind or cfg.bind_address)
    use_module_path(cfg.training.module_path)
    try:
        model = load_model(cfg.training.model, cfg.training.model_args, cfg.training.seed)
    except UserCodeError as err:
        return user_code_failed(cfg, "worker", err)
    worker = Worker(
        model,
        cfg.training,
        cfg.cluster.ps,
        max(1, len(cfg.cluster.workers)),
        index,
        metrics,
        retry_seconds=cfg.settings.ps_retry_seconds,
        security=security,
    )
    freeze_startup_objects()
    log.info(
        json.dumps(
            {"event": "starting", "worker": index, "ps": cfg.cluster.ps, "gpus": len(gpus), "model": cfg.training.model}
        )
    )
    try:
        worker.run()
        if index != 0:
            log.info(
                json.dumps(
                    {
                        "event": "finished",
                        "worker": index,
                        "steps": worker.versions[0],
                        "local_steps": worker.steps_done,
                    }
                )
            )
            return 0
        result = worker.finish(cfg.training.export_path)
    except grpc.RpcError as err:
        log.error(json.dumps({"event": "failed", "worker": index, "code": err.code().name, "detail": err.details()}))
        return 1
    finally:
        worker.close()
    result["local_steps"] = worker.steps_done
    log.info(json.dumps({"event": "eval", **result}))
    result_file = cfg.settings.result_file
    if result_file:
        tmp = result_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, result_file)
    write_termination_message(result, cfg.settings.termination_log)
    return 0


def write_termination_message(result: dict, path: str) -> None:
    """In a pod, the kubelet copies this file into the container's terminated state, where the
    operator reads the final result (status.result) after the pods are gone."""
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return  # not in a pod (`tfps local`): the result file above is the channel
    try:
        with open(path, "w") as fh:
            json.dump(result, fh, separators=(",", ":"))
    except OSError as err:
        log.warning(json.dumps({"event": "termination-message-unwritten", "error": str(err)}))
