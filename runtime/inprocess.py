"""PS shards and workers in one process (threads, real gRPC on loopback).

For tests and benchmarks that want to look inside: the shards' state, byte counters and
final parameters, without process start-up. `tfps local` is the multi-process path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from tfps.api.spec import TrainingSpec

from .metrics import Identity, PSMetrics, WorkerMetrics
from .models import ModelDef, load_model
from .ps import Shard, serve
from .sharding import place
from .worker import Worker


@dataclass
class InProcessCluster:
    training: TrainingSpec
    num_ps: int = 1
    num_workers: int = 1
    job: str = "inprocess"
    checkpoint_root: str | None = None
    shards: list[Shard] = field(default_factory=list)
    servers: list = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    def model(self) -> ModelDef:
        return load_model(self.training.model, self.training.model_args, self.training.seed)

    def start(self) -> InProcessCluster:
        model = self.model()
        plan = place(model.params, self.num_ps)
        params = {p.name: p for p in model.params}
        for i in range(self.num_ps):
            shard = Shard(
                plan.for_ps(i),
                params,
                self.training,
                self.num_workers,
                i,
                PSMetrics(Identity(self.job, "default", "ps", i)),
                checkpoint_root=self.checkpoint_root,
                num_ps=self.num_ps,
            )
            server, port = serve(shard, "127.0.0.1:0")
            self.shards.append(shard)
            self.servers.append(server)
            self.addresses.append(f"127.0.0.1:{port}")
        return self

    def worker(self, index: int) -> Worker:
        return Worker(
            self.model(),
            self.training,
            self.addresses,
            self.num_workers,
            index,
            WorkerMetrics(Identity(self.job, "default", "worker", index)),
        )

    def train(self) -> tuple[list[Worker], dict]:
        """Run every worker to the end in threads; returns the workers and worker 0's result."""
        workers = [self.worker(i) for i in range(self.num_workers)]
        errors: list[BaseException] = []

        def run(w: Worker) -> None:
            try:
                w.run()
            except BaseException as err:  # surfaced below, in the caller's thread
                errors.append(err)

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        result = workers[0].finish(self.training.export_path)
        return workers, result

    def parameters(self) -> dict[str, np.ndarray]:
        """The whole model, read from the shards."""
        w = self.worker(0)
        try:
            return w.full_params()
        finally:
            w.close()

    def stop(self) -> None:
        for server in self.servers:
            server.stop(grace=None)
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> InProcessCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
