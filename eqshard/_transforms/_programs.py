"""Compiled programs kept between calls, so that calling again compiles nothing.

Programs are kept under what was traced (`program_key`): the jaxpr with every
parameter and nested constant, and JAX's configuration; never under the identity
or hash of a function, whose closure or globals may have changed since.
`init_sharded` (`_init.py`) and eager `shard_map` (`_shard_map.py`) each add
what else their program depends on, and keep the programs in a `Programs`
store, which forgets the oldest past its size and can be cleared (each store is
registered with `eqshard.clear_caches`). The key itself is read from the jaxpr
behind the door (`_internals/program_keys.py`).
"""

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar


_T = TypeVar("_T")


class Programs(Generic[_T]):
    """Programs (or anything made at a cost) kept under a key; past `size` of them,
    the oldest is forgotten."""

    def __init__(self, size: int = 64):
        self.size = size
        self._kept: dict[Hashable, _T] = {}

    def get(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """The program kept under `key`, made by `make()` (and kept) if there is
        none."""
        if key not in self._kept:
            if len(self._kept) >= self.size:
                del self._kept[next(iter(self._kept))]  # the oldest
            self._kept[key] = make()
        return self._kept[key]

    def find(self, key: Hashable) -> _T | None:
        """The program kept under `key`, or `None`."""
        return self._kept.get(key)

    def forget(self, key: Hashable) -> None:
        """Forgets the program kept under `key`, if any."""
        self._kept.pop(key, None)

    def clear(self) -> None:
        """Forgets every program kept."""
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
