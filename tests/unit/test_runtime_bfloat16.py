"""The PS's bfloat16 casts (runtime/bfloat16.py, in C): the values NumPy's astype through
ml_dtypes gives, bit for bit, on random bit patterns and on the edge cases."""

import numpy as np
import pytest

from tfps.runtime import wire
from tfps.runtime.bfloat16 import as_float32, narrowed

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # astype of the NaNs
BF16 = wire.dtype("bfloat16")
EDGES = [
    0,
    0x80000000,
    0x7F800000,
    0xFF800000,
    0x7F7FFFFF,
    0xFF7FFFFF,  # ±0, ±Inf, ±the largest float (rounds to Inf)
    0x3F808000,
    0x3F818000,
    0x3F807FFF,
    0x00008000,
    0x00018000,
    1,
    0x807FFFFF,  # ties to even, below half, subnormals
    0x7FC00000,
    0x7F800001,
    0xFFFFFFFF,
    0xFFC00001,
    0x7FA00000,
]  # NaNs: quiet and signalling, either sign


def _floats(count: int) -> np.ndarray:
    bits = np.random.default_rng(7).integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits, np.array(EDGES, np.uint32)]).view(np.float32)


def test_narrowing_rounds_as_ml_dtypes_does_nan_included():
    x = _floats(1_000_000)
    out = narrowed(x, BF16)
    assert out.dtype == BF16 and out.shape == x.shape
    assert np.array_equal(out.view(np.uint16), x.astype(BF16).view(np.uint16))


def test_widening_is_exact():
    x = _floats(100_000).astype(BF16)  # 100,018 values: an even count
    out = as_float32(x.reshape(-1, 2))
    assert out.dtype == np.float32 and out.shape == (len(x) // 2, 2)
    assert np.array_equal(out.reshape(-1).view(np.uint32), x.astype(np.float32).view(np.uint32))


def test_float32_passes_through_untouched():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert as_float32(x) is x and narrowed(x, np.dtype(np.float32)) is x and as_float32(None) is None
    assert as_float32(x[:, ::2].astype(BF16)).tolist() == [
        [0.0, 2.0],
        [3.0, 5.0],
    ]  # a strided one is made contiguous first
