"""The PS holds its shard's parameters and slots and little else: no TensorFlow, no copy of a
table to initialise, checkpoint or restore it, and checkpoints still of one version."""

import os
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest
from support import async_training, lone_shard

from tfps.api.spec import TrainingSpec
from tfps.runtime import _rows as kernels
from tfps.runtime import checkpoint, wire
from tfps.runtime.checkpoint import RowSnapshot, load_rows
from tfps.runtime.models import INIT_BLOCK_ROWS, Param, load_model

ARGS = {"vocabSize": 4_000, "fields": 4, "embeddingDim": 8, "hidden": [8], "samples": 256, "testSamples": 0}


def _shard(tmp_path, optimizer="adam", index=0):
    training = async_training("wide-deep", ARGS, optimizer, batchSize=32, steps=1000, checkpoint={"everySteps": 10**6})
    model = load_model("wide-deep", ARGS, 0)
    return lone_shard(model.params, training, index, num_ps=2, checkpoint_root=str(tmp_path))


def _push(shard, rng):
    tensors = {}
    for name, part in shard.parts.items():
        if part.sparse:
            ids = rng.integers(0, part.shape[0], 64).astype(np.int64)  # repeats too
            tensors[f"{name}:indices"] = ids
            tensors[f"{name}:values"] = rng.standard_normal((64, *part.shape[1:])).astype(np.float32)
        else:
            tensors[name] = rng.standard_normal(part.shape).astype(np.float32)
    shard.step(wire.encode({"worker": 0, "tag": shard.version, "batch": 32, "pull": False}, tensors))


def _state(shard) -> dict[str, np.ndarray]:
    with shard.cond:
        tensors = shard._snapshot()[1]
    return {
        k: np.concatenate(list(v.blocks())) if isinstance(v, RowSnapshot) else np.array(v) for k, v in tensors.items()
    }


def _in_a_fresh_process(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_ps_of_a_float32_job_imports_neither_tensorflow_nor_ml_dtypes():
    """ml_dtypes (bfloat16) costs a PS resident memory it need not hold: only a bfloat16 job loads it."""
    serve = (
        "import sys, numpy as np; "
        "import tfps.runtime.ps_main, tfps.runtime.ps, tfps.runtime.checkpoint, tfps.runtime.optimizers; "
        "from tfps.runtime import wire; "
        "m = wire.decode(wire.encode({}, {'w': np.ones(3, np.float32), 'i': np.arange(2)})); "
    )
    assert (
        _in_a_fresh_process(serve + "print(sorted(k for k in ('tensorflow', 'ml_dtypes') if k in sys.modules))") == "[]"
    )
    bf16 = "m = wire.decode(wire.encode({}, {'w': np.ones(3, np.float32).astype(wire.dtype('bfloat16'))})); "
    assert (
        _in_a_fresh_process(serve + bf16 + "print(m.tensors['w'].dtype, 'ml_dtypes' in sys.modules)") == "bfloat16 True"
    )


def test_a_part_of_a_large_table_is_drawn_without_a_temporary_the_size_of_the_table():
    param = Param("embedding", (16 * INIT_BLOCK_ROWS, 16), init="normal:0.05", sparse=True)
    start, stop = 3 * INIT_BLOCK_ROWS + 5, 9 * INIT_BLOCK_ROWS + 7
    tracemalloc.start()
    try:
        rows = param.initial_rows(0, start, stop)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < rows.nbytes + 2 * INIT_BLOCK_ROWS * 16 * 4 + (1 << 20)  # the part, and one block at its edges
    np.testing.assert_array_equal(rows, param.initial_value(0)[start:stop])


def test_a_row_snapshot_reads_the_table_as_it_was_while_updates_go_on():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((1000, 4)).astype(np.float32)
    at_snapshot, lock = table.copy(), threading.RLock()
    snap = RowSnapshot(table, lock)
    snap.BLOCK_BYTES = 7 * 16  # 7 rows a block
    blocks = []
    for i, block in enumerate(snap.blocks()):
        blocks.append(block)
        rows = np.unique(rng.integers(0, 1000, 50))
        with lock:
            snap.before_update(rows)
            table[rows] += 1.0
        if i == 3:  # every row once more, some already read and some not
            with lock:
                snap.before_update(np.arange(1000))
                table += 1.0
    np.testing.assert_array_equal(np.concatenate(blocks), at_snapshot)
    assert snap.done and not snap._saved
    assert not np.array_equal(table, at_snapshot)


def test_rows_kept_in_any_order_are_put_back_where_they_belong():
    table = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    at_snapshot, lock = table.copy(), threading.Lock()
    snap = RowSnapshot(table, lock)
    snap.BLOCK_BYTES = 10 * 12  # 10 rows a block
    blocks = snap.blocks()
    first = next(blocks).copy()
    with lock:
        rows = np.array([57, 3, 90, 12, 99, 10])  # not sorted; 3 is read already
        snap.before_update(rows)
        table[rows] = -1.0
    np.testing.assert_array_equal(np.concatenate([first, *blocks]), at_snapshot)


def test_putting_back_rows_refuses_values_that_do_not_fit_the_block():
    block = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="values of shape \\[2, 2\\] for 2 rows of width 3"):
        kernels.put_back(block, 0, [(np.array([0, 1]), np.zeros((2, 2), np.float32), 1)])
    with pytest.raises(TypeError, match="rows"):
        kernels.put_back(block, 0, [(np.array([0.0, 1.0]), np.zeros((2, 3), np.float32), 1)])
    with pytest.raises(TypeError, match="tuples"):
        kernels.put_back(block, 0, [np.array([0, 1])])
    kernels.put_back(block, 10, [(np.array([1, 11, 12, 20]), np.ones((4, 3), np.float32), 20)])
    np.testing.assert_array_equal(block, [[0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])


def test_a_checkpoint_is_the_state_of_its_version_though_training_goes_on(tmp_path):
    shard = _shard(tmp_path)
    rng = np.random.default_rng(2)
    for _ in range(3):
        _push(shard, rng)
    expected = _state(shard)
    with shard.cond:
        meta, tensors = shard._snapshot()
    for _ in range(5):  # before the snapshot is written: its rows are kept as they were
        _push(shard, rng)
    assert any(s._saved for snaps in shard._row_snapshots.values() for s in snaps)
    checkpoint.write(checkpoint.shard_dir(tmp_path, 0), meta, tensors)
    saved = checkpoint.read(checkpoint.shard_dir(tmp_path, 0))
    assert saved.meta["version"] == 3 and sorted(saved.tensors) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(saved.tensors[name], value, err_msg=name)
    assert not np.array_equal(_state(shard)["embedding/part-0:slot:m"], expected["embedding/part-0:slot:m"])
    shard.close()


def test_a_restored_shard_is_the_one_that_was_saved(tmp_path):
    shard = _shard(tmp_path)
    rng = np.random.default_rng(3)
    for _ in range(4):
        _push(shard, rng)
    shard.checkpoint_now()
    expected = _state(shard)
    shard.close()
    again = _shard(tmp_path)
    assert again.version == 4
    restored = _state(again)
    for name, value in expected.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    again.close()


def test_load_rows_copies_a_mapped_tensor_block_by_block(tmp_path):
    table = np.random.default_rng(4).standard_normal((5000, 33)).astype(np.float32)
    checkpoint.write(tmp_path, {"version": 1}, {"t": table})
    src = checkpoint.read(tmp_path).tensors["t"]
    dst = np.zeros_like(table)
    load_rows(dst, src, block_bytes=10_000)
    np.testing.assert_array_equal(dst, table)


def test_a_scalar_parameter_stays_a_scalar(tmp_path):
    params = [Param("bias", (), init="normal:0.1"), Param("w", (3, 2))]
    training = TrainingSpec.model_validate(
        {"optimizer": {"name": "adam", "learningRate": 0.1}, "steps": 10, "consistency": {"mode": "async"}}
    )
    shard = lone_shard(params, training)
    assert shard.vars["bias"].shape == () and shard.slots["bias"]["m"].shape == ()
    new, slots = shard.optimizer.apply_dense(shard.vars["bias"], shard.slots["bias"], np.float32(1.0).reshape(()), 1)
    assert new.shape == () and slots["m"].shape == () and float(new) < float(shard.vars["bias"])
