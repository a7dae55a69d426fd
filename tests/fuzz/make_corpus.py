"""Writes the request targets' seed corpus (tests/fuzz/corpus/requests/): the Step requests that real
workers send a PS, recorded as the PS received them, and a few of the malformed requests that the
PS once took the wrong way, made from them.

    PYTHONSAFEPATH=1 .venv/bin/python tests/fuzz/make_corpus.py

Two workers (TensorFlow, in this process) train the corpus's model (tests/fuzz/common.py) for a few
steps, async and then sync, against real PS servers on loopback: their pushes (dense gradients, a
table's rows and their gradients, the rows the next batch asks for), their pulls, both transports.
The files are committed; run this again when the wire or the model of the corpus changes."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py (PYTHONSAFEPATH leaves this folder out)
import common  # noqa: E402  (first of tfps: the kernels to use)

from tfps.runtime import wire  # noqa: E402
from tfps.runtime.inprocess import InProcessCluster  # noqa: E402
from tfps.runtime.ps import Shard  # noqa: E402

STEPS = 3


def record(mode: str) -> list[bytes]:
    """The requests the PS got while WORKERS workers trained STEPS steps each in `mode`."""
    seen: list[bytes] = []
    real = Shard.step

    def step(self, data, encoding="bytes"):
        seen.append(bytes(data))
        return real(self, data, encoding)

    Shard.step = step  # type: ignore[method-assign]
    try:
        with InProcessCluster(common.training(mode), num_ps=1, num_workers=common.WORKERS) as cluster:
            workers = [cluster.worker(i) for i in range(common.WORKERS)]
            for worker in workers:
                worker.pull()
            for _ in range(STEPS):  # a sync step closes once every worker pushed: the workers in threads
                threads = [threading.Thread(target=worker.train_step) for worker in workers]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            for worker in workers:
                worker.close()
    finally:
        Shard.step = real  # type: ignore[method-assign]
    return seen


def message(meta: dict, entries: list, arrays: list, align: int = wire.ALIGN) -> bytes:
    """A wire message of any header entries (names of any JSON type) and each tensor's bytes, laid out
    as wire.pieces lays them (`align`: where each tensor may start)."""
    header = json.dumps({"meta": meta, "tensors": entries, "align": align}, separators=(",", ":")).encode()
    header += b" " * (-(4 + len(header)) % align)
    out = struct.pack("<I", len(header)) + header
    for arr in arrays:
        out += bytes(-len(out) % align) + arr.tobytes()
    return out


def remade(data: bytes, rename=lambda name: name, align: int = wire.ALIGN) -> bytes:
    """The message in `data` with its tensors' names changed by `rename` and laid out on `align`."""
    msg = wire.decode(data)
    entries = [[rename(n), wire.dtype_name(a.dtype), list(a.shape), a.nbytes] for n, a in msg.tensors.items()]
    return message(msg.meta, entries, list(msg.tensors.values()), align)


def main() -> None:
    requests = record("async") + record("sync")
    push = max(requests, key=len)
    requests += [
        remade(push, align=1),  # tensors at odd offsets
        remade(push, lambda name: [name]),  # names that are lists
        remade(push, lambda name: 7),  # or numbers
        remade(push, lambda name: name + ":" if ":" not in name else name),  # a dense part's name ending in ':'
        message({"worker": 0}, [["w", "float32", [1] * 40 + [0], 0]], []),  # more dimensions than NumPy takes
    ]
    shutil.rmtree(common.REQUESTS, ignore_errors=True)
    common.REQUESTS.mkdir(parents=True)
    for data in requests:
        (common.REQUESTS / f"{hashlib.sha1(data).hexdigest()[:16]}.bin").write_bytes(data)
    sizes = sorted(len(r) for r in requests)
    print(f"{len(requests)} requests of {sizes[0]}..{sizes[-1]} bytes into {common.REQUESTS}")


if __name__ == "__main__":
    main()
