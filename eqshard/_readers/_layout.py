"""Checking that a pytree is laid out as asked.

`check_layout` compares the sharding every array has with the one its spec asks
for, and reports every array that differs, in a `LayoutReport`: placed with
another spec, on another mesh, on a single device (which JAX calls "fully
replicated", but which is not on the mesh at all), on the host as a NumPy array,
or in another memory kind (host against device memory), deleted (donated), or
asked for with a spec that cannot apply to it. Inside `jit` it reads a traced
array's layout from its type, which only Explicit mesh axes fill in. It moves
nothing and compiles nothing. By default a report with mismatches is raised as a
`LayoutError` (a `ValueError`) whose message shows the first rows and which
carries the report.
"""

import dataclasses
from typing import Any

import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._mesh._current import find_mesh, mesh_repr, same_mesh
from .._report import Report
from .._spectree._carried import explicit_axes, type_sharding
from .._spectree._check_spec import check_spec, entry_axes, leaf_specs
from .._spectree._memory import Host, memory_of
from .._spectree._resolve import resolve_specs
from .._tree import DELETED, grouped_paths, is_array, is_deleted, path_str
from .._typing import check_choice, ON_INVALID, OnInvalid, typecheck, warn


def _memory_kind(sharding: Any) -> str | None:
    try:
        return sharding.memory_kind
    except AttributeError:  # abstract shardings of some kinds have none
        return None


def _placement(
    spec: PartitionSpec,
    ndim: int,
    sizes: dict[str, int],
    typed: frozenset[str] | None = None,
) -> list[Any]:
    """The mesh axes splitting each dimension, ignoring axes of size 1 (and, if
    `typed` is given, the axes not in it): two specs with the same placement place
    an array the same way."""
    out: list[Any] = []
    for d in range(ndim):
        entry = spec[d] if d < len(spec) else None
        if entry is PartitionSpec.UNCONSTRAINED:
            out.append(entry)
        else:
            out.append(
                tuple(
                    a
                    for a in entry_axes(entry)
                    if sizes.get(a, 0) != 1 and (typed is None or a in typed)
                )
            )
    return out


def _typed_sharding(leaf: Tracer) -> tuple[NamedSharding, frozenset[str]] | None:
    """The sharding in a tracer's type and the mesh axes it speaks for (the
    Explicit ones), or `None` if its type carries no layout (Auto and Manual axes:
    it reads all-`None` whatever XLA will choose)."""
    sharding = type_sharding(leaf)
    if sharding is None or sharding.mesh.empty:
        return None
    typed = explicit_axes(sharding.mesh)
    return (sharding, typed) if typed else None


@dataclasses.dataclass(frozen=True)
class LayoutMismatch:
    """An array that is not laid out as asked, found by [`eqshard.check_layout`][].

    **Fields:**

    - `path`: the array's path in the tree.
    - `shape`: its shape.
    - `spec`, `mesh`, `memory_kind`: what was asked (`memory_kind` is `None` for
      the device's default memory).
    - `problem`: what the array is instead, or why the spec cannot apply.
    """

    path: str
    shape: tuple[int, ...]
    spec: PartitionSpec
    mesh: Mesh | AbstractMesh
    memory_kind: str | None
    problem: str

    def line(self, followers: str = "") -> str:
        """The mismatch as one line of the error message; `followers` names the
        arrays that follow it with the same mismatch (`" (+ mu, nu)"`)."""
        kind = self.memory_kind
        kind_note = f" in {kind!r} memory" if kind not in (None, "device") else ""
        return (
            f"  - '{self.path}'{followers} (shape {self.shape}): asked {self.spec} "
            f"on mesh {mesh_repr(self.mesh)}{kind_note}; {self.problem}."
        )

    def _key(self) -> tuple[Any, ...]:
        """What the line says besides the path: followers with the same key share
        their parameter's line."""
        return (
            self.shape,
            self.spec,
            mesh_repr(self.mesh),
            self.memory_kind,
            self.problem,
        )


# Mismatches shown in a message; the report has them all.
_SHOWN = 20


@dataclasses.dataclass(frozen=True, repr=False)
class LayoutReport(Report):
    """What [`eqshard.check_layout`][] found: `report.ok` when every array is
    laid out as asked.

    `str(report)` lists the mismatches (the first 20 lines; an optimizer
    state's arrays share their parameter's line, `'0/w' (+ mu, nu)`, where their
    mismatch is the same) with the fix,
    `report.show()` prints it with `rich` when installed, `report.to_json()` is a
    byte-stable `str`.

    **Fields:**

    - `checked`: how many arrays were checked (those with a spec).
    - `mismatches`: one [`eqshard.LayoutMismatch`][] per
      array laid out otherwise than asked, in tree order.
    """

    checked: int
    mismatches: tuple[LayoutMismatch, ...]

    @property
    def ok(self) -> bool:
        """Whether every array checked is laid out as asked."""
        return not self.mismatches

    def table(self) -> str:
        """The mismatches, one line each (the first 20), and how to fix them; or
        one line saying that all is as asked."""
        if self.ok:
            return f"{self.checked} arrays checked: all laid out as asked."
        return self._message("check_layout")

    def _message(self, caller: str) -> str:
        mismatches = self.mismatches
        count = (
            "1 array is" if len(mismatches) == 1 else f"{len(mismatches)} arrays are"
        )
        lines = [f"eqshard.{caller}: {count} not laid out as asked:"]
        # An optimizer state's arrays with their parameter's, where the same.
        paths = [mismatch.path for mismatch in mismatches]
        groups = grouped_paths(paths, [mismatch._key() for mismatch in mismatches])
        lines += [mismatches[g.leader].line(g.suffix) for g in groups[:_SHOWN]]
        hidden = sum(len(g.members()) for g in groups[_SHOWN:])
        if hidden:
            lines.append(
                f"  ... and {hidden} more (the report's `mismatches` lists every one)."
            )
        lines.append(
            "Place them with `eqshard.shard(tree, specs, mesh)` (or make them "
            "inside `jax.jit` with `out_shardings=`; within a jitted step, "
            "constrain them with `eqshard.with_sharding_constraint`), or change "
            "`specs`."
        )
        return "\n".join(lines)

    def _summary(self) -> dict[str, Any]:
        return {"checked": self.checked, "mismatches": len(self.mismatches)}


class LayoutError(ValueError):
    """The error of [`eqshard.check_layout`][]: a `ValueError` whose message lists
    the first mismatches, and whose `report` (a
    [`eqshard.LayoutReport`][]) holds every one, in tree order,
    also as `mismatches`."""

    def __init__(self, message: str, report: LayoutReport):
        super().__init__(message)
        self.report = report

    @property
    def mismatches(self) -> tuple[LayoutMismatch, ...]:
        return self.report.mismatches

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.report)


def _mismatch(
    leaf: Any,
    expected: NamedSharding,
    typed: tuple[NamedSharding, frozenset[str]] | None,
) -> str | None:
    """What is wrong with where `leaf` is, or `None` if it is where `expected` says.
    A tracer's `typed` sharding is compared on the axes it speaks for."""
    axes = None
    if typed is not None:  # a tracer, by the sharding in its type
        actual, axes = typed
    elif not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return "is a NumPy array on the host, not on any device"
    elif is_deleted(leaf):
        return f"has been {DELETED}; check the array that function returned instead"
    else:
        actual = leaf.sharding
    if actual is None:
        return "has no sharding (an abstract array made without one)"
    if not isinstance(actual, NamedSharding):
        devices = actual.device_set
        if len(devices) == 1:
            return f"is on a single device ({next(iter(devices))}), not on the mesh"
        return f"has a {type(actual).__name__}, not a NamedSharding on the mesh"
    problems = []
    if not same_mesh(actual.mesh, expected.mesh):
        problems.append(f"is on another mesh {mesh_repr(actual.mesh)}")
    sizes = dict(actual.mesh.shape)
    ndim = len(leaf.shape)
    if _placement(actual.spec, ndim, sizes, axes) != _placement(
        expected.spec, ndim, sizes, axes
    ):
        problems.append(f"has spec {actual.spec}")
    want, have = expected.memory_kind, _memory_kind(actual)
    if want is not None and have is not None and have != want:
        problems.append(f"is in {have!r} memory, not {want!r}")
    return "; ".join(problems) or None


@typecheck
def check_layout(
    tree: PyTree,
    specs: PyTree,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    on_invalid: OnInvalid = "raise",
) -> LayoutReport:
    """Checks that every array of `tree` is laid out as `specs` asks; by default
    raises one error listing every array that is not.

    An array matches when it has a `NamedSharding` on `mesh` whose spec places it
    as its spec does (`P('dp', None)` and `P('dp')` alike), in the memory kind
    asked for ([`eqshard.host`][] for host memory). An array on a single device
    matches no spec, NumPy arrays match nothing, and `None` specs and non-arrays
    are not checked. Nothing is moved or compiled. Inside `jit`, arrays on Explicit
    axes are checked by their type; on Auto axes they are skipped (see
    [the how-to](../how-to/will-it-fit.md#during-the-run-is-it-laid-out-as-asked)).

    **Arguments:**

    - `tree`: any pytree.
    - `specs`: a spec tree for `tree` or a prefix of one, partition rules, or a
      function of the abstract tree (see [the spec-tree family](specs.md)).
    - `mesh`: the mesh `PartitionSpec`s refer to; defaults to the mesh set by
      `jax.set_mesh`.
    - `on_invalid`: `"raise"` (the default) raises a `LayoutError`; `"warn"` warns
      with its message and returns the report; `"ignore"` returns the report.

    **Returns:**

    A [`eqshard.LayoutReport`][]: `report.ok`, and `report.mismatches`, each with
    `path`, `shape`, `spec`, `mesh`, `memory_kind` and `problem`.

    **Raises:**

    - `ValueError` (a `LayoutError`, with `on_invalid="raise"`) listing the arrays
      laid out otherwise than asked (the first 20 in the message, every one in its
      `report`); also if `specs` is not a prefix of `tree`, or has a
      `PartitionSpec` and there is no mesh.
    - `TypeError` naming the path of a leaf of `specs` that is not a spec.

    !!! Example

        ```python
        params = eqshard.shard({"w": jnp.zeros((8, 4))}, P("dp", "tp"), mesh)
        eqshard.check_layout(params, P("dp", "tp"), mesh).ok  # True: all match
        state = {"mu": jnp.zeros((8, 4))}  # made on one device, not on the mesh
        report = eqshard.check_layout(state, P(), mesh, on_invalid="ignore")
        report.mismatches[0].path  # "mu"
        ```
    """
    caller = "check_layout"
    check_choice(on_invalid, ON_INVALID, caller=caller, name="on_invalid")
    found = find_mesh(mesh)
    specs = resolve_specs(specs, tree, caller=caller, mesh=found)
    pairs = leaf_specs(specs, tree, caller=caller)
    mismatches = []
    checked = 0
    for (path, spec), leaf in zip(pairs, jtu.tree_leaves(tree), strict=True):
        if spec is None or not is_array(leaf):
            continue
        typed = _typed_sharding(leaf) if isinstance(leaf, Tracer) else None
        if isinstance(leaf, Tracer) and typed is None:
            continue  # inside `jit` on Auto axes: no layout to read
        checked += 1
        if isinstance(spec, PartitionSpec | Host):
            if found is None:
                raise ValueError(
                    f"eqshard.{caller}: `specs` has {spec} at '{path_str(path)}', a "
                    "PartitionSpec, but no mesh is given or set to say where it "
                    "places the array. Pass `mesh=...`, call it under "
                    "`with jax.set_mesh(mesh):`, or give `NamedSharding`s."
                )
            asked, kind = memory_of(spec)
            on = found
        else:
            asked, on, kind = spec.spec, spec.mesh, spec.memory_kind
        shape = tuple(int(n) for n in leaf.shape)
        _, reasons = check_spec(shape, asked, dict(on.shape))
        if reasons:
            problem = (
                f"the spec cannot apply ({'; '.join(reasons)}), and "
                "`eqshard.shard` refuses it"
            )
        else:
            expected = (
                spec
                if isinstance(spec, NamedSharding)
                else NamedSharding(on, asked, memory_kind=kind)
            )
            problem = _mismatch(leaf, expected, typed)
        if problem is not None:
            mismatches.append(
                LayoutMismatch(path_str(path), shape, asked, on, kind, problem)
            )
    report = LayoutReport(checked, tuple(mismatches))
    if mismatches and on_invalid == "raise":
        raise LayoutError(report._message(caller), report)
    if mismatches and on_invalid == "warn":
        warn(report._message(caller))
    return report
