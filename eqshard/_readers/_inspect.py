"""Reading the shardings of a pytree, and the report of what each device holds.

The readers (`get_partition_spec`, `extract_sharding_structure`,
`extract_shardings`, `own_shardings`) turn the arrays of a tree into its spec
tree or sharding tree. `ShardingReport` (one `ShardingRow` per array) is what
`analyze_sharding_strategy` (`_strategy.py`) works out from shapes and specs.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import (
    AbstractMesh,
    Mesh,
    NamedSharding,
    PartitionSpec,
    SingleDeviceSharding,
)
from jaxtyping import PyTree

from .._deprecated import renamed_attribute
from .._mesh._current import find_mesh, mesh_repr, same_mesh
from .._report import format_bytes, Report, text_table
from .._spectree._check_spec import (
    ShardingProblem,
    spec_error_message,
)
from .._tree import is_array, path_str
from .._typing import (
    KeyPath,
    PyTreeDef,
    typecheck,
)
from ._group import group_rows


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
      (0 if it is not placed); on a TPU target's mesh, as laid out in the TPU's
      tiles (a (64, 32) float32 piece takes (64, 128)'s bytes).
    - `num_shards`: into how many distinct pieces the array is split.
    - `num_devices`: how many devices hold a piece.
    - `valid`: whether `spec` can apply; if not, the row describes the nearest spec
      that can (see `ShardingReport.problems`).
    - `single_device`: whether the array is on one device outside any mesh (read
      from the array itself, with `specs=None`); its `spec` is then `None`, and its
      bytes count on that device only.
    - `memory_kind`: the memory the array is placed in when its sharding names one
      (e.g. `"pinned_host"` for host offload, as [`eqshard.host`][] asks,
      `"device"`); `None` for a `PartitionSpec`, which places it in the
      device's default memory. Its bytes
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
# A row may stand for N arrays alike ("xN"): its sizes are each array's.
_GROUPED_HEADERS = ("path (xN: N arrays alike)", "shape", "dtype", "spec",
                    "size each", "per device each", "")  # fmt: skip


@dataclasses.dataclass(frozen=True, repr=False)
class ShardingReport(Report):
    """What a sharding plan puts on each device: made by
    [`eqshard.analyze_sharding_strategy`][].

    `str(report)` (or `report.table()`) is a text table with a line per array, the
    arrays of repeated layers laid out alike sharing one (`blocks/*/attn/q/weight
    x80`; `report.table(group=False)` lists every array), and a totals line;
    `report.show()` prints it as a coloured `rich` table when `rich` is installed;
    `report.to_json()` is a byte-stable `str`. For a bar per device, and the
    gradients and optimizer state of training, see
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

    def _cells(self, group: bool) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """The headers and rows of the table, grouped or one per array."""
        cells = [_row_cells(row) for row in self.rows]
        if not group:
            return _HEADERS, cells
        groups = group_rows([c[0] for c in cells], [c[1:] for c in cells])
        if len(groups) == len(cells):
            return _HEADERS, cells
        rows = []
        for label, members in groups:
            count = f"  x{len(members)}" if len(members) > 1 else ""
            rows.append((label + count, *cells[members[0]][1:]))
        return _GROUPED_HEADERS, rows

    def table(self, *, group: bool = True) -> str:
        """The report as an aligned text table, with a totals line and the problems
        below it. With `group` (the default), the arrays of repeated layers that are
        laid out alike share a row, `blocks/*/attn/q/weight x80` (sizes are each
        array's); `group=False` lists every array."""
        headers, rows = self._cells(group)
        lines = text_table(headers, rows, _RIGHT)
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
        headers, rows = self._cells(group=True)
        for header, right in zip(headers, _RIGHT, strict=True):
            table.add_column(header, justify="right" if right else "left")
        styles = {
            "invalid": "red",
            "replicated": "yellow",
            "unplaced": "dim",
            "single device": "red",
        }
        for cells in rows:  # the flag is the last cell
            table.add_row(*cells, style=styles.get(cells[-1]))
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
