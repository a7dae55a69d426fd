"""bfloat16 on the PS (spec.training.wireDtype: bfloat16): gradients that come as bfloat16 are
widened to float32 for the update, and dense parameters go back narrowed to bfloat16, each in
one pass in C (runtime/_rows.c) rather than through NumPy's astype, which converts to and from
ml_dtypes' bfloat16 element by element. The same values either way: round to nearest, ties to
even, as ml_dtypes and TensorFlow's cast round. Dtypes are told by their wire names, so that a
float32 job's PS never imports ml_dtypes."""

from __future__ import annotations

import numpy as np

from . import _rows, wire


def as_float32(arr: np.ndarray | None) -> np.ndarray | None:
    """`arr` (float32, bfloat16, or None) as float32: itself when it already is."""
    if arr is None or arr.dtype == np.float32:
        return arr
    if wire.dtype_name(arr.dtype) != "bfloat16":
        return arr.astype(np.float32)
    out = np.empty(arr.shape, np.float32)
    _rows.from_bfloat16(np.ascontiguousarray(arr).view(np.uint16), out)
    return out


def narrowed(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float32 `arr` as `dtype` (the wire's): itself when it already is."""
    if arr.dtype == dtype:
        return arr
    if wire.dtype_name(dtype) != "bfloat16":
        return arr.astype(dtype)
    out = np.empty(arr.shape, np.uint16)
    _rows.to_bfloat16(np.ascontiguousarray(arr, np.float32), out)
    return out.view(dtype)
