"""What the fuzz targets share: the PS's C kernels to fuzz (the sanitized build that tests/fuzz/run.py
gives them in $TFPS_ROWS_SO, loaded as tfps.runtime._rows before anything imports that), the model
of the seed corpus (a small wide-deep: dense parts and embedding tables, so that both the C and
the Python request paths take part), and a PS shard of it.

Import this module before any tfps.runtime module."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

FUZZ = Path(__file__).resolve().parent
CORPUS = FUZZ / "corpus"
REQUESTS = CORPUS / "requests"  # real worker pushes (make_corpus.py), the request targets' seeds


def load_kernels() -> None:
    """tfps.runtime._rows from $TFPS_ROWS_SO when set (the sanitized build), else the installed one."""
    path = os.environ.get("TFPS_ROWS_SO")
    if not path:
        return
    import tfps.runtime

    assert "tfps.runtime._rows" not in sys.modules, "tfps.runtime._rows was imported before the sanitized build"
    spec = importlib.util.spec_from_file_location("tfps.runtime._rows", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    tfps.runtime._rows = module  # type: ignore[attr-defined]


load_kernels()

from tfps.api.spec import TrainingSpec  # noqa: E402

MODEL_ARGS = {"vocabSize": 1000, "fields": 4, "embeddingDim": 8, "hidden": [16], "samples": 256, "testSamples": 0}
WORKERS = 2


def training(mode: str = "async", optimizer: str = "adam") -> TrainingSpec:
    return TrainingSpec.model_validate(
        {
            "model": "wide-deep",
            "modelArgs": MODEL_ARGS,
            "optimizer": {"name": optimizer, "learningRate": 0.01},
            "batchSize": 32,
            "steps": 1 << 40,
            "consistency": {"mode": mode},
        }
    )


def shard(mode: str = "async", optimizer: str = "adam"):
    """A PS shard (the only one) of the corpus's model, for WORKERS workers, that never waits: a
    request that would wait for a version is answered pending at once."""
    from prometheus_client import CollectorRegistry

    from tfps.runtime import ps
    from tfps.runtime.metrics import Identity, PSMetrics
    from tfps.runtime.models import load_model
    from tfps.runtime.sharding import place

    ps.POLL_SECONDS = 0.0
    spec = training(mode, optimizer)
    model = load_model(spec.model, spec.model_args, spec.seed)
    return ps.Shard(
        place(model.params, 1).for_ps(0),
        {p.name: p for p in model.params},
        spec,
        WORKERS,
        0,
        PSMetrics(Identity("fuzz", "fuzz", "ps", 0), CollectorRegistry()),
        num_ps=1,
    )


def seeds() -> list[Path]:
    return sorted(REQUESTS.glob("*.bin"))


# ---- a mutator that knows the wire's framing --------------------------------------------------
# libFuzzer's byte mutations of a request mostly break its length prefix or its JSON, which the
# readers refuse at once. Half the time this one changes a request where it is read instead: one
# field of its header (a tensor's name, dtype, shape or size, the alignment, a meta field), or its
# payload, and frames it again, keeping the tensors aligned most of the time.

_NAMES = ("dense_0/kernel", "dense_0/bias", "embedding", "wide", "dense_1/kernel", "nope")
_SUFFIXES = ("", ":", ":indices", ":values", ":rows", ":slot", "::", ":indices:x")
_DTYPES = ("float32", "int64", "bfloat16", "float16", "int32", "uint8", "object", "", 7, None)
_ODD_VALUES = (-1, 0, 1, 2, 7, 2**31, 2**63 - 1, 2**63, -(2**63), 1e308, -0.5, 0.5, "1", "", None, True, [], {}, [1])
_META_KEYS = ("worker", "workers", "tag", "seq", "pull", "dense", "loss", "batch", "min_version")


def _odd_dims(rng) -> list:
    pick = rng.randrange(6)
    if pick == 0:
        return [1] * rng.choice((33, 64, 65, 100, 4000)) + [rng.choice((0, 1))]
    if pick == 1:
        return [rng.choice(_ODD_VALUES)]
    return [rng.choice((0, 1, 2, 3, 8, 16, 1000, 2**40, -1)) for _ in range(rng.randrange(4))]


def _mutate_entry(entry: list, rng) -> None:
    """One field of a tensor's entry [name, dtype, shape, nbytes] changed."""
    field = rng.randrange(4)
    if len(entry) <= field:
        entry.append(rng.choice(_ODD_VALUES))
    elif field == 0:
        entry[0] = rng.choice(
            (rng.choice(_NAMES) + rng.choice(_SUFFIXES), [entry[0]], {"n": entry[0]}, 7, None, "x" * 300)
        )
    elif field == 1:
        entry[1] = rng.choice(_DTYPES)
    elif field == 2:
        entry[2] = _odd_dims(rng)
    elif isinstance(entry[3], int):
        entry[3] = rng.choice((entry[3] + rng.choice((-8, -4, -1, 1, 4, 8)), 0, 2**62, -entry[3]))


def _mutate_head(head: dict, rng) -> None:
    """One thing of a header changed: its alignment, a meta field, a tensor's entry, their order or count."""
    entries = head.get("tensors")
    pick = rng.randrange(6)
    if pick == 0 or not isinstance(entries, list) or not entries:
        head["align"] = rng.choice((1, 2, 3, 4, 8, 64, 4096, 8192, 0, -64, True, "64", None))
    elif pick == 1:
        meta = head.get("meta")
        if isinstance(meta, dict):
            meta[rng.choice(_META_KEYS)] = rng.choice(_ODD_VALUES)
        else:
            head["meta"] = {}
    elif pick in (2, 3):
        entry = rng.choice(entries)
        if isinstance(entry, list):
            _mutate_entry(entry, rng)
    elif pick == 4:
        i, j = rng.randrange(len(entries)), rng.randrange(len(entries))
        entries[i], entries[j] = entries[j], entries[i]
    else:
        copied = rng.choice(entries)
        entries.append(list(copied) if isinstance(copied, list) else rng.choice(([], "x", 3, [1, 2, 3, 4, 5])))


def _poison(payload: bytearray, rng) -> None:
    """A NaN, an Inf or an odd integer written somewhere in the tensors' bytes."""
    if len(payload) < 8:
        return
    at = rng.randrange(0, len(payload) - 7) & ~rng.choice((0, 3, 7))
    value = rng.choice(
        (
            b"\x00\x00\xc0\x7f",  # NaN
            b"\x00\x00\x80\xff",  # -Inf
            (2**63 - 1).to_bytes(8, "little"),
            (-1).to_bytes(8, "little", signed=True),
            (2**31).to_bytes(8, "little"),
        )
    )
    payload[at : at + len(value)] = value


def framed(header: bytes, payload: bytes, keep_aligned: bool) -> bytes:
    if keep_aligned:
        header += b" " * (-(4 + len(header)) % 64)
    return len(header).to_bytes(4, "little") + header + payload


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """atheris's custom mutator for a wire message (atheris.Setup(..., custom_mutator=mutate))."""
    import json
    import random

    import atheris

    rng = random.Random(seed)
    if len(data) < 4 or rng.random() < 0.5:
        return atheris.Mutate(data, max_size)
    hlen = int.from_bytes(data[:4], "little")
    header, payload = data[4 : 4 + hlen], bytearray(data[4 + hlen :])
    try:
        head = json.loads(header)
    except ValueError:
        head = None
    pick = rng.randrange(4)
    if pick < 2 and isinstance(head, dict):
        _mutate_head(head, rng)
        header = json.dumps(head, separators=(",", ":")).encode()
    elif pick == 2:
        _poison(payload, rng)
    else:
        header = atheris.Mutate(header, max(len(header) * 2, 64))
    return framed(header, bytes(payload), rng.random() < 0.9)[:max_size]
