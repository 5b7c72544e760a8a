"""Every cache eqshard keeps, and the one function that empties them all.

A module that keeps something between calls (compiled programs, step reports,
`functools.lru_cache`s over shardings, meshes or devices, a dict keyed by type)
registers its clearer here when it is imported, one line beside the cache:
`register(_PROGRAMS.clear)`, `register(_placed.cache_clear)` (the door,
`_internals/`, sits below this module: its caches are registered by the modules
that use them). The root's
`__init__.py` imports every wing, so by the time a user can call
[`eqshard.clear_caches`][], every cache is registered. State that is not a cache
(the logical-rules context, the counters that keep processes' barriers in step)
is never registered: forgetting it would change results.
"""

from collections.abc import Callable

from ._typing import typecheck


_CLEARERS: list[Callable[[], object]] = []


def register(clear: Callable[[], object]) -> None:
    """Registers `clear`, which empties one cache, for `clear_caches`."""
    _CLEARERS.append(clear)


@typecheck
def clear_caches() -> None:
    """Empties every cache eqshard keeps, as `equinox.clear_caches` does for
    Equinox.

    eqshard keeps the programs that [`eqshard.init_sharded`][] and
    [`eqshard.filter_shard_map`][] compile (with the arrays their programs hold), the
    reports of [`eqshard.analyze_step`][], and small caches of what it computed
    from shardings, meshes and devices. Calling again after this gives the same
    results, compiling and computing them anew. JAX's own caches are JAX's: call
    `jax.clear_caches()` too to empty them.

    **Returns:**

    `None`.

    !!! Example

        ```python
        eqshard.clear_caches()
        jax.clear_caches()
        ```
    """
    for clear in _CLEARERS:
        clear()
