"""Where a leaf lives: `host(spec)`, a layout in host memory.

`host(spec)` makes a `Host`, a rule value and a spec-tree leaf that means "this
layout, in host memory (`pinned_host`)". Everything else about a layout stays the
business of the spec inside: the matching engine (`_rules.py`) resolves it like
any rule value and wraps the result again, and where a spec tree meets a mesh
(`_check_spec.named_sharding`) a `Host` becomes a `NamedSharding` with the memory kind
`"pinned_host"`, after checking that the mesh's devices have that memory. The
helpers here split a spec into its layout and its memory kind (`memory_of`) and
join them again (`in_memory`), so the rest of eqshard reads a `PartitionSpec`.
"""

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._tree import path_str
from .._typing import typecheck
from ._logical import AxisNames


# The memory kind of `host(spec)`: what JAX calls page-locked host memory, which
# devices read and write directly.
HOST_MEMORY = "pinned_host"


@dataclasses.dataclass(frozen=True)
class Host:
    """A layout in host memory; made by [`eqshard.host`][].

    **Fields:** `spec`, the layout: a `PartitionSpec`, logical
    [`eqshard.AxisNames`][], or (in partition rules) any other rule value, such as
    [`eqshard.stacked`][] or [`eqshard.auto_fsdp`][]; `None` in a rule that
    matches arrays following a parameter (Adam's `mu` and `nu`), which keep the
    parameter's layout.
    """

    spec: Any

    def __repr__(self) -> str:
        return "host()" if self.spec is None else f"host({self.spec!r})"


def _is_rule_value(spec: Any) -> bool:
    """A value a partition rule may hold: a spec, logical names, a function of a
    leaf's shape, or a wrapper of one (`Stacked`, told by its `place`, as
    `_stacked.py` imports this module)."""
    return (
        isinstance(spec, PartitionSpec | AxisNames)
        or callable(spec)
        or callable(getattr(spec, "place", None))
    )


@typecheck
def host(spec: Any = None) -> Host:
    """Marks a layout as kept in host memory (`pinned_host`), between the steps
    that use it: optimizer state offloaded by a rule.

    The layout is the spec's: every device holds its shard, in the host memory
    attached to it rather than in its own. It is accepted wherever specs are
    ([where, and what each reader does](rules.md#where-host-layouts-are-accepted)).
    A step compiled by [`eqshard.filter_jit`][] with such specs moves those arrays
    to device memory for the computation and back for its outputs, inside its one
    program: the step itself needs no change.

    In a rule matched against a tree built together (`(model, opt_state)`), a
    host rule is matched by the arrays that follow a parameter too: `host()`
    without a spec keeps the parameter's layout, so one rule such as
    `("(mu|nu)/", eqshard.host())` offloads Adam's moments as the parameters
    are laid out. `host(stacked(spec))` and `stacked(host(spec))` are the same.

    **Arguments:**

    - `spec`: the layout: a `PartitionSpec`, logical [`eqshard.AxisNames`][],
      or in rules any rule value ([`eqshard.stacked`][],
      [`eqshard.auto_fsdp`][]); left out, the layout of the parameter an array
      follows.

    **Returns:**

    A `Host`, for rules and spec trees.

    **Raises:**

    `TypeError` if `spec` is already in host memory, or is not a spec or rule
    value. Placing it on devices without host memory (a backend that reports
    no `pinned_host` memory) raises a `ValueError` naming the backend.

    !!! Example

        ```python
        rules = [("(mu|nu)/", eqshard.host()), (".*", P("dp"))]
        state = eqshard.init_sharded(make, key, specs=rules, mesh=mesh)
        state[1][0].mu["w"].sharding.memory_kind  # 'pinned_host'
        ```
    """
    if isinstance(spec, Host):
        raise TypeError(
            f"eqshard.host: `spec` is {spec!r}, which is already in host memory; "
            f"write it once: {spec!r}."
        )
    if spec is not None and not _is_rule_value(spec):
        raise TypeError(
            f"eqshard.host: `spec` is {spec!r}, which is not a PartitionSpec, "
            "eqshard.AxisNames or a partition rule's value; write the layout, "
            "e.g. eqshard.host(P('dp')), or eqshard.host() in a rule for arrays "
            "that follow a parameter."
        )
    return Host(spec)


def memory_of(spec: Any) -> tuple[Any, str | None]:
    """A spec leaf's layout and memory kind: `(spec, None)` where it names none
    (the device's), `(inner, "pinned_host")` for `host(inner)`, and a
    `NamedSharding`'s own."""
    if isinstance(spec, Host):
        return spec.spec, HOST_MEMORY
    if isinstance(spec, NamedSharding):
        kind = spec.memory_kind
        return spec, None if kind == "device" else kind
    return spec, None


def in_memory(spec: Any, memory_kind: str | None) -> Any:
    """`spec` (a `PartitionSpec` or `NamedSharding`) in the memory `memory_kind`
    (`None`: as it is): the inverse of `memory_of`."""
    if memory_kind is None or spec is None:
        return spec
    if isinstance(spec, NamedSharding):
        return spec.with_memory_kind(memory_kind)
    if memory_kind != HOST_MEMORY:
        raise ValueError(
            f"memory kind {memory_kind!r} has no spec of its own; use "
            f"{HOST_MEMORY!r} (eqshard.host) or a NamedSharding."
        )
    return spec if isinstance(spec, Host) else Host(spec)


def map_layout(value: Any, fn: Any) -> Any:
    """`fn(layout)` for a rule's value (the layout inside `host(...)` kept in
    host memory; `host()` as it is): e.g. FSDP added to each rule's spec."""
    if isinstance(value, Host):
        return value if value.spec is None else Host(fn(value.spec))
    return fn(value)


def offloads(rules: Iterable[tuple[Any, Any]]) -> bool:
    """Whether partition rules keep arrays in host memory (a value `host(...)`)."""
    return any(isinstance(value, Host) for _, value in rules)


def follower_rules_text(rules: Iterable[tuple[Any, Any]]) -> str:
    """The lines of a rules file for the rules `host()` of `rules`, which match
    the optimizer state (the arrays that follow a parameter), not the model."""
    return "".join(
        f"{regex}  host()\n" for regex, value in rules if value == Host(None)
    )


def is_host_memory(sharding: Any) -> bool:
    """Whether a sharding (or a spec leaf) places in host memory."""
    kind = getattr(sharding, "memory_kind", None)
    if isinstance(sharding, Host):
        kind = HOST_MEMORY
    return kind is not None and kind != "device"


def memory_kinds(devices: Iterable[Any]) -> set[str] | None:
    """The memory kinds every one of `devices` has (those of the first device),
    or `None` where its backend cannot say (a device without `addressable_memories`,
    such as the compile-only devices of some targets)."""
    for device in devices:
        try:
            return {memory.kind for memory in device.addressable_memories()}
        except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
            return None
    return None


def no_host_memory_error(caller: str, where: str, devices: Any) -> ValueError:
    """The message for a host spec on devices that have no host memory."""
    device = next(iter(devices), None)
    platform = getattr(device, "platform", "?")
    kinds = memory_kinds([device]) if device is not None else None
    have = "reports no memory kinds" if not kinds else f"has {sorted(kinds)}"
    return ValueError(
        f"eqshard.{caller}: {where} asks for host memory ({HOST_MEMORY!r}), but "
        f"the {platform!r} backend's device {device} {have}. Keep this leaf in "
        "device memory (drop eqshard.host), or run on a backend whose devices "
        f"have {HOST_MEMORY!r} memory (TPU, GPU with its runtime, CPU)."
    )


def refuse_host(
    caller: str, pairs: Iterable[tuple[Any, Any]], argname: str, why: str
) -> None:
    """Raises a `TypeError` naming every leaf of `pairs` (`(path, spec)`) in
    host memory, for a function where specs lay values out inside a program
    (`why`) and do not move them between memories."""
    paths = [path for path, spec in pairs if isinstance(spec, Host)]
    if paths:
        where = ", ".join(f"'{path_str(p)}'" for p in paths[:10])
        more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
        raise TypeError(
            f"eqshard.{caller}: `{argname}` asks for host memory (eqshard.host) at "
            f"{where}{more}, but {why}, not which memory holds it. Give the layout "
            "inside host(...) here; keep arrays in host memory between steps "
            "with eqshard.filter_jit's in_specs/out_specs (inside a step of "
            "your own: jax.device_put(x, sharding.with_memory_kind('pinned_host')))."
        )


def check_host_memory(caller: str, where: str, devices: Any) -> None:
    """Raises `no_host_memory_error` unless `devices` have host memory."""
    kinds = memory_kinds(devices)
    if kinds is None or HOST_MEMORY not in kinds:
        raise no_host_memory_error(caller, where, devices)
