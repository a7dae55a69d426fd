"""PS push+pull goodput against raw TCP over loopback, measured in pairs in one process.

`python -m tfps.bench.goodput --mib 64 --seconds 10 --repeats 3` starts a real tfps PS
(`tfps ps`, one shard holding a model of about `--mib` MiB of fp32 parameters, async, SGD)
on 127.0.0.1 and then, per repeat, measures back to back:
- raw TCP: one connection, Python sockets, `--raw-mib` MiB in 1 MiB sends, received into
  a preallocated buffer by a thread;
- tfps: the worker's Step call through the runtime's client (`ShardClient.step`, over the
  PS's data path as a worker sends it), each pushing a whole model's gradients and pulling
  the whole model back. Goodput counts the tensor bytes pushed plus pulled.
- grpcio alone: the same bytes in the same chunks to an echo server in its own process
  that does nothing else (`--echo-server`): what gRPC's Python stack allows at best, so
  the report can tell the transport's share of the gap from tfps's.
It prints one JSON line with the MiB/s of each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .procs import LOOPBACK, child_env, free_port, kill_group, module_cmd

MIB = 1 << 20
SEND_BYTES = MIB  # raw TCP: bytes per send
INPUT_DIM, CLASSES = 1024, 16


def model_args_for(mib: float) -> dict:
    """modelArgs of an `mlp` (INPUT_DIM-W-W-CLASSES) whose fp32 parameters take about `mib` MiB."""
    n = mib * MIB / 4
    # W^2 + (INPUT_DIM + CLASSES + 2) W + CLASSES = n
    b = INPUT_DIM + CLASSES + 2
    width = int((-b + math.sqrt(b * b + 4 * (n - CLASSES))) / 2)
    return {"inputDim": INPUT_DIM, "hidden": [max(1, width), max(1, width)], "classes": CLASSES}


def raw_tcp_mib_per_second(total_mib: int) -> float:
    """One loopback connection: send `total_mib` MiB in 1 MiB sends; time until all received."""
    total = total_mib * MIB
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen(1)
    received = [0]

    def sink() -> None:
        conn, _ = listener.accept()
        buf = bytearray(4 * MIB)
        view = memoryview(buf)
        with conn:
            while received[0] < total:
                n = conn.recv_into(view)
                if n == 0:
                    break
                received[0] += n
            conn.sendall(b"k")

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    payload = memoryview(bytes(SEND_BYTES))
    with socket.create_connection(listener.getsockname()) as conn:
        start = time.perf_counter()
        for _ in range(total // SEND_BYTES):
            conn.sendall(payload)
        conn.recv(1)
        elapsed = time.perf_counter() - start
    thread.join()
    listener.close()
    if received[0] != total:
        raise RuntimeError(f"raw TCP: received {received[0]} of {total} bytes")
    return total / MIB / elapsed


def echo_server(port_file: str, mib: float) -> None:
    """A bare grpcio server: a stream call that reads every chunk and answers with as many
    bytes, in CHUNK_BYTES chunks. Writes its port to `port_file`, serves until killed."""
    from concurrent import futures

    import grpc

    from tfps.runtime import wire
    from tfps.runtime.malloc import keep_large_buffers

    keep_large_buffers()  # as the PS does
    chunks = list(wire.iter_chunks(bytes(int(mib * MIB))))

    def echo(request_iterator, context):
        wire.join(request_iterator)
        return iter(chunks)

    handler = grpc.method_handlers_generic_handler("echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(4), options=wire.GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def grpc_echo_mib_per_second(mib: float, seconds: float) -> float:
    """Push and pull `mib` MiB per call through bare grpcio, as tfps's chunked Step does."""
    import grpc

    from tfps.runtime import wire

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(
            module_cmd("tfps.bench.goodput", "--echo-server", str(port_file), "--mib", str(mib)), env=child_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the grpcio echo server did not start")
                time.sleep(0.1)
            address = f"{LOOPBACK}:{port_file.read_text()}"
            payload = bytes(int(mib * MIB))
            chunks = list(wire.iter_chunks(payload))
            with grpc.insecure_channel(address, options=wire.GRPC_OPTIONS) as channel:
                call = channel.stream_stream("/echo/Echo")
                wire.join(call(iter(chunks)))  # warm-up
                moved, calls, start = 0, 0, time.perf_counter()
                while time.perf_counter() - start < seconds or calls < 2:
                    moved += len(payload) + len(wire.join(call(iter(chunks))))
                    calls += 1
                return moved / MIB / (time.perf_counter() - start)
        finally:
            kill_group(proc)


def _training(model_args: dict) -> dict:
    """spec.training of the goodput PS (manifest field names): async SGD, never done."""
    return {
        "model": "mlp", "modelArgs": model_args, "seed": 0, "batchSize": 128, "steps": 1_000_000_000,
        "optimizer": {"name": "sgd", "learningRate": 1e-6}, "consistency": {"mode": "async"},
    }  # fmt: skip


def start_ps(model_args: dict) -> tuple[subprocess.Popen, str]:
    """A real `tfps ps` process on loopback; returns it and its address once it answers."""
    from tfps.runtime.client import ShardClient

    address = f"{LOOPBACK}:{free_port()}"
    tf_config = {
        "cluster": {"ps": [address], "worker": [f"{LOOPBACK}:{free_port()}"]},
        "task": {"type": "ps", "index": 0},
        "environment": "cloud",
    }
    env = child_env({
        "TF_CONFIG": json.dumps(tf_config), "TFPS_TRAINING": json.dumps(_training(model_args)),
        "TFPS_JOB_NAME": "bench-goodput", "TFPS_BIND_ADDRESS": LOOPBACK, "TFPS_METRICS_PORT": str(free_port()),
    })  # fmt: skip
    # A file, not a pipe nobody reads (that could block the PS); the PS keeps its own descriptor,
    # ours closes once the PS answers.
    with tempfile.TemporaryFile(mode="w+") as log_file:
        proc = subprocess.Popen(
            module_cmd("tfps.cli.main", "ps"), env=env, stdout=subprocess.DEVNULL, stderr=log_file,
            start_new_session=True, text=True,
        )  # fmt: skip
        client = ShardClient(address, 0)
        deadline = time.monotonic() + 180
        try:
            while True:
                if proc.poll() is not None:
                    log_file.seek(0)
                    raise RuntimeError(f"tfps ps exited with {proc.returncode}: {log_file.read()[-500:]}")
                try:
                    client.status(timeout=2.0)
                    return proc, address
                except Exception:  # noqa: BLE001 - not up yet
                    if time.monotonic() > deadline:
                        raise RuntimeError("tfps ps did not answer within 180 s") from None
                    time.sleep(0.5)
        finally:
            client.close()


def tfps_mib_per_second(address: str, model_args: dict, seconds: float) -> dict:
    """Push a whole model's gradients and pull the whole model back, for `seconds`."""
    import numpy as np

    from tfps.runtime import wire
    from tfps.runtime.client import ShardClient
    from tfps.runtime.models import load_model
    from tfps.runtime.sharding import place

    model = load_model("mlp", model_args, 0)
    parts = place(model.params, 1).for_ps(0)
    grads = {p.name: np.full(p.shape, 1e-3, np.float32) for p in parts}
    nbytes = sum(g.nbytes for g in grads.values())
    large = nbytes > wire.UNARY_MAX_BYTES  # as the worker decides
    client = ShardClient(address, 0)
    try:
        version = 0

        def step() -> int:
            nonlocal version
            reply = client.step({"worker": 0, "tag": version, "pull": True, "batch": 128}, grads, large)
            version = int(reply.meta["version"])
            return sum(t.nbytes for t in reply.tensors.values())

        step()  # warm-up
        moved, calls = 0, 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds or calls < 2:
            moved += nbytes + step()
            calls += 1
        elapsed = time.perf_counter() - start
    finally:
        client.close()
    return {"mib_per_second": moved / MIB / elapsed, "calls": calls, "model_mib": nbytes / MIB, "seconds": elapsed}


def measure(args: argparse.Namespace) -> dict:
    model_args = model_args_for(args.mib)
    proc, address = start_ps(model_args)
    pairs = []
    try:
        for _ in range(args.repeats):
            raw = raw_tcp_mib_per_second(args.raw_mib)
            ours = tfps_mib_per_second(address, model_args, args.seconds)
            bare = grpc_echo_mib_per_second(ours["model_mib"], args.seconds)
            pairs.append({
                "raw_tcp": raw, "tfps": ours["mib_per_second"], "grpc_echo": bare,
                "tfps_calls": ours["calls"], "model_mib": ours["model_mib"],
            })  # fmt: skip
    finally:
        kill_group(proc)
    return {"system": "goodput", "pairs": pairs, "model_args": model_args, "raw_mib": args.raw_mib}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfps.bench.goodput", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0, help="model size on the PS, MiB of fp32")
    parser.add_argument("--raw-mib", type=int, default=256, help="raw TCP: MiB sent per measurement")
    parser.add_argument("--seconds", type=float, default=10.0, help="tfps: timed push+pull window per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--echo-server", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        echo_server(args.echo_server, args.mib)
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfps.runtime.malloc import keep_large_buffers

    keep_large_buffers()  # as a worker does
    print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
