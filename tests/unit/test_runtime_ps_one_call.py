"""An async push of the usual shape is applied and answered in one C call (_rows.apply_async):
the same updates, the same reply bytes and the same counts as the PS's Python path, which still
takes everything else (a retried push, a checkpoint reading the tables, a NaN refused). Two real
Shards from the same parameters, one with the C call turned off, given the same requests."""

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from support import async_training, lone_shard

from tfps.runtime import _rows, ps, wire
from tfps.runtime.models import load_model
from tfps.runtime.ps import Rejected, Shard
from tfps.runtime.sharding import place, route_rows

ARGS = {"vocabSize": 3_000, "fields": 4, "embeddingDim": 8, "hidden": [16, 8], "samples": 64, "testSamples": 0}
MODEL = load_model("wide-deep", ARGS, 0)
PLAN = place(MODEL.params, 2)


def _shard(ps_index: int, optimizer: str, one_call: bool) -> tuple[Shard, CollectorRegistry]:
    training = async_training("wide-deep", ARGS, optimizer, batchSize=32, steps=1000)
    registry = CollectorRegistry()
    shard = lone_shard(MODEL.params, training, ps_index, num_ps=2, workers=2, registry=registry)
    shard._async_in_c = shard._async_in_c and one_call
    shard.incarnation = "same"  # else a random token each, in every reply
    return shard, registry


def _requests(ps_index: int, count: int, seed: int = 0) -> list[bytes]:
    """Workers 0 and 1 in turn, each push as a worker splits it (every dense gradient, each
    table's distinct rows) asking back the rows of a next batch, numbered as async pushes are."""
    rng, out, seqs = np.random.default_rng(seed), [], [0, 0]
    dense = [p.name for p in MODEL.params if not p.sparse]
    for step in range(count):
        worker = step % 2
        routes, ahead = {}, {}
        for table in MODEL.sparse_params:
            ids, next_ids = (np.unique(rng.integers(0, table.shape[0], 40)) for _ in range(2))
            routes[table.name] = route_rows(PLAN.parts_of(table.name), ids)
            ahead[table.name] = route_rows(PLAN.parts_of(table.name), next_ids)
        grads = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in MODEL.params if not p.sparse}
        for table in MODEL.sparse_params:
            count_ids = sum(len(local) for _, _, local in routes[table.name])
            grads[table.name] = rng.standard_normal((count_ids, *table.shape[1:])).astype(np.float32)
        tensors = {**PLAN.split_push(dense, grads, routes)[ps_index], **PLAN.rows_asked(ahead)[ps_index]}
        meta = {
            "worker": worker,
            "workers": 2,
            "tag": step // 2,
            "seq": seqs[worker],
            "pull": True,
            "batch": 32,
            "loss": 0.5,
        }
        seqs[worker] += 1
        out.append(wire.encode(meta, tensors))
    return out


def _bytes(pieces: list) -> bytes:
    return b"".join(p if isinstance(p, bytes) else memoryview(p).cast("B").tobytes() for p in pieces)


def _state(shard: Shard) -> dict[str, np.ndarray]:
    out = {name: np.array(var) for name, var in shard.vars.items()}
    out |= {f"{name}:{slot}": np.array(arr) for name, slots in shard.slots.items() for slot, arr in slots.items()}
    return out


def _count(registry: CollectorRegistry, name: str) -> float:
    return sum(s.value for metric in registry.collect() for s in metric.samples if s.name == name)


@pytest.fixture
def calls(monkeypatch) -> list:
    """Each call of the C path."""
    made, real = [], _rows.apply_async
    monkeypatch.setattr(ps._rows, "apply_async", lambda *args: made.append(args[3]) or real(*args))
    return made


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adagrad"])
@pytest.mark.parametrize("ps_index", [0, 1])
def test_one_call_applies_and_answers_as_the_python_path(optimizer, ps_index, calls):
    (fast, fast_reg), (slow, slow_reg) = _shard(ps_index, optimizer, True), _shard(ps_index, optimizer, False)
    for request in _requests(ps_index, 6):
        assert _bytes(fast.step(memoryview(request), encoding="pieces")) == _bytes(
            slow.step(memoryview(request), encoding="pieces")
        )
    assert len(calls) == 6 and all(
        shard_vars is fast.vars for shard_vars in calls
    )  # the Python shard never made the call
    assert fast.version == slow.version == 6 and fast.examples == slow.examples and fast.clocks == slow.clocks == [3, 3]
    fast_state, slow_state = _state(fast), _state(slow)
    assert fast_state.keys() == slow_state.keys()
    for name in fast_state:
        np.testing.assert_array_equal(fast_state[name], slow_state[name], err_msg=name)
    for counter in (
        "tfps_ps_updates_applied_total",
        "tfps_ps_sent_bytes_total",
        "tfps_ps_received_bytes_total",
        "tfps_ps_examples_total",
        "tfps_ps_apply_seconds_count",
        "tfps_ps_gradient_staleness_sum",
    ):
        assert _count(fast_reg, counter) == _count(slow_reg, counter) > 0, counter


def test_a_non_finite_dense_gradient_is_refused_and_changes_nothing(calls):
    fast, _ = _shard(1, "adam", True)
    slow, _ = _shard(1, "adam", False)
    before = _state(fast)
    msg = wire.decode(_requests(1, 1)[0])
    dense = next(name for name in msg.tensors if ":" not in name)
    bad = dict(msg.tensors)
    bad[dense] = bad[dense].copy()
    bad[dense].flat[-1] = np.nan
    request = wire.encode(msg.meta, bad)
    errors = []
    for shard in (fast, slow):
        with pytest.raises(Rejected) as err:
            shard.step(memoryview(request), encoding="pieces")
        errors.append((err.value.reason, str(err.value)))
    assert errors[0] == errors[1] and errors[0][0] == "non_finite" and repr(dense) in errors[0][1]
    assert len(calls) == 1 and fast.version == 0 and fast.clocks == [0, 0]
    after = _state(fast)
    for name in before:  # the tables too, though their rows were finite
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def test_a_retried_push_and_a_checkpoint_reading_a_table_take_the_python_path(calls):
    fast, registry = _shard(0, "sgd", True)
    slow, _ = _shard(0, "sgd", False)
    first = _requests(0, 1)[0]
    fast.step(memoryview(first), encoding="pieces")
    slow.step(memoryview(first), encoding="pieces")
    # the same push again (its reply lost): not applied twice, answered alike
    assert _bytes(fast.step(memoryview(first), encoding="pieces")) == _bytes(
        slow.step(memoryview(first), encoding="pieces")
    )
    assert len(calls) == 1 and fast.version == 1 and _count(registry, "tfps_ps_duplicate_pushes_total") == 1
    # a checkpoint reading the table keeps the rows as they were when it began
    table = next(
        name for name, part in fast.parts.items() if part.sparse and len(part.shape) == 2 and part.shape[1] > 1
    )
    with fast.cond:
        snapshot = fast._read_whole(table, fast.vars[table])
    kept = np.array(fast.vars[table])
    second = _requests(0, 2, seed=1)[1]
    fast.step(memoryview(second), encoding="pieces")
    assert len(calls) == 1 and fast.version == 2
    assert not np.array_equal(fast.vars[table], kept)  # the push changed rows of it
    np.testing.assert_array_equal(np.concatenate(list(snapshot.blocks())), kept)
    # once the checkpoint has read it all, pushes take the C path again
    fast.step(memoryview(_requests(0, 3, seed=2)[2]), encoding="pieces")
    assert len(calls) == 2


def test_pushes_of_rows_alone_or_asking_no_rows_are_answered_alike(calls):
    """A push may carry no dense gradient (a PS holding only its tables' parts) or ask for no
    rows back: the reply lists what there is, as the Python path's does."""
    fast, _ = _shard(1, "adagrad", True)
    slow, _ = _shard(1, "adagrad", False)
    for i, request in enumerate(_requests(1, 4, seed=3)):
        msg = wire.decode(request)
        keep = (lambda name: ":" in name) if i % 2 == 0 else (lambda name: not name.endswith(":rows"))
        trimmed = wire.encode(msg.meta, {name: arr for name, arr in msg.tensors.items() if keep(name)})
        assert _bytes(fast.step(memoryview(trimmed), encoding="pieces")) == _bytes(
            slow.step(memoryview(trimmed), encoding="pieces")
        )
    assert len(calls) == 4
    fast_state, slow_state = _state(fast), _state(slow)
    for name in fast_state:
        np.testing.assert_array_equal(fast_state[name], slow_state[name], err_msg=name)
