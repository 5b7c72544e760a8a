"""`dot_product_attention`: `jax.nn.dot_product_attention` with the sequence
split over a mesh axis (context parallelism).

How a call goes:

1. **Check** (`_attention_checks.py`): shapes, the token arrays, the axis
   (in the mesh, not manual, dividing both lengths; for Ulysses the heads).
2. **Shape.** An unbatched `[T, N, H]` call (Equinox's attention under `vmap`)
   gets a batch of one; `mask` and `bias` are made 4-d `[B, N, T, S]` (their
   dimensions of size one kept); positions default to `arange` for a causal mask,
   so that every strategy masks by positions.
3. **Map** (`_mapped`): a `jax.shard_map` manual over `axis` and the batch's
   axes (`batch_axes`, read from the query's type on Explicit axes; the other
   axes keep their layouts), with the query, keys and values split along the
   sequence, and inside it the strategy:
   - `ring` (`_attention_ring.py`): key/value blocks travel the axis by
     `ppermute`, an online softmax over blocks taken a tile of query rows at a
     time (`block_size`), and its own backward pass;
   - `all_gather`: keys and values (and their positions and segments) gathered,
     queries local, `jax.nn.dot_product_attention` on the local rows;
   - `ulysses`: two all-to-alls trade the sequence for heads (each device all
     tokens of `N/n` heads), `jax.nn.dot_product_attention`, and back.
   `mask` and `bias` are split like the scores they cover: along the queries
   for ring and all-gather (a bias broadcast along the queries is broadcast
   first, so that its gradient is split too), along the heads for Ulysses.
4. On Explicit axes all of this runs as `auto_axes` runs a function, and the
   result is typed like the query.

Why the batch's axes are manual too: XLA cannot run an all-gather or all-to-all
over one axis inside a map of an array still split over another (Auto) axis, so
it gathers that axis first, the whole batch on every device. The ring's
`ppermute`s have no such limit.
"""

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec as P
from jaxtyping import Array

from .._mesh._current import require_mesh
from .._typing import typecheck
from ._attention_checks import (
    axis_count,
    check_batch_axes,
    check_block_size,
    check_jax_only,
    check_masks,
    check_shapes,
    check_tokens,
)
from ._attention_ring import ring_attention, RingPlan
from ._explicit import auto_axes


_CALLER = "dot_product_attention"


def _four(x: Any) -> Any:
    """A mask or bias made `[B, N, T, S]` (broadcastable), or None."""
    if x is None:
        return None
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _combined(mask: Any, q_pos: Any, k_pos: Any, q_seg: Any, k_seg: Any) -> Any:
    """`mask` (4-d or None) and causality by positions `[B, T]`/`[B, S]` and equal
    segments, as one `[B, N|1, T, S]` mask, or None if nothing is masked."""
    found = [mask] if mask is not None else []
    if q_pos is not None:
        found.append(q_pos[:, None, :, None] >= k_pos[:, None, None, :])
    if q_seg is not None:
        found.append(q_seg[:, None, :, None] == k_seg[:, None, None, :])
    if not found:
        return None
    out = found[0]
    for m in found[1:]:
        out = out & m
    return out


def _ring_body(size: int, axis: str, scale: float, rows: int | None) -> Any:
    plan = RingPlan(axis, size, scale, rows)

    def body(a: dict[str, Any]) -> Any:
        extra = (a.get("bias"), a.get("mask"), (a.get("q_pos"), a.get("q_seg")))
        kaux = (a.get("k_pos"), a.get("k_seg"))
        return ring_attention(plan, a["q"], a["k"], a["v"], extra, kaux)

    return body


def _local_mask(a: dict[str, Any], k_pos: Any, k_seg: Any) -> Any:
    """The mask of local queries against all keys, for JAX's function."""
    return _combined(a.get("mask"), a.get("q_pos"), k_pos, a.get("q_seg"), k_seg)


def _cpu_half(x: Any) -> bool:
    """A 16-bit float gathered on the CPU backend: its gradient's reduce-scatter
    in 16 bits aborts XLA:CPU (`AllReducePromotion`: "Invalid binary instruction
    opcode copy") when the batch is not manual too, so it goes in float32."""
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) == "cpu"


def _gather_body(size: int, axis: str, scale: float, rows: None) -> Any:
    del size, rows

    def body(a: dict[str, Any]) -> Any:
        def gather(x: Any) -> Any:
            if x is None:
                return None
            wide = _cpu_half(x)
            y = jax.lax.all_gather(
                x.astype(jnp.float32) if wide else x, axis, axis=1, tiled=True
            )
            return y.astype(x.dtype) if wide else y

        k, v = gather(a["k"]), gather(a["v"])
        mask = _local_mask(a, gather(a.get("k_pos")), gather(a.get("k_seg")))
        return jax.nn.dot_product_attention(
            a["q"], k, v, a.get("bias"), mask, scale=scale
        )

    return body


def _ulysses_body(size: int, axis: str, scale: float, rows: None) -> Any:
    del size, rows

    def body(a: dict[str, Any]) -> Any:
        def heads(x: Any) -> Any:  # [B, T/n, N, H] -> [B, T, N/n, H]
            return jax.lax.all_to_all(x, axis, 2, 1, tiled=True)

        def tokens(x: Any) -> Any:
            if x is None:
                return None
            return jax.lax.all_gather(x, axis, axis=1, tiled=True)

        full = dict(a, q_pos=tokens(a.get("q_pos")), q_seg=tokens(a.get("q_seg")))
        mask = _local_mask(full, tokens(a.get("k_pos")), tokens(a.get("k_seg")))
        out = jax.nn.dot_product_attention(
            heads(a["q"]),
            heads(a["k"]),
            heads(a["v"]),
            a.get("bias"),
            mask,
            scale=scale,
        )
        return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)

    return body


_BODIES = {"ring": _ring_body, "all_gather": _gather_body, "ulysses": _ulysses_body}


class _Split(NamedTuple):
    """How the map splits: the context axis and its size, the strategy, the
    scale, the mesh axes of the batch (manual too) and the ring's tile rows."""

    axis: str
    size: int
    strategy: str
    scale: float
    batch: tuple[str, ...]
    rows: int | None = None


def _specs(a: dict[str, Any], split: _Split) -> dict[str, P]:
    """Each argument's split: the batch over `split.batch` (where it is not
    broadcast), sequences along the axis; masks and biases along the queries
    (ring, all-gather) or the heads (Ulysses), where they have them."""
    axis, batch = split.axis, split.batch or None
    specs = {}
    for name, x in a.items():
        dims: list[Any] = [batch if x.shape[0] != 1 else None, axis]
        if name in ("mask", "bias"):
            at = 1 if split.strategy == "ulysses" else 2
            dims = [dims[0], None, None, None]
            if x.shape[at] != 1:
                dims[at] = axis
        specs[name] = P(*dims)
    return specs


def _mapped(a: dict[str, Any], on: Any, split: _Split) -> Any:
    if "bias" in a:  # broadcast where it would be split, so its gradient is too
        b = a["bias"]
        at = 1 if split.strategy == "ulysses" else 2
        full = a["q"].shape[3 - at]  # heads (Ulysses) or queries, [B, T, N, H]
        a = dict(a, bias=jnp.broadcast_to(b, (*b.shape[:at], full, *b.shape[at + 1 :])))
    fn = jax.shard_map(
        _BODIES[split.strategy](split.size, split.axis, split.scale, split.rows),
        mesh=on,
        in_specs=(_specs(a, split),),
        out_specs=P(split.batch or None, split.axis),
        axis_names=frozenset({split.axis, *split.batch}),
        check_vma=False,
    )
    return fn(a)


def _arguments(
    q: Any, k: Any, v: Any, masks: tuple[Any, Any], tokens: tuple[Any, Any, bool]
) -> dict[str, Any]:
    """The map's arguments by name, batched, those that are None left out."""
    bias, mask = masks
    segment_ids, positions, is_causal = tokens
    t, s = q.shape[1], k.shape[1]
    if positions is None and is_causal:
        q_pos, k_pos = jnp.arange(t)[None], jnp.arange(s)[None]
    else:
        q_pos = k_pos = positions
    found = {
        "q": q,
        "k": k,
        "v": v,
        "bias": _four(bias),
        "mask": _four(mask),
        "q_pos": q_pos,
        "k_pos": k_pos,
        "q_seg": segment_ids,
        "k_seg": segment_ids,
    }
    return {name: x for name, x in found.items() if x is not None}


def _typed_spec(x: Any) -> P:
    try:
        return jax.typeof(x).sharding.spec
    except TypeError:  # not a JAX type
        return P()


def _explicit(on: Mesh | AbstractMesh) -> bool:
    base = on.abstract_mesh if isinstance(on, Mesh) else on
    return any(t == AxisType.Explicit for t in base.axis_types)


def _batch_axes(
    given: str | tuple[str, ...] | None, on: Mesh | AbstractMesh, axis: str, query: Any
) -> tuple[str, ...]:
    """The batch's mesh axes: those given, else (on Explicit axes) the query's
    typed layout of its batch, else none."""
    if given is None:
        if query.ndim != 4 or not _explicit(on):
            return ()
        given = _typed_spec(query)[0] if len(_typed_spec(query)) else None
    axes = (given,) if isinstance(given, str) else tuple(given or ())
    check_batch_axes(on, axes, axis, query)
    return axes


def _split_attention(a: dict[str, Any], on: Mesh | AbstractMesh, split: _Split) -> Any:
    """The map, in `jit` (inlined when already inside one): outside, a map
    manual over some axes only does not run."""
    if not _explicit(on):
        return jax.jit(lambda a: _mapped(a, on, split))(a)
    mapped = auto_axes(
        lambda a: _mapped(a, jax.sharding.get_abstract_mesh(), split),
        out_sharding=_typed_spec(a["q"]),
        mesh=on,
    )
    return jax.jit(mapped)(a)


@typecheck
def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    segment_ids: Array | None = None,
    positions: Array | None = None,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    axis: str | None = None,
    strategy: str = "ring",
    batch_axes: str | tuple[str, ...] | None = None,
    block_size: int | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> Array:
    """Scaled dot-product attention, `jax.nn.dot_product_attention`'s layout and
    result, with the sequence split over the mesh axis `axis` (context parallel).

    Queries are `[B, T, N, H]`, keys and values `[B, S, K, H]` with `N` a multiple
    of `K` (grouped-query), or all three without `B` (Equinox's, under `vmap`).
    With `axis=None` this is JAX's function (`segment_ids` and `positions` folded
    into the mask); with an axis it runs in a `jax.shard_map` manual over it,
    `mask` and `bias` split like the scores, by one of three
    [strategies](../how-to/context-parallel.md#three-strategies).
    [`eqshard.balance_sequence`][] with `positions` evens the causal work.

    **Arguments:**

    - `query`, `key`, `value`, `bias`, `mask`, `scale`, `is_causal`: as JAX's.
    - `segment_ids`: `[B, T]` ints, packed sequences (self-attention only).
    - `positions`: `[B, T]`, each token's place in the original sequence, for
      queries and keys alike; needs `is_causal`.
    - `query_seq_lengths`, `key_value_seq_lengths`, `local_window_size`,
      `implementation`: JAX's, with `axis=None` only.
    - `axis`: the mesh axis the sequence is split over; None for JAX's function.
    - `strategy`: `"ring"` (key/value blocks passed round by `ppermute`, an
      online softmax), `"all_gather"` or `"ulysses"` (two all-to-alls).
    - `batch_axes`: the batch's mesh axes, also manual (default: the query's
      typed layout on Explicit axes, else none).
    - `block_size`: the ring's query rows per tile (default: the most whose
      float32 scores fit in 256 MiB); `mesh`: by default `jax.set_mesh`'s.

    **Returns:**

    The attention output, the query's shape and dtype.

    **Raises:**

    `ValueError` naming the argument, axis, size and fix: bad shapes, `axis` not in
    the mesh or lengths it does not divide, heads Ulysses cannot split, `positions`
    without `is_causal`, token arrays not `[B, T]`, a mask not boolean, a mask or
    bias not broadcastable, JAX-only arguments with an axis, or no mesh.

    !!! Example

        ```python
        with jax.set_mesh(eqshard.create_mesh((2, 4), ("dp", "cp"))):
            out = jax.jit(lambda q: eqshard.dot_product_attention(
                q, q, q, is_causal=True, axis="cp"))(jnp.ones((2, 32, 4, 8)))
        ```
    """
    check_shapes(query, key, value)
    check_tokens(query, key, segment_ids, positions, is_causal)
    check_masks(query, key, bias, mask)
    if axis is None:
        batched = query.ndim == 4
        if not batched and (segment_ids is not None or positions is not None):
            segment_ids = None if segment_ids is None else segment_ids[None]
            positions = None if positions is None else positions[None]
        masks = _combined(_four(mask), positions, positions, segment_ids, segment_ids)
        if masks is not None and not batched:
            masks = masks[0]
        return jax.nn.dot_product_attention(
            query, key, value, bias, masks, scale=scale,
            is_causal=is_causal and positions is None,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size,
            implementation=implementation,
        )  # fmt: skip
    jax_only = {
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
        "local_window_size": local_window_size,
        "implementation": implementation,
    }
    check_jax_only(jax_only, axis)
    on = require_mesh(mesh, caller=_CALLER)
    size = axis_count(on, axis, query, key, strategy)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
        segment_ids = None if segment_ids is None else segment_ids[None]
        positions = None if positions is None else positions[None]
    check_block_size(block_size, strategy, query.shape[-3] // size)
    factor = query.shape[-1] ** -0.5 if scale is None else scale
    batch = _batch_axes(batch_axes, on, axis, query)
    split = _Split(axis, size, strategy, factor, batch, block_size)
    a = _arguments(query, key, value, (bias, mask), (segment_ids, positions, is_causal))
    out = _split_attention(a, on, split)
    return out[0] if unbatched else out
