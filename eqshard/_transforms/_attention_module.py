"""`ContextParallelAttention`: `eqx.nn.MultiheadAttention` with its sequence
split over a context axis, a drop-in replacement swapped into a model with
`eqx.tree_at`.

`MultiheadAttention` cannot be hooked: `process_heads` changes the heads but not
the softmax, which must see every key. So this module holds the same fields
(the four projections, the dropout, the sizes), is built from an existing one
(its parameters shared, not copied), and calls the same projections around
[`eqshard.dot_product_attention`][] instead of Equinox's attention. The model's
code is unchanged; its inputs are laid out with the sequence over the axis.
"""

import warnings
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, PRNGKeyArray

from .._typing import typecheck
from ._attention import dot_product_attention


def _dropout_error(p: float) -> ValueError:
    return ValueError(
        f"eqshard.ContextParallelAttention: the attention's dropout has p={p}, "
        "and dropping attention weights needs the whole score matrix, which a "
        "context-parallel attention never holds; call it with inference=True, "
        "or build the attention with dropout_p=0 (drop the output instead)."
    )


class ContextParallelAttention(eqx.Module):
    """`eqx.nn.MultiheadAttention`, its attention computed with the sequence
    split over the mesh axis `axis` by [`eqshard.dot_product_attention`][].

    Built from an existing `MultiheadAttention` (its projections shared), with
    the same fields and call, so it replaces one inside a model with
    `eqx.tree_at`, stacked layers (`eqx.filter_vmap`-built) included. The call
    takes one sequence, as Equinox's does (vmap it over the batch); its extra
    keywords `positions` and `segment_ids` are [`eqshard.dot_product_attention`][]'s.
    Under `vmap` the batch's axes cannot be named, so `"all_gather"` and
    `"ulysses"` gather the batch of a data-parallel axis first; the default
    `"ring"` keeps it split.

    **Arguments:**

    - `attention`: the `eqx.nn.MultiheadAttention` to replace.
    - `axis`: the context axis of the mesh (set with `jax.set_mesh`).
    - `strategy`: `"ring"`, `"all_gather"` or `"ulysses"`.
    - `is_causal`: a causal mask on every call (Equinox's module has none; its
      callers pass a `mask`, which works too but is `T x S`).

    **Raises:**

    `ValueError` at the call if the dropout would drop attention weights, and
    [`eqshard.dot_product_attention`][]'s errors.

    !!! Example

        ```python
        class Block(eqx.Module):
            attn: eqx.nn.MultiheadAttention

            def __call__(self, x):
                return self.attn(x, x, x)

        block = Block(eqx.nn.MultiheadAttention(4, 32, key=jax.random.key(0)))
        block = eqx.tree_at(
            lambda b: b.attn, block,
            replace_fn=lambda a: eqshard.ContextParallelAttention(a, axis="cp"),
        )
        mesh = eqshard.create_mesh((2, 4), ("dp", "cp"))
        with jax.set_mesh(mesh):
            x = jnp.ones((2, 16, 32))
            y = eqx.filter_jit(lambda b, x: jax.vmap(b)(x))(block, x)
        ```
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    axis: str = eqx.field(static=True)
    strategy: str = eqx.field(static=True)
    is_causal: bool = eqx.field(static=True)

    @typecheck
    def __init__(
        self,
        attention: eqx.nn.MultiheadAttention,
        *,
        axis: str,
        strategy: str = "ring",
        is_causal: bool = False,
    ):
        for name in (
            "query_proj key_proj value_proj output_proj dropout num_heads "
            "query_size key_size value_size output_size qk_size vo_size "
            "use_query_bias use_key_bias use_value_bias use_output_bias"
        ).split():
            setattr(self, name, getattr(attention, name))
        self.axis = axis
        self.strategy = strategy
        self.is_causal = is_causal

    def _project(self, proj: eqx.nn.Linear, x: Array) -> Array:
        return jax.vmap(proj)(x).reshape(x.shape[0], self.num_heads, -1)

    def __call__(
        self,
        query: Array,
        key_: Array,
        value: Array,
        mask: Array | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: Any = None,
        positions: Array | None = None,
        segment_ids: Array | None = None,
    ) -> Array:
        """`eqx.nn.MultiheadAttention.__call__`'s arguments and result, for one
        sequence; `positions` and `segment_ids` `[T]` as
        [`eqshard.dot_product_attention`][]'s. `key` is unused (no dropout of
        attention weights)."""
        del key
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "ContextParallelAttention()(deterministic=...) is deprecated in "
                "favour of inference=...",
                stacklevel=2,
            )
        if inference is None:
            inference = self.dropout.inference
        if self.dropout.p > 0 and not inference:
            raise _dropout_error(self.dropout.p)
        q = self._project(self.query_proj, query)
        k = self._project(self.key_proj, key_)
        v = self._project(self.value_proj, value)
        if process_heads is not None:
            shapes = (q.shape, k.shape, v.shape)
            q, k, v = process_heads(q, k, v)
            if (q.shape, k.shape, v.shape) != shapes:
                raise ValueError(
                    "process_heads must not change the shape of the heads."
                )
        out = dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            is_causal=self.is_causal,
            positions=positions,
            segment_ids=segment_ids,
            axis=self.axis,
            strategy=self.strategy,
        )
        return jax.vmap(self.output_proj)(out.reshape(query.shape[0], -1))
