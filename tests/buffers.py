"""Host buffers as data loaders hand them to eqshard: ones XLA's CPU client could
use in place, so tests can check that placed arrays never share them."""

import numpy as np


def aligned(shape, dtype):
    """A zero NumPy array whose data starts on a 64-byte boundary: a buffer that
    XLA's CPU client would otherwise use in place."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)
