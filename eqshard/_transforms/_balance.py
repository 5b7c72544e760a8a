"""`balance_sequence` and `unbalance_sequence`: a sequence reordered so that each
device of a context axis does the same causal work.

Under a causal mask the last tokens attend to the most keys, so a sequence split
in order over N devices leaves the last device with most of the work. Cut into
2N chunks, device `r` takes chunks `r` and `2N-1-r` (an early and a late one):
every device then holds the same number of (query, key) pairs that count. The
reordering is a permutation of the sequence dimension of every array leaf; the
tokens' original places (`balance_sequence(jnp.arange(T))`) go to
`dot_product_attention(..., positions=...)`, which keeps the causal mask exact.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._mesh._current import mesh_repr, require_mesh
from .._tree import path_str
from .._typing import KeyPath, typecheck


def _order(devices: int) -> np.ndarray:
    """The chunks in their balanced order: `0, 2N-1, 1, 2N-2, ...`."""
    return np.array(
        [c for r in range(devices) for c in (r, 2 * devices - 1 - r)], dtype=np.int32
    )


def _size(caller: str, axis: str, mesh: Mesh | AbstractMesh | None) -> int:
    on = require_mesh(mesh, caller=caller)
    if axis not in on.axis_names:
        raise ValueError(
            f"eqshard.{caller}: axis={axis!r} is not in the mesh {mesh_repr(on)}; "
            f"name one of its axes {tuple(on.axis_names)}."
        )
    return dict(zip(on.axis_names, on.axis_sizes, strict=True))[axis]


def _permute(caller: str, tree: Any, order: np.ndarray, seq_dim: int, axis: str) -> Any:
    chunks = len(order)

    def one(path: KeyPath, x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        where = path_str(path) or "(root)"
        if not -x.ndim <= seq_dim < x.ndim:
            raise ValueError(
                f"eqshard.{caller}: the leaf at '{where}' has shape {x.shape}, "
                f"with no dimension seq_dim={seq_dim}; pass the sequence's "
                "dimension with `seq_dim=`."
            )
        dim = seq_dim % x.ndim
        length = x.shape[dim]
        if length % chunks:
            raise ValueError(
                f"eqshard.{caller}: the leaf at '{where}' has a sequence of "
                f"{length} (dimension {dim}), not divisible by 2·{chunks // 2} = "
                f"{chunks} (twice axis {axis!r}'s size {chunks // 2}); pad it to "
                f"a multiple of {chunks}."
            )
        split = x.reshape(*x.shape[:dim], chunks, length // chunks, *x.shape[dim + 1 :])
        return jnp.take(split, order, axis=dim).reshape(x.shape)

    return jtu.tree_map_with_path(one, tree)


@typecheck
def balance_sequence(
    x: PyTree, *, axis: str, seq_dim: int = 1, mesh: Mesh | AbstractMesh | None = None
) -> PyTree:
    """Reorders the sequence of every array of `x` for equal causal work over the
    mesh axis `axis`: cut into `2N` chunks (N the axis's size), device `r` of the
    axis gets chunks `r` and `2N-1-r`.

    Apply it to the batch (tokens, targets, positions, segment ids) before the
    step, as MaxText's data pipeline does, and give the balanced positions to
    [`eqshard.dot_product_attention`][] (`positions=`, with `is_causal=True`);
    [`eqshard.unbalance_sequence`][] puts a result back in order. Token-wise
    layers do not care about the order.

    **Arguments:**

    - `x`: a pytree; its array leaves have the sequence at `seq_dim`, the rest
      pass through.
    - `axis`: the context axis of the mesh.
    - `seq_dim`: the sequence's dimension (1 for `[B, T, ...]`).
    - `mesh`: defaults to the mesh set with `jax.set_mesh`.

    **Returns:**

    `x` with each array's sequence reordered.

    **Raises:**

    `ValueError`, naming the leaf, if a sequence is not divisible by `2N`, or if
    `axis` is not in the mesh.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, 4), ("dp", "cp"))
        positions = jnp.arange(16)[None]
        balanced = eqshard.balance_sequence(positions, axis="cp", mesh=mesh)
        print(balanced[0, :4])  # [ 0  1 14 15]
        ```
    """
    caller = "balance_sequence"
    order = _order(_size(caller, axis, mesh))
    return _permute(caller, x, order, seq_dim, axis)


@typecheck
def unbalance_sequence(
    x: PyTree, *, axis: str, seq_dim: int = 1, mesh: Mesh | AbstractMesh | None = None
) -> PyTree:
    """Puts a sequence reordered by [`eqshard.balance_sequence`][] back in its
    original order (the inverse permutation), e.g. a model's output.

    **Arguments:**

    - `x`, `axis`, `seq_dim`, `mesh`: as `balance_sequence`'s.

    **Returns:**

    `x` with each array's sequence in its original order.

    **Raises:**

    `ValueError`, as `balance_sequence`.

    !!! Example

        ```python
        back = eqshard.unbalance_sequence(balanced, axis="cp", mesh=mesh)
        print(back[0, :4])  # [0 1 2 3]
        ```
    """
    caller = "unbalance_sequence"
    order = np.argsort(_order(_size(caller, axis, mesh))).astype(np.int32)
    return _permute(caller, x, order, seq_dim, axis)
