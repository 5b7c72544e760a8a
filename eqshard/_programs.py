"""Compiled programs kept between calls, so that calling again compiles nothing.

`init_sharded` keeps its programs under what was traced (`_init.py`), `shard_map`
under the function, mesh, specs and options (`_shard_map.py`): each builds its own
key, and both keep the programs in a `Programs` store, which forgets the oldest
past its size and can be cleared.
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

    def clear(self) -> None:
        """Forgets every program kept."""
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
