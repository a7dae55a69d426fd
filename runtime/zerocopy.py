"""NumPy arrays to TensorFlow tensors without a copy, where TensorFlow can use their memory.

`tf.convert_to_tensor` always copies a NumPy array (TF 2.21), a copy of the whole model every
step on the worker (each step's parameters) and on the PS (each push's gradients). DLPack
hands TensorFlow the array's own memory instead, at a cost that does not grow with its size.
TensorFlow's CPU kernels need 64-byte aligned buffers (a misaligned one aborts the process),
so only arrays that start on wire.ALIGN go that way: the tensors of a message received into
a buffer from `wire.aligned_empty` do (wire.pieces aligns every tensor in the message).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import wire

_BFLOAT16 = wire.dtype("bfloat16")
_DLPACK_DTYPES = {np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32)}


def in_place(arr: np.ndarray) -> bool:
    """True when TensorFlow can use `arr`'s memory as it is."""
    return (
        arr.size > 0
        and arr.flags.c_contiguous
        and arr.flags.writeable
        and wire.address(arr) % wire.ALIGN == 0
        and (arr.dtype in _DLPACK_DTYPES or arr.dtype == _BFLOAT16)
    )


def as_tensor(arr) -> tf.Tensor:
    """`arr` as a tensor; it shares `arr`'s memory when `in_place(arr)` (then `arr` must not
    change while the tensor is in use), and is a copy otherwise."""
    if not isinstance(arr, np.ndarray) or not in_place(arr):
        return tf.convert_to_tensor(arr)
    if arr.dtype == _BFLOAT16:  # DLPack has no bfloat16: hand over the bits, reinterpret them
        return tf.bitcast(tf.experimental.dlpack.from_dlpack(arr.view(np.uint16).__dlpack__()), tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(arr.__dlpack__())
