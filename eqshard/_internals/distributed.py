"""The distributed client's key-value store and barriers.

JAX 0.10 has no public accessor for the client of `jax.distributed.initialize`.
`client` reads the one attribute `jax.experimental.multihost_utils` itself uses
(`distributed.global_state.client`), through that public module rather than
`jax._src`, and gives `None` if a later JAX moves it: the callers then do
without the client (a barrier is skipped, an agreement check takes one XLA
all-gather instead), as in a run without one. The other functions call the
client's methods; they raise what the client raises (`jax.errors.JaxRuntimeError`
when other processes do not come within the timeout).
"""

import math
from typing import Any

from jax.experimental import multihost_utils


def client() -> Any:
    """The client of `jax.distributed.initialize`, or `None`."""
    state = getattr(getattr(multihost_utils, "distributed", None), "global_state", None)
    return getattr(state, "client", None)


def _milliseconds(timeout: float | int) -> int:
    return max(1, math.ceil(timeout * 1000))


def post(key: str, value: str) -> None:
    """Sets `key` to `value` in the key-value store."""
    client().key_value_set(key, value)


def read(key: str, timeout: float | int) -> str:
    """The value of `key`, waiting up to `timeout` seconds for it to be set."""
    return client().blocking_key_value_get(key, _milliseconds(timeout))


def read_under(prefix: str) -> list[tuple[str, str]]:
    """Every `(key, value)` of the store whose key starts with `prefix`."""
    return list(client().key_value_dir_get(prefix))


def delete(key: str) -> None:
    """Removes `key` from the key-value store."""
    client().key_value_delete(key)


def barrier(name: str, timeout: float | int, processes: tuple[int, ...] | None) -> None:
    """Waits up to `timeout` seconds for `processes` (`None`: all of them) at the
    barrier `name`."""
    client().wait_at_barrier(
        name, timeout_in_ms=_milliseconds(timeout), process_ids=processes
    )
