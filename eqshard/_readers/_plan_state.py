"""What a training plan (`_plan.py`) reads of the optimizer state: the specs of
its arrays, following the parameters they belong to (`state_pairs`) or matched
by rules with the parameters (`ruled_state_pairs`), and the bytes the plan's
parts keep in host memory (`host_bytes`).
"""

import math
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from .._spectree._follow import follow_spec, replicated_like
from .._spectree._memory import Host, HOST_MEMORY, in_memory, is_host_memory
from .._spectree._rules import compile_rules, rules_to_specs
from .._spectree._specs import leaf_specs
from .._tree import path_name
from .._typing import KeyPath
from ._strategy import analyze_pairs


def state_pairs(
    path_leaves: Sequence[tuple[KeyPath, Any]],
    param_pairs: dict[KeyPath, tuple[tuple[int, ...], Any]],
) -> list[tuple[KeyPath, Any]]:
    """A spec for each leaf of an optimizer state (its `(path, leaf)` pairs),
    following the parameter it belongs to as [`eqshard.derive_specs`][] does; any
    other leaf (step counts) is replicated on the parameters' mesh."""
    default: Any = PartitionSpec()
    for _, spec in param_pairs.values():
        if spec is not None:
            default = replicated_like(spec)
            break
    out = []
    for path, leaf in path_leaves:
        shape = tuple(getattr(leaf, "shape", ()))
        found, spec = follow_spec(path, shape, param_pairs)
        out.append((path, spec if found else default))
    return out


def ruled_state_pairs(
    rules: Any,
    params: PyTree,
    state: PyTree,
    followed: list[tuple[KeyPath, Any]],
    *,
    mesh: Any,
    caller: str,
) -> list[tuple[KeyPath, Any]]:
    """The optimizer state's specs, `followed` (`state_pairs`) but where a host
    rule of `rules` is the first to match a leaf's path in `(params, state)`, as
    [`eqshard.init_sharded`][] matches a state built with its model: `host()`
    keeps the followed layout in host memory, `host(spec)` gives its own."""
    compiled = compile_rules(rules, caller)
    if not any(isinstance(value, Host) for _, value in compiled):
        return followed
    both = rules_to_specs(
        rules,
        (params, state),
        mesh=mesh,
        check_on_mesh=False,
        on_invalid="ignore",
        caller=caller,
    )
    ruled = leaf_specs(both[1], state, caller=caller)
    out = []
    for (path, spec), (_, own) in zip(followed, ruled, strict=True):
        name = path_name((jtu.SequenceKey(1), *path), "/")
        value = next((v for r, v in compiled if r.search(name)), None)
        if isinstance(value, Host):
            spec = in_memory(spec, HOST_MEMORY) if value.spec is None else own
        out.append((path, spec))
    return out


def host_bytes(
    parts: Sequence[tuple[Sequence[Any], Sequence[tuple[KeyPath, Any]]]],
    mesh: Mesh | AbstractMesh,
    caller: str,
) -> np.ndarray:
    """The bytes per device of the arrays kept in host memory, of `parts` (each
    its leaves and their `(path, spec)` pairs), analysed with only those."""
    per_device = np.zeros(math.prod(mesh.axis_sizes), dtype=np.int64)
    for leaves, pairs in parts:
        host = [is_host_memory(spec) for _, spec in pairs]
        if any(host):
            only = [leaf if h else None for leaf, h in zip(leaves, host, strict=True)]
            report = analyze_pairs(only, pairs, mesh, caller=caller)
            per_device += np.asarray(report.bytes_per_device, dtype=np.int64)
    return per_device
