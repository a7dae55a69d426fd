"""Anchor: TensorFlow's own ParameterServerStrategy on the benchmark MLP.

`python -m tfps.bench.anchor_tf_pss --hidden 512,512 --workers 2 --ps 1 --seconds 15`
starts the worker and PS servers (tf.distribute.Server) as separate processes on
127.0.0.1, runs the coordinator (ParameterServerStrategy + ClusterCoordinator, async)
in this process, and prints one JSON line with the steady-state examples/s: the steps
completed between the end of the warm-up and the end of the timed window, start-up
excluded.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

from tfps.runtime.process import peak_rss_bytes

from . import mlp
from .procs import LOOPBACK, child_env, free_port, module_cmd

MODULE = "tfps.bench.anchor_tf_pss"

CHUNK_SECONDS = 0.5
MAX_CHUNKS_IN_FLIGHT = 2  # bounds the coordinator's queue so the window ends on time
WATCH_SECONDS = 1.0
GIB = 1 << 30


def cluster_spec(workers: int, ps: int) -> dict[str, list[str]]:
    return {
        "chief": [f"{LOOPBACK}:{free_port()}"],
        "worker": [f"{LOOPBACK}:{free_port()}" for _ in range(workers)],
        "ps": [f"{LOOPBACK}:{free_port()}" for _ in range(ps)],
    }


def serve(cluster: dict[str, list[str]], job: str, index: int) -> None:
    """Run one tf.distribute.Server until the launching process goes away."""
    import tensorflow as tf

    parent = os.getppid()
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc", start=True
    )
    print("READY", flush=True)
    while os.getppid() == parent:
        time.sleep(0.5)
    del server


def start_servers(cluster: dict[str, list[str]]) -> list[subprocess.Popen]:
    procs = []
    for job in ("ps", "worker"):
        for index in range(len(cluster[job])):
            cmd = module_cmd(MODULE, "--serve", "--cluster", json.dumps(cluster), "--job", job, "--index", str(index))
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=child_env(), text=True))
    for proc in procs:
        for line in proc.stdout:
            if line.strip() == "READY":
                break
        else:
            raise RuntimeError(f"a tf.distribute.Server did not start (exit code {proc.wait()})")
    return procs


_START = time.monotonic()


def say(what: str) -> None:
    """A progress line on stderr: a run that times out is reported with its last lines."""
    print(f"anchor: {time.monotonic() - _START:.0f} s: {what}", file=sys.stderr, flush=True)


class ServerWatch:
    """The servers' peak resident memory, sampled while they run: a server the kernel kills
    for lack of memory can no longer say how large it grew."""

    def __init__(self, servers: list[subprocess.Popen], names: list[str]):
        self.servers, self.names = servers, names
        self.peaks = [0] * len(servers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="server-watch", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(WATCH_SECONDS):
            self.sample()

    def sample(self) -> None:
        for i, proc in enumerate(self.servers):
            self.peaks[i] = max(self.peaks[i], peak_rss_bytes(proc.pid) or 0)

    def peak(self, job: str) -> int:
        return max((p for p, n in zip(self.peaks, self.names, strict=True) if n.startswith(job)), default=0)

    def dead(self) -> str | None:
        """Which servers died before the end, how, and how large they had grown; None if none did."""
        gone = [
            (n, p.returncode, peak)
            for n, p, peak in zip(self.names, self.servers, self.peaks, strict=True)
            if p.poll() is not None
        ]
        if not gone:
            return None
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        said = [
            f"{n} exited with {code}"
            + (" (SIGKILL: the kernel's OOM killer, when memory ran out)" if code == -9 else "")
            + f" at {peak / GIB:.1f} GiB resident"
            for n, code, peak in gone
        ]
        return f"TensorFlow's servers died mid-run: {'; '.join(said)}; this machine has {total / GIB:.1f} GiB"

    def __str__(self) -> str:
        return ", ".join(f"{n} {p / GIB:.1f} GiB" for n, p in zip(self.names, self.peaks, strict=True))

    def stop(self) -> None:
        self._stop.set()
        self.sample()


@contextlib.contextmanager
def pss_cluster(args: argparse.Namespace):
    """The PS and worker servers as processes, watched (`ServerWatch`), and this process's
    strategy and coordinator."""
    import tensorflow as tf

    cluster = cluster_spec(args.workers, args.ps)
    servers = start_servers(cluster)
    watch = ServerWatch(servers, [f"{job} {i}" for job in ("ps", "worker") for i in range(len(cluster[job]))])
    say(f"{len(servers)} servers up")
    try:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=_partitioner(tf, args)
        )
        yield strategy, tf.distribute.coordinator.ClusterCoordinator(strategy), watch
    except Exception as err:
        died = watch.dead()
        if died:
            raise RuntimeError(died) from err
        raise
    finally:
        watch.stop()
        for proc in servers:
            proc.kill()
            proc.wait()


def per_worker_iterator(strategy, coordinator, dataset_fn):
    """An iterator over each worker's own copy of the dataset `dataset_fn(context)` makes."""
    import tensorflow as tf

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    return iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))


def _partitioner(tf, args: argparse.Namespace):
    if not (args.partition and args.ps > 1):
        return None
    # as TF's parameter-server tutorial does: large variables split across the PS
    return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=args.ps)


def _warm_up(coordinator, step_fn, iterator, args: argparse.Namespace) -> int:
    """A round of one step per worker (it traces), then rounds of four until the warm-up time
    is spent; the steps run. The small first round keeps a slow anchor's warm-up short (TF's
    first steps on a large Adam table are slow)."""
    start, steps = time.perf_counter(), 0
    while True:
        round_steps = args.workers * (4 if steps else 1)
        for _ in range(round_steps):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        steps += round_steps
        if time.perf_counter() - start >= args.warmup_seconds:
            return steps


def run_window(coordinator, step_fn, iterator, args: argparse.Namespace) -> tuple[int, float, float]:
    """Warm up, then schedule steps for `args.seconds`: (steps, seconds, last loss)."""
    warm_start = time.perf_counter()
    warm_steps = _warm_up(coordinator, step_fn, iterator, args)
    # Schedule in chunks of about CHUNK_SECONDS of work, at most MAX_CHUNKS_IN_FLIGHT
    # queued, so the window ends close to `seconds` whatever the model's speed; a chunk that
    # alone outlasts the window (a very slow anchor) is waited for before the next is queued.
    rate = warm_steps / (time.perf_counter() - warm_start)
    chunk = max(args.workers, int(rate * CHUNK_SECONDS))
    queued_at_most = MAX_CHUNKS_IN_FLIGHT if chunk / rate < args.seconds else 0
    say(f"warmed up: {warm_steps} steps in {time.perf_counter() - warm_start:.1f} s; chunks of {chunk} steps")

    in_flight: collections.deque[list] = collections.deque()
    steps, last = 0, None
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        in_flight.append([coordinator.schedule(step_fn, args=(iterator,)) for _ in range(chunk)])
        steps, last = steps + chunk, in_flight[-1][-1]
        if len(in_flight) > queued_at_most:
            for value in in_flight.popleft():
                value.fetch()
    coordinator.join()
    elapsed = time.perf_counter() - start
    return steps, elapsed, float(last.fetch()) if last is not None else float("nan")


def measure(args: argparse.Namespace) -> dict:
    import tensorflow as tf

    hidden = mlp.parse_hidden(args.hidden)
    model = mlp.load(args.input_dim, hidden, args.classes, args.seed)
    with pss_cluster(args) as (strategy, coordinator, _):
        with strategy.scope():
            initial = mlp.initial_values(model, args.seed)
            params = [tf.Variable(v, name=p.name.replace("/", "_")) for p, v in zip(model.params, initial, strict=True)]
        # the variables as stored: a partitioned one (ShardedVariable) is several, one per PS
        shards = [v for p in params for v in getattr(p, "variables", [p])]
        lr = tf.constant(args.learning_rate, tf.float32)

        def dataset_fn(context):
            # each worker starts at its own place in the data
            return mlp.tf_dataset(model, args.batch, offset=context.input_pipeline_id if context else 0)

        iterator = per_worker_iterator(strategy, coordinator, dataset_fn)

        @tf.function
        def step_fn(it):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    loss = mlp.loss_fn(model, params, x, y)
                for var, grad in zip(shards, tape.gradient(loss, shards), strict=True):
                    var.assign_sub(lr * grad)  # plain SGD, applied on the variable's PS
                return loss

            x, y = next(it)
            return strategy.run(replica_fn, args=(x, y))

        steps, elapsed, loss = run_window(coordinator, step_fn, iterator, args)
    return {
        "system": "tf_pss",
        "steps": steps,
        "seconds": elapsed,
        "examples_per_second": steps * args.batch / elapsed,
        "loss": loss,
        "workers": args.workers,
        "ps": args.ps,
        "params": mlp.param_count(args.input_dim, hidden, args.classes),
    }


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-dim", type=int, default=784)
    parser.add_argument("--hidden", default="512,512", help="hidden widths, comma-separated")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128, help="per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0, help="timed window after the warm-up")
    parser.add_argument("--warmup-seconds", type=float, default=3.0, help="untimed steps before the window")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfps.bench.anchor_tf_pss", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument(
        "--partition",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split large variables across the PS (MinSizePartitioner)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.serve:
        serve(json.loads(args.cluster), args.job, args.index)
        return 0
    print(json.dumps(measure(args)), flush=True)
    # The servers are gone: skip TF's teardown of the remote context, which would only log
    # connection errors about them.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
