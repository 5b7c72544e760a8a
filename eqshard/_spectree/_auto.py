"""Automatic FSDP: a partition-rule value that chooses a leaf's spec from its shape.

`auto_fsdp(axes)` makes an `AutoFSDP`, which a partition rule may map a regex to
instead of a `PartitionSpec` (see `_rules.py`). For each leaf it shards the
largest dimension that the axes' total size divides, as scalax's
`FSDPShardingRule` and eformer's `auto_partition_spec` do, and says why it chose
what it chose, for `explain_partition_rules`.
"""

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .._mesh._current import current_mesh
from .._typing import Int, typecheck
from ._check_spec import entry_axes, spec_entry


@dataclasses.dataclass(frozen=True)
class AutoFSDP:
    """A partition-rule value that shards each leaf's largest divisible dimension;
    made by [`eqshard.auto_fsdp`][].

    Calling it with a leaf's shape gives the leaf's `PartitionSpec`;
    `choose(shape, mesh=None)` gives the spec and why it was chosen (`mesh`: the
    mesh the rules are matched on, used unless the value has its own).

    **Fields:** `axes`, `min_size`, `stacked`, `base` and `mesh`, as given to
    [`eqshard.auto_fsdp`][].
    """

    axes: tuple[str, ...]
    min_size: int
    stacked: int
    base: PartitionSpec
    mesh: Mesh | AbstractMesh | None = dataclasses.field(default=None, compare=False)

    def _sizes(self, matching: Mesh | AbstractMesh | None) -> Mapping[str, int]:
        """The axis sizes: of the value's own mesh, else of the mesh the rules are
        matched on, else of the mesh set by `jax.set_mesh`."""
        mesh = self.mesh if self.mesh is not None else matching
        if mesh is None:
            mesh = current_mesh()
        if mesh is None:
            raise ValueError(
                f"eqshard.auto_fsdp: {self!r} needs the sizes of the mesh axes "
                f"{self.axes}, but no mesh is given or set. Give the mesh to the "
                "matching, `eqshard.match_partition_rules(rules, tree, mesh=mesh)` "
                "(`init_sharded` and `explain_partition_rules` take `mesh=` too), "
                "or to the value, `eqshard.auto_fsdp(..., mesh=mesh)`; either may "
                "be an `AbstractMesh`, to plan for devices you do not have. A "
                "concrete mesh set by `jax.set_mesh(mesh)` is used too."
            )
        sizes = dict(mesh.shape)
        missing = [axis for axis in self.axes if axis not in sizes]
        if missing:
            raise ValueError(
                f"eqshard.auto_fsdp: {', '.join(map(repr, missing))} "
                f"{'is not an axis' if len(missing) == 1 else 'are not axes'} of the "
                f"mesh {sizes}. Give axes of the mesh, e.g. "
                f"eqshard.auto_fsdp({tuple(sizes)[0]!r})."
            )
        return sizes

    def choose(
        self, shape: Sequence[int], mesh: Mesh | AbstractMesh | None = None
    ) -> tuple[PartitionSpec, str]:
        """The spec for an array of `shape`, and why: which dimension was sharded,
        or why none was. `mesh` is the mesh the rules are matched on, whose axis
        sizes count unless the value has its own `mesh`."""
        shape = tuple(int(n) for n in shape)
        sizes = self._sizes(mesh)
        entries = list(self.base)[: len(shape)]
        used = {axis for entry in entries for axis in entry_axes(entry)}
        axes = [axis for axis in self.axes if axis not in used]
        base = PartitionSpec(*entries)
        if not axes:
            return base, f"auto_fsdp: the spec already uses {self.axes}"
        size = math.prod(sizes[axis] for axis in axes)
        elements = math.prod(shape)
        if elements < self.min_size:
            return base, (
                f"auto_fsdp: {elements:,} elements < min_size {self.min_size:,}, "
                "not sharded"
            )
        entries += [None] * (len(shape) - len(entries))
        free = [
            d
            for d in range(self.stacked, len(shape))
            if entries[d] is None and shape[d] % size == 0
        ]
        what = f"{spec_entry(axes)!r} (size {size})"
        if not free:
            skipped = f" after {self.stacked} stacked" if self.stacked else ""
            return base, (
                f"auto_fsdp: no free dimension{skipped} is divisible by {what}, "
                "not sharded"
            )
        dim = max(free, key=lambda d: (shape[d], -d))  # the largest; the first of ties
        entries[dim] = spec_entry(axes)
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries), (
            f"auto_fsdp: dimension {dim} (size {shape[dim]}) is the largest free "
            f"one divisible by {what}"
        )

    def __call__(self, shape: Sequence[int]) -> PartitionSpec:
        return self.choose(shape)[0]

    def __repr__(self) -> str:
        options = [f"min_size={self.min_size}"]
        if self.stacked:
            options.append(f"stacked={self.stacked}")
        if len(self.base):
            options.append(f"base={self.base}")
        return f"auto_fsdp({spec_entry(self.axes)!r}, {', '.join(options)})"


@typecheck
def auto_fsdp(
    axes: str | Sequence[str],
    *,
    min_size: Int = 2**20,
    stacked: Int = 0,
    base: PartitionSpec = PartitionSpec(),
    mesh: Mesh | AbstractMesh | None = None,
) -> AutoFSDP:
    """A partition-rule value that shards each array's largest dimension divisible
    by the size of `axes` (fully sharded data parallelism, chosen per leaf).

    When [`eqshard.match_partition_rules`][] meets a leaf of at least `min_size`
    elements, it shards over all of `axes` (one dimension, split by the product of
    their sizes) the largest dimension that is free in `base` and that product
    divides, the first of equal ones; other arrays keep `base`.
    [`eqshard.explain_partition_rules`][] says which dimension was chosen and why.
    A stack of layers cannot be told from a shape: give it a rule of its own with
    `stacked=` (see [Will it fit?](../how-to/will-it-fit.md#in-python)).

    **Arguments:**

    - `axes`: the mesh axis or axes to shard over (`"fsdp"`, `("dp", "fsdp")`).
    - `min_size`: arrays with fewer elements keep `base` (replicated by default).
    - `stacked`: how many leading dimensions are stacked-layer axes, never sharded.
    - `base`: a spec to add FSDP to, such as a tensor-parallel `P(None, "tp")`;
      axes it already uses are not used again.
    - `mesh`: the mesh whose axis sizes count; defaults to the mesh the rules are
      matched on, then to the mesh set by `jax.set_mesh`. An `AbstractMesh` plans
      for devices you do not have.

    **Returns:**

    An [`eqshard.AutoFSDP`][]: `value(shape)` is the spec for an array of `shape`.

    **Raises:**

    `ValueError` if `min_size` or `stacked` is negative, or if `axes` names an
    axis twice; when the rules are matched, if there is no mesh or `axes` are not
    axes of the mesh.

    !!! Example

        ```python
        mesh = jax.sharding.AbstractMesh((256, 8), ("fsdp", "tp"))
        rules = [("mlp/up", eqshard.auto_fsdp("fsdp", base=P(None, "tp"), mesh=mesh)),
                 (".*", eqshard.auto_fsdp("fsdp", mesh=mesh))]
        params = {"mlp": {"up": jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16)},
                  "embed": jax.ShapeDtypeStruct((8192, 512), jnp.bfloat16)}
        eqshard.match_partition_rules(rules, params)
        # {"mlp": {"up": P("fsdp", "tp")}, "embed": P("fsdp")}
        ```
    """
    min_size, stacked = operator.index(min_size), operator.index(stacked)
    for name, value in (("min_size", min_size), ("stacked", stacked)):
        if value < 0:
            raise ValueError(f"eqshard.auto_fsdp: `{name}` must be >= 0, got {value}.")
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    if not names or not all(isinstance(axis, str) for axis in names):
        raise ValueError(
            f"eqshard.auto_fsdp: `axes` must be a mesh axis name or a non-empty "
            f"sequence of them, such as 'fsdp' or ('dp', 'fsdp'); got {axes!r}."
        )
    repeated = sorted({axis for axis in names if names.count(axis) > 1})
    if repeated:
        unique = tuple(dict.fromkeys(names))
        raise ValueError(
            f"eqshard.auto_fsdp: `axes` {axes!r} names "
            f"{', '.join(map(repr, repeated))} more than once, but a mesh axis can "
            f"split an array only once. Name each axis once, e.g. "
            f"eqshard.auto_fsdp({spec_entry(unique)!r})."
        )
    return AutoFSDP(names, min_size, stacked, base, mesh)
