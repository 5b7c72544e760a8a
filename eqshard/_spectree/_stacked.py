"""The `stacked` rule value: a partition rule's spec written for one layer, for
layers stacked on leading axes.

`stacked(spec)` makes a `Stacked`, which the matching engine (`_rules.py`,
`rule_spec`) resolves like any spec and then places on a leaf's last dimensions
(`Stacked.place`), the leading ones unsharded.
"""

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec

from .._typing import typecheck
from ._logical import AxisNames
from ._memory import Host


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A partition-rule value written for one layer, for layers stacked on leading
    axes; made by [`eqshard.stacked`][].

    **Fields:** `spec`, the layer's `PartitionSpec` or logical
    [`eqshard.AxisNames`][], naming the last `len(spec)` dimensions of a leaf.
    """

    spec: PartitionSpec | AxisNames

    def place(self, spec: PartitionSpec, rank: int) -> tuple[PartitionSpec, str]:
        """The layer's `spec` (resolved) for a leaf of `rank` dimensions: the
        leading ones unsharded. A spec longer than `rank` is returned as it is,
        for the caller's check to refuse."""
        layers = rank - len(spec)
        if layers <= 0 or not len(spec):
            return spec, "stacked: no layer axis in front"
        axes = "1 layer axis" if layers == 1 else f"{layers} layer axes"
        return PartitionSpec(*(None,) * layers, *spec), f"stacked: {axes} in front"

    def __repr__(self) -> str:
        return f"stacked({self.spec!r})"


@typecheck
def stacked(spec: Any) -> Stacked | Host:
    """Marks a partition rule's spec as written for one layer, for layers stacked
    on leading axes (by `eqx.filter_vmap` over a layer's constructor, for
    `jax.lax.scan`).

    The spec names a leaf's *last* `len(spec)` dimensions, and every dimension in
    front of them is a layer axis, left unsharded: the leaf's rank says how many,
    so one rule fits layers stacked once, twice (nested `filter_vmap`) or not at
    all. `stacked(P("tp", None))` gives `P("tp", None)` for a `(192, 64)`
    weight, `P(None, "tp", None)` for 4 stacked ones `(4, 192, 64)` and
    `P(None, None, "tp", None)` for `(2, 4, 192, 64)`. Write the layer's spec to
    its full rank (`P("tp", None)`, not `P("tp")`): entries are counted from the
    end. Everywhere else a spec shorter than the rank keeps JAX's meaning (its
    entries are the leading dimensions), so only a rule marked so is read from
    the end. [`eqshard.auto_fsdp`][] takes `stacked=` itself.

    **Arguments:**

    - `spec`: the layer's `PartitionSpec`, or logical [`eqshard.AxisNames`][]
      (resolved by the logical axis rules in force).

    **Returns:**

    A rule value for [`eqshard.match_partition_rules`][] (and every `specs=` that
    takes rules).

    **Raises:**

    `TypeError` if `spec` is not a `PartitionSpec` or `AxisNames`.

    !!! Example

        ```python
        rules = [("blocks/.*/weight", eqshard.stacked(P("tp", None))), (".*", P())]
        params = {"blocks": {"up": {"weight": jnp.zeros((4, 192, 64))}}}
        eqshard.match_partition_rules(rules, params)
        # {"blocks": {"up": {"weight": P(None, "tp", None)}}}
        ```
    """
    if isinstance(spec, Host) and spec.spec is not None:  # host(stacked(spec))
        return Host(stacked(spec.spec))
    if not isinstance(spec, PartitionSpec | AxisNames):
        hint = (
            " For automatic FSDP of stacked layers, use "
            "`eqshard.auto_fsdp(..., stacked=n)`."
            if callable(spec)
            else ""
        )
        raise TypeError(
            f"eqshard.stacked: `spec` is {spec!r}, which is not a PartitionSpec or "
            f"eqshard.AxisNames; give the spec of one layer, e.g. "
            f"eqshard.stacked(P('tp', None)).{hint}"
        )
    return Stacked(spec)
