"""The `stacked` rule value: a partition rule's spec written for one layer, for
layers stacked on leading axes.

`stacked(spec)` makes a `Stacked`, which the matching engine (`_rules.py`,
`rule_spec`) resolves like any spec and then places on a leaf's last dimensions
(`Stacked.place`), the leading ones unsharded, or with `stages=` the layer axis
over a pipeline's stage axis.
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
    [`eqshard.AxisNames`][], naming the last `len(spec)` dimensions of a leaf;
    `stages`, the mesh axis of pipeline stages the layer axis goes over (or
    `None`).
    """

    spec: PartitionSpec | AxisNames
    stages: str | None = None

    def place(self, spec: PartitionSpec, rank: int) -> tuple[PartitionSpec, str]:
        """The layer's `spec` (resolved) for a leaf of `rank` dimensions: the
        leading ones unsharded. A spec longer than `rank` is returned as it is,
        for the caller's check to refuse."""
        layers = rank - len(spec)
        if self.stages is not None and layers > 0:
            return self._staged(spec, layers)
        if layers <= 0 or not len(spec):
            return spec, "stacked: no layer axis in front"
        axes = "1 layer axis" if layers == 1 else f"{layers} layer axes"
        return PartitionSpec(*(None,) * layers, *spec), f"stacked: {axes} in front"

    def _staged(self, spec: PartitionSpec, layers: int) -> tuple[PartitionSpec, str]:
        """The layer axis over the stage axis: `(L, ...)` gives `P(stages, ...)`
        (GPipe's stages), the circular view `(R, S, K, ...)` of
        `eqshard.stage_view` gives `P(None, stages, None, ...)`."""
        if layers == 3:
            lead, why = (None, self.stages, None), "the circular view (R, S, K)"
        else:
            lead = (self.stages, *(None,) * (layers - 1))
            why = "the layer axis"
        return PartitionSpec(*lead, *spec), f"stacked: {why} over {self.stages!r}"

    def __repr__(self) -> str:
        staged = "" if self.stages is None else f", stages={self.stages!r}"
        return f"stacked({self.spec!r}{staged})"


@typecheck
def stacked(spec: Any, *, stages: str | None = None) -> Stacked | Host:
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
    - `stages`: a mesh axis of pipeline stages ([`eqshard.pipeline`][]): the
      layer axis goes over it, `P("pp", "tp", None)` for `(4, 192, 64)` (GPipe:
      stage `s` holds the `s`-th block of layers), and a leaf with three axes in
      front is read as the circular view `(R, S, K, ...)` of
      [`eqshard.stage_view`][]: `P(None, "pp", None, "tp", None)`.

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
        return Host(stacked(spec.spec, stages=stages))
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
    return Stacked(spec, stages)
