"""Placement of parameters on PS shards: deterministic, size-balanced, tables partitioned."""

import numpy as np
import pytest

from tfps.runtime import sharding, wire
from tfps.runtime.models import Param, load_model
from tfps.runtime.sharding import batch_ids, place, route_rows


def test_same_inputs_give_the_same_plan():
    params = load_model("mlp", {"inputDim": 784, "hidden": [2048, 2048]}).params
    assert place(params, 2) == place(params, 2)


def test_large_dense_variables_are_split_and_load_is_balanced():
    params = load_model("mlp", {"inputDim": 784, "hidden": [2048, 2048]}).params
    plan = place(params, 2)
    assert {p.var for p in plan.parts if "/part-" in p.name} == {"dense_0/kernel", "dense_1/kernel"}
    loads = plan.load()
    assert max(loads) / min(loads) < 1.05
    assert sum(loads) == sum(p.size for p in params)


def test_parts_cover_every_row_exactly_once():
    params = load_model("wide-deep", {"vocabSize": 1000, "fields": 4}).params
    plan = place(params, 3)
    for p in params:
        parts = sorted(plan.parts_of(p.name), key=lambda q: q.start)
        assert parts[0].start == 0 and parts[-1].stop == p.shape[0]
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False))
    assert len(plan.parts_of("embedding")) == 3  # tables always partitioned


def test_one_ps_keeps_everything_whole():
    params = load_model("digits-mlp").params
    plan = place(params, 1)
    assert [p.name for p in plan.parts] and all("/part-" not in p.name for p in plan.parts)


def test_route_rows_splits_ids_by_part():
    plan = place([Param("t", (10, 2), sparse=True, feature="ids")], 2)
    ids = np.array([0, 3, 5, 9], np.int64)
    routes = route_rows(plan.parts_of("t"), ids)
    assert [(part.ps, list(pos), list(local)) for part, pos, local in routes] == [
        (0, [0, 1], [0, 3]),
        (1, [2, 3], [0, 4]),
    ]


def test_a_push_is_split_by_part_and_the_rows_asked_for_go_to_their_ps():
    """What a worker's Step carries to each PS: a split dense variable's slice per part, a whole one
    to its PS; each table part's pushed rows as local indices and their gradients' rows."""
    params = [Param("big", (4, 3)), Param("bias", (3,)), Param("t", (10, 2), sparse=True, feature="ids")]
    plan = place(params, 2)
    assert len(plan.parts_of("big")) == 2 and len(plan.parts_of("bias")) == 1
    ids = np.array([0, 3, 5, 9], np.int64)
    routes = {"t": route_rows(plan.parts_of("t"), ids)}
    grads = {
        "big": np.arange(12, dtype=np.float32).reshape(4, 3),
        "bias": np.ones(3, np.float32),
        "t": np.arange(8, dtype=np.float32).reshape(4, 2),
    }
    pushes = plan.split_push(["big", "bias"], grads, routes)
    bias_ps = plan.parts_of("bias")[0].ps
    for k, push in enumerate(pushes):
        big = plan.parts_of("big")[k]
        np.testing.assert_array_equal(push[big.name], grads["big"][big.start : big.stop])
        assert ("bias" in push) == (k == bias_ps)
        assert push[f"t/part-{k}:indices"].dtype == np.int64
    np.testing.assert_array_equal(pushes[0]["t/part-0:indices"], [0, 3])
    np.testing.assert_array_equal(pushes[1]["t/part-1:indices"], [0, 4])
    np.testing.assert_array_equal(pushes[1]["t/part-1:values"], grads["t"][2:4])
    asked = plan.rows_asked(routes)
    assert [list(a) for a in asked] == [["t/part-0:rows"], ["t/part-1:rows"]]
    np.testing.assert_array_equal(asked[1]["t/part-1:rows"], [0, 4])
    assert plan.rows_asked({}) == [{}, {}]


def _id_batches():
    rng = np.random.default_rng(7)
    yield np.zeros((0, 8), np.int64)
    yield np.full((3, 5), -7, np.int64)
    yield rng.integers(-(2**62), 2**62, (64, 8))  # values that differ in every byte, signs mixed
    yield rng.integers(0, 50, 1000)  # many repeats
    yield rng.integers(0, 2**40, (512, 8))
    for _ in range(20):  # the click model's power-law ids
        yield ((rng.zipf(1.2, (512, 8)) - 1) % 2_000_000).astype(np.int64)


@pytest.mark.parametrize("kernels", [True, False], ids=["C", "NumPy"])
def test_batch_ids_are_numpys_unique_and_inverse(kernels, monkeypatch):
    """Each batch's distinct ids, increasing, and where each id is among them, as NumPy's unique
    gives them; the positions come in an aligned array of the batch's shape (TensorFlow reads it
    in place). With the C kernels and without."""
    if kernels and sharding._unique is None:
        pytest.skip("the package was built without its C kernels")
    if not kernels:
        monkeypatch.setattr(sharding, "_unique", None)
    for ids in _id_batches():
        uniq, inverse = batch_ids(ids)
        want_uniq, want_inverse = np.unique(ids.reshape(-1), return_inverse=True)
        np.testing.assert_array_equal(uniq, want_uniq)
        assert inverse.shape == ids.shape and inverse.dtype == np.int64
        np.testing.assert_array_equal(inverse.reshape(-1), want_inverse.reshape(-1))
        np.testing.assert_array_equal(uniq[inverse], ids)
        assert not ids.size or inverse.ctypes.data % wire.ALIGN == 0
