"""Ring attention inside a `jax.shard_map` manual over one mesh axis: the
per-device body of `dot_product_attention(..., strategy="ring")`.

How a call goes, on each of the N devices of the axis (local arrays: queries
`[B, T/N, Nq, H]`, keys and values `[B, S/N, K, H]`):

1. **Forward** (`_forward`). Step `i` (of N) holds the key/value block that
   started on device `d - i` (with its positions and segment ids), computes the
   `T/N x S/N` scores of its queries against it (scaled, plus the bias block,
   masked by the mask block, causality from positions and equal segments), and
   folds them into an online softmax (running max `m`, sum `l` and output `o`,
   all in float32); then the block moves one device on by `ppermute` (N - 1
   moves). No device holds more than one block of scores per head.
2. **Residuals**: the inputs, the output, and each query row's max and sum.
3. **Backward** (`_backward`, the custom VJP): the same ring again, each step
   recomputing its block's probabilities from the row's max and sum, adding to the
   query gradient and to the block's key and value gradients, which travel with
   the block and go home by one last `ppermute`. The bias gradient is written
   block by block. Temporaries stay one block of scores, as in the forward.

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


class RingPlan(NamedTuple):
    """The static side of a ring: the mesh axis, its size and the scale."""

    axis: str
    size: int
    scale: float


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


def _source(step: Any, plan: RingPlan) -> Any:
    """The device whose key block this device holds at `step`."""
    return (jax.lax.axis_index(plan.axis) - step) % plan.size


def _fold(
    carry: Any, q: Any, travel: Any, step: Any, extra: Any, plan: RingPlan
) -> Any:
    """The online softmax with one more key block."""
    m, l, o = carry
    k, v, kaux = travel
    bias, mask, qaux = extra
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


def _forward(plan: RingPlan, q: Any, k: Any, v: Any, extra: Any, kaux: Any) -> Any:
    """The ring's output `[B, Tq, N, H]` and each row's log-sum-exp."""
    b, tq, n, h = q.shape
    groups = k.shape[2]
    qg = q.reshape(b, tq, groups, n // groups, h)
    m = jnp.full((b, groups, n // groups, tq), -jnp.inf, jnp.float32)
    carry = (m, jnp.zeros_like(m), jnp.zeros(qg.shape, jnp.float32))

    def step(state: Any, i: Any) -> tuple[Any, None]:
        carry, travel = state
        carry = _fold(carry, qg, travel, i, extra, plan)
        return (carry, _send(travel, plan)), None

    travel = (k, v, kaux)
    (carry, travel), _ = jax.lax.scan(step, (carry, travel), jnp.arange(plan.size - 1))
    m, l, o = _fold(carry, qg, travel, plan.size - 1, extra, plan)
    out = o / jnp.moveaxis(l, 3, 1)[..., None]
    # The row's max and sum, not their log-sum-exp: a row with every key masked
    # has max -0.7·f32max, which would swallow log(sum) in float32.
    return out.reshape(q.shape).astype(q.dtype), (m, l)


def _bias_grad(acc: Any, ds: Any, bias: Any, src: Any) -> Any:
    """`acc` (the bias's gradient so far) with one block's score gradient `ds`
    `[B, K, G, Tq, Tk]` summed down to the bias's broadcast dimensions."""
    b, kh, g, tq, tk = ds.shape
    ds = ds.reshape(b, kh * g, tq, tk)
    dims = tuple(i for i in range(3) if bias.shape[i] == 1)
    ds = ds.sum(dims, keepdims=True)
    if bias.shape[3] == 1:
        return acc + ds.sum(3, keepdims=True)
    return jax.lax.dynamic_update_slice_in_dim(acc, ds, src * tk, axis=3)


def _grad_block(grads: Any, travel: Any, step: Any, res: Any, plan: RingPlan) -> Any:
    """One key block's share of every gradient."""
    dq, dbias = grads
    k, v, kaux, dk, dv = travel
    qg, dog, lse, delta, extra = res
    bias, mask, qaux = extra
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


def _backward(plan: RingPlan, res: Any, do: Any) -> Any:
    q, k, v, extra, kaux, out, lse = res
    b, tq, n, h = q.shape
    shape = (b, tq, k.shape[2], n // k.shape[2], h)
    qg, dog = q.reshape(shape), do.reshape(shape)
    delta = jnp.einsum(
        "btkgh,btkgh->bkgt", dog, out.reshape(shape), preferred_element_type=jnp.float32
    )
    bias = extra[0]
    dbias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    grads = (jnp.zeros(shape, jnp.float32), dbias)
    travel = (
        k,
        v,
        kaux,
        jnp.zeros(k.shape, jnp.float32),
        jnp.zeros(v.shape, jnp.float32),
    )
    block_res = (qg, dog, lse, delta, extra)

    def step(state: Any, i: Any) -> tuple[Any, None]:
        grads, travel = _grad_block(state[0], state[1], i, block_res, plan)
        return (grads, _send(travel, plan)), None

    (grads, travel), _ = jax.lax.scan(step, (grads, travel), jnp.arange(plan.size - 1))
    (dq, dbias), travel = _grad_block(grads, travel, plan.size - 1, block_res, plan)
    dk, dv = _send(travel[3:], plan)  # home: one device on
    dbias = None if bias is None else dbias.astype(bias.dtype)
    return (
        dq.reshape(q.shape).astype(q.dtype),
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
