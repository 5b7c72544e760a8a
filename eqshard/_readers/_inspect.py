"""Reading the shardings of a pytree, and planning memory before anything moves.

The readers (`get_partition_spec`, `extract_sharding_structure`,
`extract_shardings`) turn the arrays of a tree into its spec tree or sharding
tree. `analyze_sharding_strategy` works out, from shapes and specs alone, how many
bytes each device of a mesh would hold: it reads only `.shape` and `.dtype`, so it
plans a 70B-parameter model from `jax.ShapeDtypeStruct`s without allocating.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.sharding import (
    AbstractMesh,
    Mesh,
    NamedSharding,
    PartitionSpec,
    SingleDeviceSharding,
)
from jaxtyping import PyTree

from .._deprecated import renamed_attribute, renamed_literals
from .._mesh import find_mesh, mesh_repr, require_mesh, same_mesh
from .._report import format_bytes, Report, text_table
from .._spectree._spec_args import resolve_specs
from .._spectree._specs import (
    check_leaf,
    entry_axes,
    leaf_specs,
    ShardingProblem,
    spec_error_message,
)
from .._tree import is_array, path_str, placed_dtype
from .._typing import (
    check_choice,
    KeyPath,
    ON_INVALID,
    OnInvalid,
    PyTreeDef,
    typecheck,
    warn,
)


# ---------------------------------------------------------------------------------
# Reading shardings.
# ---------------------------------------------------------------------------------


def _traced_error(caller: str, path: KeyPath) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: the leaf at '{path_str(path)}' is traced inside `jax.jit`, "
        "where shardings are decided by the compiler and arrays have none to read. "
        "Call it outside `jit` (e.g. on the result of `eqx.filter_eval_shape`), or "
        "use `jax.typeof(x).sharding` for the type-level sharding."
    )


def is_single_device(sharding: Any) -> bool:
    """Whether `sharding` puts its array on one device, outside any mesh."""
    return isinstance(sharding, SingleDeviceSharding)


def _array_shardings(tree: PyTree, caller: str) -> tuple[list[Any], PyTreeDef]:
    """For each leaf of `tree`: `None` if it is not an array, else its sharding
    (`None` for NumPy arrays and for structs without one)."""
    path_leaves, treedef = jtu.tree_flatten_with_path(tree)
    out: list[Any] = []
    for path, leaf in path_leaves:
        if isinstance(leaf, Tracer):
            raise _traced_error(caller, path)
        if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            out.append((leaf.sharding, path))
        elif is_array(leaf):
            out.append((None, path))
        else:
            out.append(None)
    return out, treedef


@typecheck
def get_partition_spec(tree: PyTree) -> PyTree:
    """The spec tree of a pytree: the `PartitionSpec` each array is sharded with.

    The result is a spec tree for `tree` (see [`eqshard.shard`][]): an array with a
    `NamedSharding` (a `jax.Array`, or a `jax.ShapeDtypeStruct` that carries one)
    gives its spec; a NumPy array, a struct without a sharding, or an array
    replicated by another kind of sharding gives `P()`. A `jax.Array` on a single
    device (a `SingleDeviceSharding`, as `jnp.zeros` makes) gives `None`: it is on
    no mesh, and JAX calling it "fully replicated" would hide a tree wrongly left
    on device 0. Leaves that are not arrays give `None`, Python scalars included
    (they are not arrays, as in Equinox; eformer gives them `P()`). So
    `eqshard.shard(other, eqshard.get_partition_spec(tree), mesh)` lays `other` out
    as `tree` is, and leaves where they are the leaves `tree` has on one device.
    [`eqshard.check_layout`][] checks a whole tree against the specs asked for.
    A spec says nothing of the memory an array is in (e.g. `"pinned_host"`, for
    host offload): [`eqshard.compat.extract_sharding_structure`][] and
    [`eqshard.extract_shardings`][] give whole `NamedSharding`s, memory kind
    included, and the rows of [`eqshard.analyze_sharding_strategy`][] name it.

    **Arguments:**

    - `tree`: any pytree.

    **Returns:**

    A pytree of the structure of `tree` holding `PartitionSpec`s and `None`s.

    **Raises:**

    A `TypeError` naming the path of an array that is partitioned by a sharding
    other than a `NamedSharding` (such as a `PmapSharding`), or that is traced
    inside `jax.jit`.

    !!! Example

        ```python
        x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("dp")))
        eqshard.get_partition_spec({"x": x, "y": np.ones(3), "z": jnp.ones(2), "n": 3})
        # {"x": P('dp',), "y": P(), "z": None (one device), "n": None}
        ```
    """
    found, treedef = _array_shardings(tree, "get_partition_spec")
    out = []
    for entry in found:
        if entry is None:
            out.append(None)
            continue
        sharding, path = entry
        if isinstance(sharding, NamedSharding):
            out.append(sharding.spec)
        elif is_single_device(sharding):
            out.append(None)
        elif sharding is None or sharding.is_fully_replicated:
            out.append(PartitionSpec())
        else:
            raise TypeError(
                f"eqshard.get_partition_spec: the array at '{path_str(path)}' is "
                f"partitioned by a {type(sharding).__name__}, which no PartitionSpec "
                "describes. Lay it out with a `NamedSharding` first, e.g. "
                "`eqshard.shard(tree, specs, mesh)`."
            )
    return jtu.tree_unflatten(treedef, out)


@typecheck
def extract_sharding_structure(tree: PyTree) -> PyTree:
    """The tree of `NamedSharding`s the arrays of a pytree have.

    Each array with a `NamedSharding` (a `jax.Array`, or a `jax.ShapeDtypeStruct`
    that carries one, possibly on an `AbstractMesh`) gives it; every other leaf
    gives `None`: arrays on a single device or with another kind of sharding, NumPy
    arrays, structs without a sharding, and leaves that are not arrays. Nothing is
    built and no mesh is needed; see [`eqshard.extract_shardings`][] for shardings
    bound to a concrete mesh, and [`eqshard.get_partition_spec`][] for specs.

    **Arguments:**

    - `tree`: any pytree.

    **Returns:**

    A pytree of the structure of `tree` holding `NamedSharding`s and `None`s.

    **Raises:**

    A `TypeError` naming the path of an array traced inside `jax.jit`.

    !!! Example

        ```python
        x = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("dp")))
        eqshard.compat.extract_sharding_structure({"x": x, "y": jnp.zeros(3)})
        # {"x": NamedSharding(mesh, P('dp',)), "y": None}
        ```
    """
    found, treedef = _array_shardings(tree, "compat.extract_sharding_structure")
    out = [
        entry[0] if entry is not None and isinstance(entry[0], NamedSharding) else None
        for entry in found
    ]
    return jtu.tree_unflatten(treedef, out)


@typecheck
def extract_shardings(tree: PyTree, mesh: Mesh | None = None) -> PyTree:
    """The tree of concrete `NamedSharding`s of a pytree, ready for `jax.jit` or
    `jax.device_put`.

    As [`eqshard.compat.extract_sharding_structure`][], except that a sharding on an
    `AbstractMesh` (as `jax.eval_shape` gives under a mesh of `Explicit` axes) is
    bound to the devices of `mesh`: it becomes `NamedSharding(mesh, spec)`. Leaves
    without a `NamedSharding` give `None`, which `jax.jit` reads as "unspecified".

    **Arguments:**

    - `tree`: any pytree, e.g. the result of `eqx.filter_eval_shape`.
    - `mesh`: the mesh to bind abstract shardings to; defaults to the mesh set by
      `jax.set_mesh`. Only needed if `tree` has abstract shardings.

    **Returns:**

    A pytree of the structure of `tree` holding `NamedSharding`s on concrete meshes
    and `None`s.

    **Raises:**

    - `ValueError` naming the path of an abstract sharding when no concrete mesh is
      given or set, or when its mesh axes (names and sizes) differ from `mesh`'s.
    - `TypeError` naming the path of an array traced inside `jax.jit`.

    !!! Example

        ```python
        with jax.set_mesh(mesh):  # a mesh of Explicit axes
            shapes = eqx.filter_eval_shape(init_state, key)
            shardings = eqshard.extract_shardings(shapes)
        state = jax.jit(init_state, out_shardings=shardings)(key)
        ```
    """
    found, treedef = _array_shardings(tree, "extract_shardings")
    out = []
    for entry in found:
        if entry is None or not isinstance(entry[0], NamedSharding):
            out.append(None)
            continue
        sharding, path = entry
        if isinstance(sharding.mesh, AbstractMesh):
            sharding = _bind(sharding, mesh, path)
        out.append(sharding)
    return jtu.tree_unflatten(treedef, out)


def _bind(sharding: NamedSharding, mesh: Mesh | None, path: KeyPath) -> NamedSharding:
    where = f"the sharding at '{path_str(path)}' is on an abstract mesh {sharding.mesh}"
    found = find_mesh(mesh)
    if not isinstance(found, Mesh):
        raise ValueError(
            f"eqshard.extract_shardings: {where}, and binding it to devices needs "
            "a concrete mesh, but none is given or set. Pass `mesh=...`, or call "
            "it under `with jax.set_mesh(mesh):` outside `jax.jit`."
        )
    # An abstract mesh is the same as a concrete one of the same axes.
    if not same_mesh(sharding.mesh, found):
        raise ValueError(
            f"eqshard.extract_shardings: {where}, whose axes differ from those of the "
            f"mesh {mesh_repr(found)}. Pass the mesh the tree was planned for."
        )
    mesh = found
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


# ---------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingRow:
    """One array of a pytree in a [`eqshard.ShardingReport`][].

    **Fields:**

    - `path`: the leaf's path, such as `"layers/3/attn/q/weight"`.
    - `shape`, `dtype`: the array's shape and dtype name.
    - `spec`: the spec asked for (a `NamedSharding`'s spec), or `None` if the
      array is not placed on the mesh.
    - `nbytes`: the bytes of the whole array.
    - `bytes_per_device`: the bytes of the piece each device holding the array has
      (0 if it is not placed).
    - `num_shards`: into how many distinct pieces the array is split.
    - `num_devices`: how many devices hold a piece.
    - `valid`: whether `spec` can apply; if not, the row describes the nearest spec
      that can (see `ShardingReport.problems`).
    - `single_device`: whether the array is on one device outside any mesh (read
      from the array itself, with `specs=None`); its `spec` is then `None`, and its
      bytes count on that device only.
    - `memory_kind`: the memory the array is placed in when its sharding names one
      (e.g. `"pinned_host"` for host offload, `"device"`); `None` for a
      `PartitionSpec`, which places it in the device's default memory. Its bytes
      count in `bytes_per_device` whatever the memory kind.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec | None
    nbytes: int
    bytes_per_device: int
    num_shards: int
    num_devices: int
    valid: bool = True
    single_device: bool = False
    memory_kind: str | None = None

    @property
    def size(self) -> int:
        """The number of elements (parameters) of the array."""
        return math.prod(self.shape)

    @property
    def placed(self) -> bool:
        """Whether the array has a spec, and so is placed on the mesh."""
        return self.spec is not None

    @property
    def sharded(self) -> bool:
        """Whether the array is split into more than one piece."""
        return self.num_shards > 1

    @property
    def replicated(self) -> bool:
        """Whether the array is placed whole on every device of its mesh."""
        return self.placed and self.num_shards == 1


def _flag(row: ShardingRow) -> str:
    if not row.valid:
        return "invalid"
    if row.single_device:
        return "single device"
    if not row.placed:
        return "unplaced"
    flags = ["replicated"] if row.replicated else []
    if row.memory_kind not in (None, "device"):
        flags.append(row.memory_kind)
    return ", ".join(flags)


_HEADERS = ("path", "shape", "dtype", "spec", "size", "per device", "")


def _row_cells(row: ShardingRow) -> tuple[str, ...]:
    shape = "(" + ", ".join(map(str, row.shape)) + ("," if len(row.shape) == 1 else "")
    return (
        row.path,
        shape + ")",
        row.dtype,
        "-" if row.spec is None else str(row.spec),
        format_bytes(row.nbytes),
        format_bytes(row.bytes_per_device),
        _flag(row),
    )


_RIGHT = (False, False, False, False, True, True, False)


@dataclasses.dataclass(frozen=True, repr=False)
class ShardingReport(Report):
    """What a sharding plan puts on each device: made by
    [`eqshard.analyze_sharding_strategy`][].

    `str(report)` (or `report.table()`) is a text table with one line per array and
    a totals line; `report.show()` prints it as a coloured `rich` table when
    `rich` is installed; `report.to_json()` is a byte-stable `str`. For a bar
    per device, and the gradients and optimizer state of training, see
    [`eqshard.plan_training`][] (`gradients=False` and no optimizer plans the
    arrays alone).

    **Fields:**

    - `mesh`: the mesh analysed.
    - `rows`: one [`eqshard.ShardingRow`][] per array, in the order of
      `jax.tree_util.tree_leaves`.
    - `problems`: one [`eqshard.ShardingProblem`][] per array whose spec cannot
      apply (which [`eqshard.shard`][] would reject).
    - `bytes_per_device`: the bytes each device holds, one entry per device in
      `mesh.devices.flat` order (mesh coordinate order for an `AbstractMesh`).
    - `total_parameters`: the elements of all arrays, each counted once.
    - `sharded_parameters`: the elements of the arrays split into several pieces.
    - `total_bytes`: the bytes of all arrays, each counted once.
    - `replicated_bytes`: the bytes of the placed arrays that are not split, which
      every device of their mesh holds in full.
    - `unplaced_bytes`: the bytes of the arrays whose spec is `None`, counted on no
      device.
    - `single_device_bytes`: the bytes of the arrays on one device outside any
      mesh (only when the shardings are read from the arrays, `specs=None`),
      counted on that device.
    """

    mesh: Mesh | AbstractMesh
    rows: tuple[ShardingRow, ...]
    problems: tuple[ShardingProblem, ...]
    bytes_per_device: tuple[int, ...]
    total_parameters: int
    sharded_parameters: int
    total_bytes: int
    replicated_bytes: int
    unplaced_bytes: int
    single_device_bytes: int = 0

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's axis names and sizes."""
        return dict(self.mesh.shape)

    @property
    def max_bytes_per_device(self) -> int:
        """The most bytes any device holds."""
        return max(self.bytes_per_device)

    @property
    def min_bytes_per_device(self) -> int:
        """The fewest bytes any device holds."""
        return min(self.bytes_per_device)

    @property
    def balance_score(self) -> float:
        """`min_bytes_per_device / max_bytes_per_device`: 1.0 when every device holds
        as much (or nothing is placed)."""
        top = self.max_bytes_per_device
        return 1.0 if top == 0 else self.min_bytes_per_device / top

    def largest_replicated(self, n: int = 5) -> tuple[ShardingRow, ...]:
        """The `n` largest arrays placed whole on every device, largest first: the
        first places to look when a plan does not fit."""
        if n < 0:
            raise ValueError(
                f"ShardingReport.largest_replicated: `n` must be at least 0; got {n}."
            )
        replicated = [row for row in self.rows if row.replicated]
        return tuple(sorted(replicated, key=lambda row: -row.nbytes)[:n])

    def insufficiently_sharded(self, min_bytes: int = 2**20) -> tuple[ShardingRow, ...]:
        """The arrays of at least `min_bytes` bytes that are not split (replicated, or
        not placed), in tree order."""
        return tuple(
            row for row in self.rows if row.nbytes >= min_bytes and not row.sharded
        )

    def is_sufficiently_sharded(self, min_bytes: int = 2**20) -> bool:
        """Whether every array of at least `min_bytes` bytes (1 MiB by default) is
        split over some mesh axis, as MaxText checks before training."""
        return not self.insufficiently_sharded(min_bytes)

    def _totals(self) -> str:
        return (
            f"total: {len(self.rows)} arrays, {self.total_parameters:,} parameters "
            f"({self.sharded_parameters:,} sharded), {format_bytes(self.total_bytes)}; "
            f"per device: max {format_bytes(self.max_bytes_per_device)}, min "
            f"{format_bytes(self.min_bytes_per_device)} (balance "
            f"{self.balance_score:.2f}) over {len(self.bytes_per_device)} devices "
            f"{self.mesh_shape}; replicated {format_bytes(self.replicated_bytes)}"
            + (
                f", unplaced {format_bytes(self.unplaced_bytes)}"
                if self.unplaced_bytes
                else ""
            )
            + (
                f", on a single device {format_bytes(self.single_device_bytes)}"
                if self.single_device_bytes
                else ""
            )
        )

    def table(self) -> str:
        """The report as an aligned text table, with a totals line and the problems
        below it."""
        rows = [_row_cells(row) for row in self.rows]
        lines = text_table(_HEADERS, rows, _RIGHT)
        lines.insert(1, "-" * len(lines[0]))
        lines.append(self._totals())
        if self.problems:
            lines.append(
                spec_error_message(
                    "analyze_sharding_strategy",
                    self.problems,
                    corrected=True,
                )
            )
        return "\n".join(lines)

    def _summary(self) -> dict[str, Any]:
        return {
            "arrays": len(self.rows),
            "total_parameters": self.total_parameters,
            "max_bytes_per_device": self.max_bytes_per_device,
            "balance_score": f"{self.balance_score:.3f}",
            "problems": len(self.problems),
            "mesh": self.mesh_shape,
        }

    def _rich(self) -> list[Any]:
        """A `rich` table, coloured: invalid arrays red, replicated ones yellow;
        then the problems."""
        from rich.table import Table
        from rich.text import Text

        table = Table(title="eqshard sharding plan", caption=self._totals())
        for header, right in zip(_HEADERS, _RIGHT, strict=True):
            table.add_column(header, justify="right" if right else "left")
        styles = {
            "invalid": "red",
            "replicated": "yellow",
            "unplaced": "dim",
            "single device": "red",
        }
        for row in self.rows:
            table.add_row(*_row_cells(row), style=styles.get(_flag(row)))
        if not self.problems:
            return [table]
        message = spec_error_message(
            "analyze_sharding_strategy", self.problems, corrected=True
        )
        return [table, Text(message, style="red")]

    def rich_table(self) -> Any:
        """Deprecated: `report.show()` prints the report with `rich` (this method
        goes in eqshard 0.3)."""
        renamed_attribute("ShardingReport", "rich_table()", "show()")
        return self._rich()[0]


# ---------------------------------------------------------------------------------
# Analysis.
# ---------------------------------------------------------------------------------


def _other_mesh_error(
    path: KeyPath, leaf_mesh: Mesh | AbstractMesh, mesh: Mesh | AbstractMesh
) -> ValueError:
    return ValueError(
        f"eqshard.analyze_sharding_strategy: the NamedSharding at '{path_str(path)}' "
        f"is on mesh {mesh_repr(leaf_mesh)}, which is neither the analysed mesh "
        f"{mesh_repr(mesh)} nor made of its devices. A report counts the bytes of "
        "one mesh's devices: use `PartitionSpec`s, or shardings on (a part of) that "
        "mesh."
    )


def _device_rows(
    leaf_mesh: Mesh | AbstractMesh,
    mesh: Mesh | AbstractMesh,
    index: dict[int, int] | None,
    path: KeyPath,
) -> slice | list[int]:
    """The positions, in `mesh.devices.flat` order, of the devices of `leaf_mesh`
    (an abstract mesh's devices are its mesh coordinates)."""
    if same_mesh(leaf_mesh, mesh):
        return slice(None)
    if isinstance(leaf_mesh, Mesh) and index is not None:
        try:
            return [index[device.id] for device in leaf_mesh.devices.flat]
        except KeyError:
            raise _other_mesh_error(path, leaf_mesh, mesh) from None
    raise _other_mesh_error(path, leaf_mesh, mesh)


@renamed_literals("analyze_sharding_strategy", "on_invalid", report="ignore")
@typecheck
def analyze_sharding_strategy(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    on_invalid: OnInvalid = "ignore",
) -> ShardingReport:
    """Works out what a sharding plan puts on each device, without moving anything.

    For each array of `tree` (`jax.Array`, NumPy, or `jax.ShapeDtypeStruct`: only
    `.shape` and `.dtype` are read, so `eqx.filter_eval_shape` trees of any size
    work), every device holding it holds the piece its mesh coordinates select:
    each dimension divided by the sizes of its spec entry's mesh axes, replicated
    over the mesh axes the spec does not name. A replicated array counts in full on
    every device. Python scalars and other non-array leaves hold no device memory
    and are left out; arrays whose spec is `None` are listed but placed nowhere
    (as [`eqshard.shard`][] leaves them where they are). Placed NumPy arrays count
    in the dtype `shard` places them in: 32-bit for 64-bit data while
    `jax_enable_x64` is off.

    A spec that cannot apply (an unknown mesh axis, an axis used twice, more
    entries than the array's rank, a dimension its axes do not divide) is a
    planning finding, not a crash: by default it is listed in `report.problems`
    and the array is counted with the nearest spec that applies (the one
    [`eqshard.with_sharding_constraint`][] would use); `on_invalid="warn"` also
    warns, and `on_invalid="raise"` raises as [`eqshard.shard`][] would.

    **Arguments:**

    - `tree`: any pytree; concrete or abstract.
    - `specs`: a spec tree for `tree` or a prefix of one, partition rules, or a
      function of the abstract tree, as for [`eqshard.shard`][] (see
      [the spec-tree family](specs.md)). `NamedSharding`s may be on the analysed
      mesh or on a part of its devices (e.g. one pipeline stage). `None` (the
      whole argument) reads the shardings the arrays have: an array on a single
      device counts on that device and is flagged `single device`; NumPy arrays
      are unplaced.
    - `mesh`: a `Mesh`, or an `AbstractMesh` to plan for devices you do not have
      (`jax.sharding.AbstractMesh((16, 16), ("dp", "tp"))`). Defaults to the mesh set
      by `jax.set_mesh`, then to the mesh of the `NamedSharding`s in `specs`.
    - `on_invalid`: `"ignore"` (the default) reports specs that cannot apply,
      `"warn"` reports them and warns, `"raise"` raises.

    **Returns:**

    An immutable [`eqshard.ShardingReport`][].

    **Raises:**

    - `ValueError` if `specs` is not a prefix of `tree` (naming the first path that
      differs), if there is no mesh, if a `NamedSharding` holds devices outside the
      mesh (naming its path), or, with `on_invalid="raise"`, naming every array
      whose spec cannot apply.
    - `TypeError` naming the path of a leaf of `specs` that is not a spec.

    !!! Example

        ```python
        shapes = eqx.filter_eval_shape(make_model, jax.random.key(0))
        specs = eqshard.match_partition_rules(rules, shapes)
        report = eqshard.analyze_sharding_strategy(shapes, specs, mesh)
        print(report)  # one line per array, then the totals
        report.max_bytes_per_device, report.largest_replicated(3)
        ```
    """
    caller = "analyze_sharding_strategy"
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    specs = resolve_specs(specs, tree, caller=caller, mesh=mesh)
    if specs is None:
        pairs = own_shardings(tree, caller)
    else:
        pairs = leaf_specs(specs, tree, caller=caller)
    return analyze_pairs(
        jtu.tree_leaves(tree), pairs, mesh, caller=caller, on_invalid=on_invalid
    )


def own_shardings(tree: PyTree, caller: str) -> list[tuple[KeyPath, Any]]:
    """One `(path, sharding)` pair per leaf of `tree`, read from the arrays: their
    `NamedSharding`, their `SingleDeviceSharding`, or `None` (NumPy arrays,
    structs without a sharding, and leaves that are not arrays)."""
    found, _ = _array_shardings(tree, caller)
    pairs: list[tuple[KeyPath, Any]] = []
    for (path, _), entry in zip(
        jtu.tree_flatten_with_path(tree)[0], found, strict=True
    ):
        sharding = None if entry is None else entry[0]
        if not isinstance(sharding, NamedSharding) and not is_single_device(sharding):
            sharding = None
        pairs.append((path, sharding))
    return pairs


def analyze_pairs(
    leaves: Sequence[Any],
    pairs: Sequence[tuple[KeyPath, Any]],
    mesh: Mesh | AbstractMesh | None,
    *,
    caller: str,
    on_invalid: str = "ignore",
) -> ShardingReport:
    """The report for `leaves`, with one `(path, spec)` pair each: a
    `PartitionSpec`, a `NamedSharding`, a `SingleDeviceSharding` or `None`."""
    mesh = require_mesh(mesh, caller=caller, shardings=(s for _, s in pairs))
    index = (
        {device.id: i for i, device in enumerate(mesh.devices.flat)}
        if isinstance(mesh, Mesh)
        else None
    )
    per_device = np.zeros(math.prod(mesh.axis_sizes), dtype=np.int64)
    every = 0  # bytes on every device of `mesh`, added to `per_device` at the end
    rows: list[ShardingRow] = []
    problems: list[ShardingProblem] = []
    dtypes: dict[Any, tuple[int, str]] = {}  # dtype -> (itemsize, name)
    # (spec, shape) -> what a spec that applies places: (spec, the devices, the
    # elements of each piece, shards, devices holding one). Trees repeat a few
    # shapes under a few specs many times over (layers, gradients, moments).
    placed: dict[Any, tuple[Any, slice | list[int], int, int, int]] = {}
    for (path, spec), leaf in zip(pairs, leaves, strict=True):
        if not is_array(leaf):
            continue
        shape = tuple(map(int, leaf.shape))
        # NumPy data placed counts as `shard` places it (32-bit without x64).
        dtype = (
            placed_dtype(leaf.dtype)
            if spec is not None and isinstance(leaf, np.ndarray | np.generic)
            else leaf.dtype
        )
        known = dtypes.get(dtype)
        if known is None:
            known = dtypes[dtype] = (int(dtype.itemsize), str(dtype))
        itemsize, dtype_name = known
        nbytes = math.prod(shape) * itemsize
        name = path_str(path)
        if spec is None:
            rows.append(ShardingRow(name, shape, dtype_name, None, nbytes, 0, 1, 0))
            continue
        if is_single_device(spec):
            (device,) = spec.device_set
            if index is not None and device.id in index:
                per_device[index[device.id]] += nbytes
            rows.append(
                ShardingRow(
                    name,
                    shape,
                    dtype_name,
                    None,
                    nbytes,
                    nbytes,
                    1,
                    1,
                    single_device=True,
                )
            )
            continue
        memory_kind = spec.memory_kind if isinstance(spec, NamedSharding) else None
        found = placed.get((spec, shape))
        problem = None
        if found is None:
            if isinstance(spec, NamedSharding):
                devices = _device_rows(spec.mesh, mesh, index, path)
            else:
                devices = slice(None)
            asked, leaf_mesh, fixed, problem = check_leaf(path, spec, leaf, mesh)
            sizes = dict(leaf_mesh.shape)
            # `fixed` divides every dimension evenly: every device holds as much.
            splits = [math.prod(sizes[a] for a in entry_axes(e)) for e in fixed]
            piece = math.prod(
                n // (splits[d] if d < len(splits) else 1) for d, n in enumerate(shape)
            )
            found = (
                asked,
                devices,
                piece,
                math.prod(splits),
                math.prod(leaf_mesh.axis_sizes),
            )
            if problem is None:
                placed[(spec, shape)] = found
            else:
                problems.append(problem)
        asked, devices, piece, shards, holders = found
        if isinstance(devices, slice):
            every += piece * itemsize
        else:
            per_device[devices] += piece * itemsize
        rows.append(
            ShardingRow(
                name,
                shape,
                dtype_name,
                asked,
                nbytes,
                piece * itemsize,
                shards,
                holders,
                problem is None,
                memory_kind=memory_kind,
            )
        )
    per_device += every
    if problems and on_invalid == "raise":
        raise ValueError(spec_error_message(caller, problems))
    if problems and on_invalid == "warn":
        warn(spec_error_message(caller, problems, corrected=True))
    return ShardingReport(
        mesh=mesh,
        rows=tuple(rows),
        problems=tuple(problems),
        bytes_per_device=tuple(per_device.tolist()),
        total_parameters=sum(row.size for row in rows),
        sharded_parameters=sum(row.size for row in rows if row.sharded),
        total_bytes=sum(row.nbytes for row in rows),
        replicated_bytes=sum(row.nbytes for row in rows if row.replicated),
        unplaced_bytes=sum(
            row.nbytes for row in rows if not row.placed and not row.single_device
        ),
        single_device_bytes=sum(row.nbytes for row in rows if row.single_device),
    )
