"""A step's arguments as [`eqshard.analyze_step`][] sees them (`_step.py`).

The arguments are flattened; their arrays (concrete or abstract) become
`ShapeDtypeStruct`s with the sharding the call would use (a committed array's
own, none for NumPy and uncommitted arrays), named by path (`params/b0/w1`: the
signature's parameter name, else the position). Nothing is allocated. The
errors a call with them would raise (arguments on an `AbstractMesh`, committed
to different devices, or placed against `fn`'s `in_shardings`) are raised here,
naming the paths.
"""

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

import jax
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, NamedSharding, Sharding

from .._mesh._current import current_mesh, mesh_repr, same_mesh
from .._mesh._targets import is_compile_only
from .._tree import is_array, path_name


CALLER = "analyze_step"

Kind: TypeAlias = Literal["abstract", "committed", "uncommitted", "host"]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An array argument as the call sees it."""

    path: str
    struct: jax.ShapeDtypeStruct  # with the sharding the call uses, if any
    sharding: Sharding | None  # that sharding (`None`: the program chooses)
    kind: Kind
    have: Sharding | None  # where an uncommitted array is

    def key(self) -> tuple[Any, ...]:
        """What the program compiled for this leaf depends on."""
        struct = self.struct
        return (
            struct.shape,
            struct.dtype,
            struct.weak_type,
            self.sharding,
            self.kind,
            self.have,
        )


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The flattened `(args, kwargs)` of a call: `leaves` all of them (arrays
    and the rest), `arrays` the one `Leaf` of each array, at `positions` in
    `leaves`."""

    treedef: Any
    leaves: list[Any]
    positions: list[int]
    arrays: list[Leaf]

    @property
    def paths(self) -> list[str]:
        return [leaf.path for leaf in self.arrays]

    def call(self, arrays: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """`(args, kwargs)` with `arrays` in place of the array leaves."""
        full = list(self.leaves)
        for i, array in zip(self.positions, arrays, strict=True):
            full[i] = array
        return jtu.tree_unflatten(self.treedef, full)

    def key(self) -> Any:
        """The signature of the call (a step's report depends on nothing else),
        or `None` when it is not hashable."""
        arrays = set(self.positions)
        statics = tuple(
            (type(leaf), leaf) for i, leaf in enumerate(self.leaves) if i not in arrays
        )
        key = (
            self.treedef,
            tuple(leaf.key() for leaf in self.arrays),
            statics,
            jax.sharding.get_abstract_mesh(),
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key


def arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Arguments:
    """The call's arguments flattened, its arrays named and seen as the call
    sees them."""
    names = _names(fn, args, kwargs)
    path_leaves, treedef = jtu.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in path_leaves]
    positions = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    arrays = [_leaf(leaves[i], _leaf_path(path_leaves[i][0], names)) for i in positions]
    error = _devices_error(arrays)
    if error is not None:
        raise error
    return Arguments(treedef, leaves, positions, arrays)


def _names(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str]:
    """The name of each positional argument: its parameter's name in `fn`'s
    signature, else its position."""
    names = [str(i) for i in range(len(args))]
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return names
    position = 0
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            position += len(value)
        elif kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            if position < len(args):
                names[position] = name
                position += 1
    return names


def _leaf_path(path: tuple[Any, ...], names: list[str]) -> str:
    """`(args, kwargs)` key path -> `params/b0/w1`."""
    top, key, rest = path[0], path[1], path[2:]
    head = names[key.idx] if top.idx == 0 else str(key.key)
    return "/".join((head, path_name(rest, "/"))) if rest else head


def _leaf(leaf: Any, path: str) -> Leaf:
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    weak = bool(getattr(leaf, "weak_type", False))
    have = None
    kind: Kind
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding, kind = leaf.sharding, "abstract"
    elif isinstance(leaf, jax.Array):
        kind = "committed" if leaf.committed else "uncommitted"
        sharding = leaf.sharding if leaf.committed else None
        have = None if leaf.committed else leaf.sharding
    else:
        sharding, kind = None, "host"
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        raise abstract_mesh_error(path, sharding.mesh)
    if not isinstance(sharding, Sharding):
        sharding = None  # none, or a `ShapeDtypeStruct` with a layout only
    struct = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding, weak_type=weak)
    return Leaf(path, struct, sharding, kind, have)


def on_devices(
    arrays: Sequence[Leaf], shardings: Sequence[Sharding | None]
) -> list[Sharding | None]:
    """`shardings` on devices: a step's `jit` made without a mesh (a
    `filter_jit` object traced with the mesh set) has them on the abstract mesh,
    which the arguments' concrete mesh of the same axes (else the one set by
    `jax.set_mesh`) replaces; one without such a mesh is left abstract."""
    meshes = [
        leaf.sharding.mesh
        for leaf in arrays
        if isinstance(leaf.sharding, NamedSharding)
        and isinstance(leaf.sharding.mesh, Mesh)
    ]
    found = current_mesh()
    meshes += [found] if isinstance(found, Mesh) else []
    out: list[Sharding | None] = []
    for want in shardings:
        if isinstance(want, NamedSharding) and isinstance(want.mesh, AbstractMesh):
            mesh = next((m for m in meshes if same_mesh(m, want.mesh)), None)
            if mesh is not None:
                want = NamedSharding(mesh, want.spec, memory_kind=want.memory_kind)
        out.append(want)
    return out


def placed_as_asked(
    arrays: Sequence[Leaf], in_shardings: Sequence[Sharding | None]
) -> list[jax.ShapeDtypeStruct]:
    """The parameters of a program with these `in_shardings` (`None`: the
    leaf's own); raises if a committed leaf is placed against them."""
    structs = []
    problems = []
    for leaf, want in zip(arrays, on_devices(arrays, in_shardings), strict=True):
        struct = leaf.struct
        if want is not None:
            if isinstance(want, NamedSharding) and isinstance(want.mesh, AbstractMesh):
                raise abstract_mesh_error(leaf.path, want.mesh)
            if leaf.sharding is not None and not leaf.sharding.is_equivalent_to(
                want, len(struct.shape)
            ):
                problems.append(_misplaced(leaf, want))
            struct = jax.ShapeDtypeStruct(
                struct.shape, struct.dtype, sharding=want, weak_type=struct.weak_type
            )
        structs.append(struct)
    if problems:
        raise _placement_error(problems)
    return structs


def spec_text(sharding: Sharding | None) -> str:
    """A sharding as a user writes it: the `PartitionSpec` of a `NamedSharding`."""
    if sharding is None:
        return "unplaced"
    if isinstance(sharding, NamedSharding):
        return str(sharding.spec)
    if len(sharding.device_set) == 1:
        return f"single device {next(iter(sharding.device_set))}"
    return str(sharding)


def abstract_mesh_error(path: str, mesh: AbstractMesh) -> ValueError:
    return ValueError(
        f"eqshard.{CALLER}: the argument at '{path}' is laid out on an "
        f"AbstractMesh {mesh_repr(mesh)}, which cannot be compiled: analyze_step "
        "compiles the step for real devices. Lay it out on a `jax.sharding.Mesh` of "
        "that shape; without the hardware, start JAX with as many virtual CPU "
        f"devices (`jax.config.update('jax_num_cpu_devices', {mesh.size})` before "
        "any JAX operation)."
    )


def _misplaced(leaf: Leaf, want: Sharding) -> str:
    """One line of `_placement_error`."""
    have = spec_text(leaf.sharding)
    return (
        f"  - '{leaf.path}': placed {have}, `in_shardings` asks for {spec_text(want)}"
    )


def _placement_error(lines: Sequence[str]) -> ValueError:
    return ValueError(
        f"eqshard.{CALLER}: `fn` takes these arguments with `in_shardings` they are "
        "not placed with, so calling it with them raises (jax.jit does not move "
        "committed arrays):\n" + "\n".join(lines) + "\nPlace them as `fn` asks "
        "(`eqshard.shard(tree, specs, mesh)`), or change its `in_shardings`."
    )


def _where(sharding: Sharding) -> str:
    """Where an argument is placed, for `_devices_error`: its mesh and devices."""
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    first = devices[0]
    kind = first.device_kind
    if first.platform.lower() not in kind.lower():
        kind = f"{first.platform.upper()} {kind}"
    if is_compile_only(first):
        kind += ", compile-only (a target's)"
    ids = [d.id for d in devices]
    if isinstance(sharding, NamedSharding):
        return f"the mesh {mesh_repr(sharding.mesh)} of {len(ids)} {kind} devices"
    return f"devices {ids} ({kind})"


def _devices_error(arrays: Sequence[Leaf]) -> ValueError | None:
    """The error for committed arguments on different sets of devices (JAX
    raises when the step is called with them), or `None`. Devices are told
    apart by platform too: a target's devices and this machine's share ids."""
    groups: dict[frozenset[tuple[str, int]], list[tuple[str, Sharding]]] = {}
    for leaf in arrays:
        if leaf.sharding is not None:
            key = frozenset((d.platform, d.id) for d in leaf.sharding.device_set)
            groups.setdefault(key, []).append((leaf.path, leaf.sharding))
    if len(groups) < 2:
        return None
    lines = []
    for found in sorted(groups.values(), key=len, reverse=True):
        paths = ", ".join(f"'{path}'" for path, _ in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        lines.append(f"  - {paths}{more}: on {_where(found[0][1])}")
    return ValueError(
        f"eqshard.{CALLER}: the arguments are on {len(groups)} different sets of "
        "devices, and one step compiles for one:\n" + "\n".join(lines) + "\nPlace "
        "every argument on the step's mesh (`eqshard.shard(x, spec, mesh)`, or "
        "`eqshard.abstract(x, spec, mesh)` for a target's mesh), or pass host "
        "data (NumPy), which the program places itself."
    )
