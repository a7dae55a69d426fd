"""NumPy to TensorFlow without a copy where TensorFlow can use the memory (runtime/zerocopy.py)."""

import numpy as np

from tfps.runtime import wire
from tfps.runtime.zerocopy import as_tensor, in_place


def _aligned(values: np.ndarray) -> np.ndarray:
    out = wire.aligned_array(values.shape, values.dtype)
    out[...] = values
    return out


def test_an_aligned_array_is_shared_with_the_tensor():
    arr = _aligned(np.arange(12, dtype=np.float32).reshape(3, 4))
    tensor = as_tensor(arr)
    assert tensor.shape == (3, 4) and tensor.dtype.name == "float32"
    arr[1, 2] = 42.0
    assert float(tensor[1, 2]) == 42.0  # the same memory


def test_bfloat16_is_shared_as_its_bits():
    values = np.array([1.5, -2.0, 0.0078125, 3.0e38], np.float32).astype(wire.dtype("bfloat16"))
    tensor = as_tensor(_aligned(values))
    assert tensor.dtype.name == "bfloat16"
    np.testing.assert_array_equal(tensor.numpy().astype(np.float32), values.astype(np.float32))


def test_misaligned_read_only_or_odd_arrays_are_copied():
    base = _aligned(np.arange(17, dtype=np.float32))
    misaligned = base[1:]
    read_only = np.frombuffer(base.tobytes(), np.float32)
    strided = base[::2]
    for arr in (misaligned, read_only, strided, np.arange(4, dtype=np.float64)):
        assert not in_place(arr)
        tensor = as_tensor(arr)
        np.testing.assert_array_equal(tensor.numpy(), arr)
    tensor = as_tensor(misaligned)
    base[1] = -1.0
    assert float(tensor[0]) == 1.0  # a copy: the change does not reach it
