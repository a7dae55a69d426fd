"""Reply buffers of the data path are reused only once no reply in them is in use
(runtime/datapath.py ReplyBuffers): the worker's parameters are TensorFlow tensors that share
a reply's memory (runtime/zerocopy.py), so overwriting a buffer they live in would change them."""

import numpy as np

from tfps.runtime import wire
from tfps.runtime.datapath import ReplyBuffers
from tfps.runtime.zerocopy import as_tensor

MESSAGE = wire.encode({"version": 1}, {"w": np.arange(1000, dtype=np.float32)})


def _receive(pool: ReplyBuffers) -> wire.Message:
    buf = pool.take(len(MESSAGE))
    buf[:] = np.frombuffer(MESSAGE, np.uint8)
    return wire.decode(memoryview(buf))


def _address(msg: wire.Message) -> int:
    return msg.tensors["w"].ctypes.data


def test_a_buffer_whose_reply_is_in_use_is_not_overwritten():
    pool = ReplyBuffers(keep=3)
    first = _receive(pool)
    params = as_tensor(first.tensors["w"])  # shares the buffer's memory
    used = _address(first)
    del first
    second = _receive(pool)
    assert _address(second) != used
    np.testing.assert_array_equal(params.numpy(), np.arange(1000, dtype=np.float32))
    del second
    third = _receive(pool)  # the second reply's buffer is free again
    assert _address(third) != used
    del params, third
    fourth = _receive(pool)  # every buffer is free: one is reused, none is added
    assert len(pool._buffers) == 2
    np.testing.assert_array_equal(fourth.tensors["w"], np.arange(1000, dtype=np.float32))


def test_a_reply_of_another_size_gets_its_own_buffer():
    pool = ReplyBuffers(keep=3)
    msg = _receive(pool)
    address = _address(msg)
    del msg
    other = pool.take(len(MESSAGE) + 64)
    assert len(other) == len(MESSAGE) + 64 and other.ctypes.data % wire.ALIGN == 0
    assert _address(_receive(pool)) == address
