"""The checks of `dot_product_attention`'s arguments, each mistake an eqshard
error naming the argument, the mesh axis and its size, and the fix."""

from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

from .._mesh._current import mesh_repr


_CALLER = "dot_product_attention"
STRATEGIES = ("ring", "all_gather", "ulysses")


def attention_error(what: str, fix: str) -> ValueError:
    return ValueError(f"eqshard.{_CALLER}: {what}; {fix}")


def check_shapes(query: Any, key: Any, value: Any) -> None:
    """Ranks 3 or 4 alike, heads of the query a multiple of the key's, equal
    head sizes, and keys and values of the same length and heads."""
    if query.ndim not in (3, 4) or key.ndim != query.ndim or value.ndim != query.ndim:
        raise attention_error(
            f"query, key and value have shapes {query.shape}, {key.shape} and "
            f"{value.shape}",
            "give [B, T, N, H], [B, S, K, H] and [B, S, K, H] (or all three "
            "without B, as under `vmap`).",
        )
    if key.shape[:-1] != value.shape[:-1] or query.shape[-1] != key.shape[-1]:
        raise attention_error(
            f"key {key.shape} and value {value.shape} differ in [B, S, K], or "
            f"the query's head size {query.shape[-1]} is not the key's "
            f"{key.shape[-1]}",
            "give keys and values of the same length and heads, and queries of "
            "the keys' head size.",
        )
    if query.shape[-2] % key.shape[-2]:
        raise attention_error(
            f"the query has {query.shape[-2]} heads, not a multiple of the "
            f"key's {key.shape[-2]}",
            "grouped-query attention needs query heads N a multiple of key heads K.",
        )


def check_tokens(
    query: Any, key: Any, segment_ids: Any, positions: Any, is_causal: bool
) -> None:
    """`segment_ids` and `positions` of the query's `[B, T]`, for self-attention."""
    want = query.shape[:-2]
    for name, ids in (("segment_ids", segment_ids), ("positions", positions)):
        if ids is None:
            continue
        if tuple(ids.shape) != tuple(want):
            raise attention_error(
                f"`{name}` has shape {tuple(ids.shape)}, not the query's [B, T] "
                f"= {tuple(want)}",
                f"give one {name[:-1].replace('_', ' ')} per query token.",
            )
        if key.shape[-3] != query.shape[-3]:
            raise attention_error(
                f"`{name}` is given for queries of length {query.shape[-3]} "
                f"and keys of length {key.shape[-3]}",
                f"`{name}` serve self-attention only (T == S); leave it out.",
            )
    if positions is not None and not is_causal:
        raise attention_error(
            "`positions` is given without `is_causal=True`",
            "positions only order the causal mask: pass is_causal=True, or "
            "leave `positions` out.",
        )


def axis_count(
    on: Mesh | AbstractMesh, axis: str, query: Any, key: Any, strategy: str
) -> int:
    """The size of `axis`, checked against the mesh, the sequence lengths and,
    for Ulysses, the heads."""
    if strategy not in STRATEGIES:
        raise attention_error(
            f"unknown strategy={strategy!r}", f"use one of {STRATEGIES}."
        )
    if axis not in on.axis_names:
        raise attention_error(
            f"axis={axis!r} is not in the mesh {mesh_repr(on)}",
            f"name one of its axes {tuple(on.axis_names)}, or set a mesh with "
            "a context axis with `jax.set_mesh`.",
        )
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and axis in context.manual_axes:
        raise attention_error(
            f"axis={axis!r} is already manual here (inside a `shard_map` over it)",
            "call dot_product_attention outside that map, or map over the "
            "other axes only.",
        )
    size = dict(zip(on.axis_names, on.axis_sizes, strict=True))[axis]
    for name, length in (("query", query.shape[-3]), ("key", key.shape[-3])):
        if length % size:
            raise attention_error(
                f"the {name}'s sequence length {length} is not divisible by "
                f"axis {axis!r} (size {size})",
                f"pad the sequence to a multiple of {size}.",
            )
    if strategy == "ulysses":
        for name, heads in (("query", query.shape[-2]), ("key", key.shape[-2])):
            if heads % size:
                raise attention_error(
                    f"strategy='ulysses' splits heads over axis {axis!r} (size "
                    f"{size}), but the {name} has {heads} heads",
                    f"use heads divisible by {size}, or strategy='ring' or "
                    "'all_gather'.",
                )
    return size


def check_jax_only(names: dict[str, Any], axis: str) -> None:
    """JAX's arguments that have no blockwise form here, refused by name."""
    given = [name for name, value in names.items() if value is not None]
    if given:
        raise attention_error(
            f"{', '.join(f'`{n}`' for n in given)} with axis={axis!r}",
            "these pass through to jax.nn.dot_product_attention only with "
            "axis=None; express padding with `segment_ids` or `mask`.",
        )


def check_batch_axes(
    on: Mesh | AbstractMesh, axes: tuple[str, ...], axis: str, query: Any
) -> None:
    """`batch_axes` in the mesh and not `axis`, their product dividing the batch."""
    sizes = dict(zip(on.axis_names, on.axis_sizes, strict=True))
    missing = [a for a in axes if a not in sizes or a == axis]
    if missing:
        raise attention_error(
            f"batch_axes names {', '.join(map(repr, missing))}, not an axis of "
            f"the mesh {mesh_repr(on)} other than axis={axis!r}",
            "name the mesh axes the batch is split over, or leave batch_axes out.",
        )
    count = 1
    for a in axes:
        count *= sizes[a]
    if query.ndim != 4 or query.shape[0] % count:
        raise attention_error(
            f"batch_axes={axes} split the batch {count} ways, but the query's "
            f"shape is {query.shape}",
            "give a batched query whose batch divides by that, or leave "
            "batch_axes out (as under `vmap`).",
        )


def check_masks(query: Any, key: Any, bias: Any, mask: Any) -> None:
    """`mask` boolean, `bias` and `mask` broadcastable to the scores' `[B, N, T,
    S]` (`[N, T, S]` unbatched)."""
    want = (*query.shape[:-3], query.shape[-2], query.shape[-3], key.shape[-3])
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        if name == "mask" and x.dtype != bool:
            raise attention_error(
                f"`mask` has dtype {x.dtype}", "give a boolean mask (True: attend)."
            )
        shape = tuple(x.shape)
        pairs = zip(shape[::-1], want[::-1], strict=False)
        if len(shape) > len(want) or any(d not in (1, w) for d, w in pairs):
            raise attention_error(
                f"`{name}` has shape {shape}, not broadcastable to the scores' "
                f"{'[B, N, T, S]' if len(want) == 4 else '[N, T, S]'} = {want}",
                "give each dimension its size or 1.",
            )


def check_block_size(block_size: int | None, strategy: str, local: int) -> None:
    """`block_size` positive, for the ring only, dividing the local queries."""
    if block_size is None:
        return
    if strategy != "ring":
        raise attention_error(
            f"block_size={block_size} tiles the ring's scores, but "
            f"strategy={strategy!r}",
            "leave block_size=None, or use strategy='ring'.",
        )
    if block_size < 1 or local % block_size:
        raise attention_error(
            f"block_size={block_size} does not divide the {local} queries each "
            "device holds",
            "use a positive divisor of them, or block_size=None to choose one.",
        )
