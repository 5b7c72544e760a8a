"""Ring attention inside a `jax.shard_map` manual over one mesh axis: the
per-device body of `dot_product_attention(..., strategy="ring")`.

How a call goes, on each of the N devices of the axis (local arrays: queries
`[B, T/N, Nq, H]`, keys and values `[B, S/N, K, H]`):

1. **Forward** (`_forward`). Step `i` (of N) holds the key/value block that
   started on device `d - i` (with its positions and segment ids). The local
   queries go through it a tile of rows at a time (`lax.map` over tiles of
   `RingPlan.rows`, default `tile_rows`: the most rows, a divisor of `T/N`,
   whose float32 scores fit in `TILE_BYTES`): each tile's `rows x S/N` scores
   (scaled, plus the bias block, masked by the mask block, causality from
   positions and equal segments) fold into that tile's online softmax (running
   max `m`, sum `l` and output `o`, all in float32). Then the block moves one
   device on by `ppermute` (N - 1 moves). No device holds more than one tile of
   scores, `[B, N, rows, S/N]`, not the whole `[B, N, T/N, S/N]` block.
2. **Residuals**: the inputs, the output, and each query row's max and sum.
3. **Backward** (`_backward`, the custom VJP): the same ring again, each step
   a `lax.scan` over the same tiles recomputing their probabilities from the
   rows' max and sum, writing the tile's query (and bias) gradient and adding
   to the block's key and value gradients, which travel with the block and go
   home by one last `ppermute`. Temporaries stay a few tiles of scores.

A masked score is JAX's large negative number, not `-inf`, so a row with no key
left gives what `jax.nn.dot_product_attention` gives (the mean of the values).
"""

import functools as ft
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu


# What `jax.nn.dot_product_attention` puts in place of a masked float32 score.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


# The most bytes of float32 scores one tile of query rows may hold, by default.
TILE_BYTES = 1 << 28


class RingPlan(NamedTuple):
    """The static side of a ring: the mesh axis, its size, the scale and the
    query rows per tile (None: chosen from `TILE_BYTES`)."""

    axis: str
    size: int
    scale: float
    rows: int | None = None


def tile_rows(tq: int, row_bytes: int, rows: int | None = None) -> int:
    """Query rows per tile: `rows` if given, else the largest divisor of `tq`
    whose tile of scores (`row_bytes` a row) stays within `TILE_BYTES`."""
    if rows is not None:
        return rows
    most = max(1, TILE_BYTES // max(row_bytes, 1))
    return max(c for c in range(1, min(tq, most) + 1) if tq % c == 0)


def _rows(plan: RingPlan, q: Any, k: Any) -> int:
    b, tq, n, _ = q.shape
    return tile_rows(tq, b * n * k.shape[1] * 4, plan.rows)


def _tiles(x: Any, axis: int, rows: int, full: int) -> Any:
    """`x` cut into tiles of `rows` along `axis`, the tiles first; None if `x`
    is None or broadcast there (not of length `full`)."""
    if x is None or x.shape[axis] != full:
        return None
    x = x.reshape(*x.shape[:axis], full // rows, rows, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _untile(x: Any, axis: int) -> Any:
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def _pick(tile: Any, whole: Any) -> Any:
    return whole if tile is None else tile


def _perm(size: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % size) for j in range(size)]


def _send(tree: Any, plan: RingPlan) -> Any:
    """Every array of `tree` one device on along the ring."""
    perm = _perm(plan.size)
    return jtu.tree_map(lambda a: jax.lax.ppermute(a, plan.axis, perm), tree)


def _block(x: Any, src: Any, tk: int, groups: tuple[int, int]) -> Any:
    """A `[B, N|1, Tq|1, S|1]` bias or mask cut to the columns of the key block
    from device `src`, its heads split `[B, K|1, G|1, Tq|1, Tk|1]`."""
    if x is None:
        return None
    if x.shape[3] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, src * tk, tk, axis=3)
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], *groups, *x.shape[2:])


def _valid(mask: Any, qaux: Any, kaux: Any) -> Any:
    """Which scores count: the mask block, causality (a key's position not after
    the query's) and equal segment ids; `None` if nothing is masked."""
    q_pos, q_seg = qaux
    k_pos, k_seg = kaux
    valid = mask
    if q_pos is not None:
        causal = q_pos[:, None, None, :, None] >= k_pos[:, None, None, None, :]
        valid = causal if valid is None else valid & causal
    if q_seg is not None:
        same = q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :]
        valid = same if valid is None else valid & same
    return valid


def _scores(q: Any, k: Any, bias: Any, valid: Any, scale: float) -> Any:
    """`[B, K, G, Tq, Tk]` float32 scores of grouped queries against a key block."""
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    s = s * jnp.float32(scale)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if valid is not None:
        s = jnp.where(valid, s, _NEG)
    return s


def _tied(extra: Any, kaux: Any, q: Any) -> tuple[Any, ...]:
    """The bias, mask and positions tied to the queries by an optimization
    barrier: what they give (the causal mask above all) then depends on the
    differentiated inputs, so JAX's partial evaluation (a scan over layers being
    differentiated) cannot hoist it out of the tiles and stack every tile's
    `[B, N, rows, S/N]` mask at once."""
    (bias, mask, qaux), kaux, q = jax.lax.optimization_barrier((extra, kaux, q))
    return bias, mask, qaux, kaux, q


def _source(step: Any, plan: RingPlan) -> Any:
    """The device whose key block this device holds at `step`."""
    return (jax.lax.axis_index(plan.axis) - step) % plan.size


def _fold(
    carry: Any, q: Any, travel: Any, step: Any, extra: Any, plan: RingPlan
) -> Any:
    """The online softmax with one more key block."""
    m, l, o = carry
    k, v, kaux = travel
    bias, mask, qaux, kaux, q = _tied(extra, kaux, q)
    src = _source(step, plan)
    groups = (k.shape[2], q.shape[3])
    valid = _valid(_block(mask, src, k.shape[1], groups), qaux, kaux)
    s = _scores(q, k, _block(bias, src, k.shape[1], groups), valid, plan.scale)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    pv = jnp.einsum(
        "bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    o = o * jnp.moveaxis(corr, 3, 1)[..., None] + pv
    return m_new, l, o


def _query_tiles(extra: Any, qg: Any, rows: int) -> tuple[Any, Any]:
    """The query side cut into tiles of `rows` (query, bias, mask, positions,
    segments), and a function from one tile to its `(q, extra)`."""
    bias, mask, (q_pos, q_seg) = extra
    tq = qg.shape[1]
    tiles = (
        _tiles(qg, 1, rows, tq),
        _tiles(bias, 2, rows, tq),
        _tiles(mask, 2, rows, tq),
        _tiles(q_pos, 1, rows, tq),
        _tiles(q_seg, 1, rows, tq),
    )

    def one(tile: Any) -> tuple[Any, Any]:
        qc, bc, mc, pc, sc = tile
        return qc, (_pick(bc, bias), _pick(mc, mask), (pc, sc))

    return tiles, one


def _forward(plan: RingPlan, q: Any, k: Any, v: Any, extra: Any, kaux: Any) -> Any:
    """The ring's output `[B, Tq, N, H]` and each row's max and sum. At each
    step the local queries go through the key block a tile of rows at a time."""
    b, tq, n, h = q.shape
    groups, rows = k.shape[2], _rows(plan, q, k)
    qg = q.reshape(b, tq, groups, n // groups, h)
    tiles, one = _query_tiles(extra, qg, rows)
    m = jnp.full((tq // rows, b, groups, n // groups, rows), -jnp.inf, jnp.float32)
    o = jnp.zeros((tq // rows, b, rows, groups, n // groups, h), jnp.float32)

    def fold(carry: Any, travel: Any, i: Any) -> Any:
        def tile(x: Any) -> Any:
            qc, ex = one(x[1])
            return _fold(x[0], qc, travel, i, ex, plan)

        return jax.lax.map(tile, (carry, tiles))

    def step(state: Any, i: Any) -> tuple[Any, None]:
        carry, travel = state
        return (fold(carry, travel, i), _send(travel, plan)), None

    state = ((m, jnp.zeros_like(m), o), (k, v, kaux))
    (carry, travel), _ = jax.lax.scan(step, state, jnp.arange(plan.size - 1))
    m, l, o = fold(carry, travel, plan.size - 1)
    out = o / jnp.moveaxis(l, 4, 2)[..., None]
    # The row's max and sum, not their log-sum-exp: a row with every key masked
    # has max -0.7·f32max, which would swallow log(sum) in float32.
    out = _untile(out, 1).reshape(q.shape).astype(q.dtype)
    return out, (_untile(m, 3), _untile(l, 3))


def _bias_grad(acc: Any, ds: Any, bias: Any, src: Any) -> Any:
    """`acc` (the bias's gradient so far) with one block's score gradient `ds`
    `[B, K, G, Tq, Tk]` summed down to the bias's broadcast dimensions."""
    b, kh, g, tq, tk = ds.shape
    ds = ds.reshape(b, kh * g, tq, tk)
    dims = tuple(i for i in range(3) if bias.shape[i] == 1)
    ds = ds.sum(dims, keepdims=True)
    if bias.shape[3] == 1:
        return acc + ds.sum(3, keepdims=True)
    ds = ds + jax.lax.dynamic_slice_in_dim(acc, src * tk, tk, axis=3)
    return jax.lax.dynamic_update_slice_in_dim(acc, ds, src * tk, axis=3)


def _grad_block(grads: Any, travel: Any, step: Any, res: Any, plan: RingPlan) -> Any:
    """One key block's share of every gradient."""
    dq, dbias = grads
    k, v, kaux, dk, dv = travel
    qg, dog, lse, delta, extra = res
    bias, mask, qaux, kaux, qg = _tied(extra, kaux, qg)
    src = _source(step, plan)
    groups = (k.shape[2], qg.shape[3])
    valid = _valid(_block(mask, src, k.shape[1], groups), qaux, kaux)
    s = _scores(qg, k, _block(bias, src, k.shape[1], groups), valid, plan.scale)
    m, l = lse
    p = jnp.exp(s - m[..., None]) / l[..., None]
    f32 = ft.partial(jnp.einsum, preferred_element_type=jnp.float32)
    dv = dv + f32("bkgts,btkgh->bskh", p, dog)
    ds = p * (f32("btkgh,bskh->bkgts", dog, v) - delta[..., None])
    if valid is not None:
        ds = jnp.where(valid, ds, 0.0)
    dq = dq + f32("bkgts,bskh->btkgh", ds, k) * plan.scale
    dk = dk + f32("bkgts,btkgh->bskh", ds, qg) * plan.scale
    if bias is not None:
        dbias = _bias_grad(dbias, ds, bias, src)
    return (dq, dbias), (k, v, kaux, dk, dv)


def _grad_tiles(
    grads: Any, travel: Any, step: Any, res: Any, plan: RingPlan
) -> tuple[Any, Any]:
    """One key block's share of every gradient, a tile of query rows at a time:
    the query (and bias) gradients by tile, the key and value ones carried."""
    dq, dbias_tiles, dbias = grads
    k, v, kaux, dk, dv = travel
    tiles, one = res

    def tile(carry: Any, x: Any) -> tuple[Any, Any]:
        dk, dv, dbias = carry
        dqc, dbc, (qt, doc, mc, lc, dc) = x
        qc, ex = one(qt)
        (dqc, db), (*_, dk, dv) = _grad_block(
            (dqc, _pick(dbc, dbias)),
            (k, v, kaux, dk, dv),
            step,
            (qc, doc, (mc, lc), dc, ex),
            plan,
        )
        if dbc is None:  # the bias's gradient is whole, not by tile
            return (dk, dv, db), (dqc, None)
        return (dk, dv, dbias), (dqc, db)

    (dk, dv, dbias), (dq, dbias_tiles) = jax.lax.scan(
        tile, (dk, dv, dbias), (dq, dbias_tiles, tiles)
    )
    return (dq, dbias_tiles, dbias), (k, v, kaux, dk, dv)


def _backward(plan: RingPlan, res: Any, do: Any) -> Any:
    q, k, v, extra, kaux, out, (m, l) = res
    b, tq, n, h = q.shape
    rows = _rows(plan, q, k)
    shape = (b, tq, k.shape[2], n // k.shape[2], h)
    qg, dog = q.reshape(shape), do.reshape(shape)
    delta = jnp.einsum(
        "btkgh,btkgh->bkgt", dog, out.reshape(shape), preferred_element_type=jnp.float32
    )
    qtiles, one = _query_tiles(extra, qg, rows)
    tiles = (
        qtiles,
        _tiles(dog, 1, rows, tq),
        _tiles(m, 3, rows, tq),
        _tiles(l, 3, rows, tq),
        _tiles(delta, 3, rows, tq),
    )
    bias = extra[0]
    dbias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    dbias_tiles = _tiles(dbias, 2, rows, tq)
    dq = jnp.zeros((tq // rows, b, rows, *shape[2:]), jnp.float32)
    grads = (dq, dbias_tiles, None if dbias_tiles is not None else dbias)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    travel = (k, v, kaux, *zeros)
    block_res = (tiles, one)

    def step(state: Any, i: Any) -> tuple[Any, None]:
        grads, travel = _grad_tiles(state[0], state[1], i, block_res, plan)
        return (grads, _send(travel, plan)), None

    (grads, travel), _ = jax.lax.scan(step, (grads, travel), jnp.arange(plan.size - 1))
    (dq, dbias_tiles, dbias), travel = _grad_tiles(
        grads, travel, plan.size - 1, block_res, plan
    )
    dk, dv = _send(travel[3:], plan)  # home: one device on
    if dbias_tiles is not None:
        dbias = _untile(dbias_tiles, 2)
    dbias = None if bias is None else dbias.astype(bias.dtype)
    return (
        _untile(dq, 1).reshape(q.shape).astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        (dbias, None, None),
        None,
    )


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(
    plan: RingPlan, q: Any, k: Any, v: Any, extra: Any, kaux: Any
) -> Any:
    """The ring's output for local `q`, `k`, `v` (see the module's docstring).
    `extra` is `(bias, mask, (q_positions, q_segments))`, the query side's;
    `kaux` `(k_positions, k_segments)`, travelling with the keys; any may be None."""
    return _forward(plan, q, k, v, extra, kaux)[0]


def _ring_fwd(plan: RingPlan, q: Any, k: Any, v: Any, extra: Any, kaux: Any) -> Any:
    out, lse = _forward(plan, q, k, v, extra, kaux)
    return out, (q, k, v, extra, kaux, out, lse)


ring_attention.defvjp(_ring_fwd, _backward)
