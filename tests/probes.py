"""What tests observe JAX with: host buffers that XLA's CPU client could use in
place (to check that placed arrays never share them), and a count of XLA
compilations; and a fault to inject: a limit on the size of the files this
process writes (a disk that fills up)."""

import contextlib
import resource

import jax
import numpy as np


# Seconds a test waits for a child process (a script, the command, a multi-process
# launch) that works: no working run takes this long, even on a loaded machine,
# yet a hang still ends. A shorter limit fails working code when the machine is
# busy; `test_architecture.py` keeps the tests to this one.
RUN_TIMEOUT = 900


def aligned(shape, dtype):
    """A zero NumPy array whose data starts on a 64-byte boundary: a buffer that
    XLA's CPU client would otherwise use in place."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class Compiles:
    """Counts XLA compilations while active: `with Compiles() as c: ...`, then
    `c.count`."""

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


@contextlib.contextmanager
def file_size_limit(nbytes):
    """While active, this process cannot write a file beyond `nbytes` bytes: the
    write that would raises `OSError` (EFBIG; Python ignores SIGXFSZ), as on a
    full disk."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
