"""Host offload inside a compiled function: arrays kept in host memory between
calls are moved to device memory for the computation, and outputs asked for in
host memory are moved back, inside the one traced program (so XLA can overlap
the transfers with the computation, and donated host buffers are reused).

`JitFunction` (`_jit.py`) calls `to_device_memory` on the arguments as the
function is traced, and `to_host_memory` on its output. Both are no-ops where no
sharding names host memory, as JAX refuses to compute on arrays of two memory
spaces at once (`x + y` with `x` in host memory raises), and a step written for
device arrays should not change.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from .._spectree._check_spec import is_spec_leaf
from .._spectree._memory import is_host_memory
from .._tree import is_array


def to_device_memory(leaves: list[Any], shardings: Sequence[Any]) -> list[Any]:
    """`leaves` (traced arguments) with each array whose sharding is in host
    memory moved to device memory, in the same layout."""
    if not any(map(is_host_memory, shardings)):
        return leaves
    return [
        jax.device_put(x, sharding.with_memory_kind("device"))
        if isinstance(sharding, NamedSharding)
        and is_host_memory(sharding)
        and is_array(x)
        else x
        for x, sharding in zip(leaves, shardings, strict=True)
    ]


def to_host_memory(dynamic: PyTree, out_shardings: PyTree) -> PyTree:
    """The output's arrays (under the structure of `out_shardings`) with each
    whose sharding is in host memory moved there."""
    if not any(
        map(is_host_memory, jtu.tree_leaves(out_shardings, is_leaf=is_spec_leaf))
    ):
        return dynamic

    def move(sharding: Any, subtree: Any) -> Any:
        if not is_host_memory(sharding):
            return subtree
        return jtu.tree_map(
            lambda x: jax.device_put(x, sharding) if is_array(x) else x, subtree
        )

    return jtu.tree_map(move, out_shardings, dynamic, is_leaf=is_spec_leaf)
