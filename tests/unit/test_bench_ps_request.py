"""The in-process cost of one PS request (bench/ps_request.py): tfps's Shard and the reference's
answering process are given the same pushes and must end with the same parameters and slots,
which is what makes their CPU a request comparable. Real Shard, real Answerer, no sockets."""

import gc
import json

import numpy as np
import pytest

from tfps.bench import ps_request
from tfps.bench.embedding import QUICK_SHAPE


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_both_sides_apply_the_same_pushes_alike(optimizer):
    for ps in range(QUICK_SHAPE.ps):
        result = ps_request.measure(QUICK_SHAPE, optimizer, ps, count=20, repeats=2)
        assert result["differences"] == [], result
        assert result["tfps_us"] > 0 and result["reference_us"] > 0 and result["kernels_us"] > 0
        assert len(result["tfps_repeats"]) == len(result["reference_repeats"]) == len(result["kernels_repeats"]) == 2
        # the same rows and gradients, each side in its own framing
        assert abs(result["request_bytes"] - result["reference_bytes"]) < 0.1 * result["request_bytes"]


def test_the_pushes_carry_every_part_of_the_ps_and_rows_asked_for_back():
    pushes = ps_request.Pushes(QUICK_SHAPE, 1, steps=2)
    from tfps.runtime import wire

    msg = wire.decode(pushes.tfps[0])
    parts = {part.name for part in pushes.shards.plan.for_ps(1)}
    tables = {part.name for part in pushes.shards.plan.for_ps(1) if part.sparse}
    assert {name.partition(":")[0] for name in msg.tensors} == parts
    for table in tables:
        indices, values = msg.tensors[f"{table}:indices"], msg.tensors[f"{table}:values"]
        assert len(indices) == len(values) > 0 and np.all(np.diff(indices) > 0)
        assert len(msg.tensors[f"{table}:rows"]) > 0
    assert "seq" not in msg.meta  # cycled through: every push is applied


def test_a_difference_between_the_sides_is_named():
    pushes = ps_request.Pushes(QUICK_SHAPE, 0, steps=2)
    sides = ps_request.Sides(QUICK_SHAPE, pushes, "adam", 0.001)
    assert sides.differences() == []
    table = sides.shards.tables[0][0].name
    sides.shard.vars[table][3] += 1.0
    sides.shard.slots[table]["v"][5] += 1.0
    assert sides.differences() == [table, f"{table}:v"]


def test_main_prints_one_line_per_ps_and_fails_on_a_bad_ps(capsys):
    assert ps_request.main(["--shape", QUICK_SHAPE.name, "--requests", "5", "--repeats", "1", "--ps", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line)["ps"] for line in lines] == [1]
    with pytest.raises(SystemExit):
        ps_request.main(["--shape", QUICK_SHAPE.name, "--ps", "2"])


def test_requests_measured_cold_still_apply_alike_and_the_collector_is_given_back():
    """With --evict-mib each request comes to caches that hold nothing of its own; what was frozen
    out of the collector's sight for the timed blocks is back in it afterwards."""
    frozen = gc.get_freeze_count()
    result = ps_request.measure(QUICK_SHAPE, "adam", 1, count=4, repeats=1, evict_mib=1)
    assert result["evict_mib"] == 1 and result["differences"] == []
    assert result["tfps_us"] > 0 and result["kernels_us"] > 0
    assert gc.get_freeze_count() == frozen
    with pytest.raises(SystemExit):
        ps_request.main(["--shape", QUICK_SHAPE.name, "--evict-mib", "-1"])
