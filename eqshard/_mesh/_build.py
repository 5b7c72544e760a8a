"""Building device meshes: `create_mesh` from sizes or mesh strings
(`'dp:2,fsdp:-1'`), `create_hybrid_mesh` over slices or hosts, fjformer's
`get_jax_mesh`, and the devices they are built from (`resolve_devices`). Finding
and querying the mesh a call runs on is `_mesh.py`."""

import collections
import math
import operator
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from .._typing import AxisTypesArg, Int, typecheck
from ._targets import parse_target, target_devices


# One builder per kind of message.


def _shape_error(caller: str, dims: Any, names: Any, problem: str) -> ValueError:
    """A mesh shape (`dims` over `names`) that cannot be built, and why."""
    return ValueError(
        f"eqshard.{caller}: cannot build a mesh with sizes {tuple(dims)} and axis "
        f"names {tuple(names)}: {problem}"
    )


def _mesh_string_error(
    caller: str, argname: str, axis_dims: str, token: str, problem: str
) -> ValueError:
    """A malformed mesh string, naming the offending token."""
    return ValueError(
        f"eqshard.{caller}: cannot parse mesh string {axis_dims!r} at "
        f"{token!r}: {problem}. Write either sizes in the order of `{argname}` "
        "('2,-1') or name:size pairs ('dp:2,fsdp:-1')."
    )


# Building meshes.


def _shape_problem(
    dims: Sequence[int],
    names: Sequence[str],
    num_devices: int | None,
    *,
    use_all: bool = False,
) -> str | None:
    """What is wrong with sizes `dims` for axes `names` over `num_devices` devices.

    `num_devices=None` skips the device-count checks and allows no `-1`. With
    `use_all`, sizes that leave devices idle are wrong too (as in `jax.make_mesh`).
    """
    minus = list(dims).count(-1)
    known = math.prod(d for d in dims if d != -1)
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if len(dims) != len(names):
        return f"{len(dims)} size(s) for {len(names)} name(s); give one per name."
    if repeated:
        return f"axis name {', '.join(map(repr, repeated))} repeats; name each once."
    if any(d == 0 or d < -1 or (d == -1 and num_devices is None) for d in dims):
        return "sizes must be positive" + ("." if num_devices is None else ", or -1.")
    if minus > 1:
        return f"{minus} sizes are -1 but only one can be inferred; fix the others."
    if num_devices is not None and minus and num_devices % known:
        return (
            f"the fixed sizes multiply to {known}, which does not divide the "
            f"{num_devices} devices; make their product a divisor of {num_devices}."
        )
    if num_devices is not None and not minus and known > num_devices:
        return (
            f"the sizes multiply to {known}, more than the {num_devices} devices; "
            "use -1 for one axis to take all devices, or smaller sizes."
        )
    if num_devices is not None and not minus and use_all and known < num_devices:
        return (
            f"the sizes multiply to {known}, fewer than the {num_devices} devices, "
            f"which would leave {num_devices - known} idle; use -1 for one axis to "
            "take all devices, or pass the devices to use, e.g. "
            f"`devices=jax.devices()[:{known}]`."
        )
    return None


def _names_tuple(caller: str, names: Sequence[str]) -> tuple[str, ...]:
    """`names` as a tuple; a bare string is a TypeError."""
    if isinstance(names, str):
        raise TypeError(
            f"eqshard.{caller}: axis names must be a sequence of strings, not the "
            f"string {names!r}; write ({names!r},) for a single axis."
        )
    return tuple(names)


def _check_shape(
    caller: str,
    dims: Sequence[int],
    names: Sequence[str],
    num_devices: int | None,
    *,
    use_all: bool = False,
) -> tuple[str, ...]:
    """Raise for a bad shape (see `_shape_problem`); return the names as a tuple."""
    names = _names_tuple(caller, names)
    problem = _shape_problem(dims, names, num_devices, use_all=use_all)
    if problem is not None:
        raise _shape_error(caller, dims, names, problem)
    return names


def _axis_types(
    caller: str, names: tuple[str, ...], axis_types: AxisTypesArg
) -> tuple[AxisType, ...]:
    """`axis_types` (one type for every axis, or one per axis), or `Auto` for
    every axis, checked against the axis names."""
    if axis_types is None:
        return (AxisType.Auto,) * len(names)
    if isinstance(axis_types, AxisType):
        return (axis_types,) * len(names)
    if len(axis_types) != len(names):
        raise ValueError(
            f"eqshard.{caller}: {len(axis_types)} axis_types for the "
            f"{len(names)} axes {names}; give one AxisType per axis."
        )
    return tuple(axis_types)


def resolve_devices(
    caller: str, devices: Sequence[Any] | None, backend: str | None
) -> list[Any]:
    """The devices to build a mesh from: `devices`, or `jax.devices(backend)`."""
    if devices is not None and backend is not None:
        raise ValueError(
            f"eqshard.{caller}: pass either devices= or backend={backend!r}, not both."
        )
    if devices is not None and len(devices) == 0:
        raise ValueError(f"eqshard.{caller}: devices= is empty; give at least one.")
    return list(jax.devices(backend) if devices is None else devices)


def _build_mesh(
    caller: str,
    dims: Sequence[int],
    names: Sequence[str],
    devices: Sequence[Any] | None,
    backend: str | None,
    axis_types: AxisTypesArg,
    *,
    keep_device_order: bool = False,
    target: tuple[str, int] | None = None,
) -> Mesh:
    """The mesh behind `create_mesh` and `get_jax_mesh`; `target` is a target's
    name and number of slices."""
    if target is not None and (devices is not None or backend is not None):
        which = "devices=" if devices is not None else f"backend={backend!r}"
        raise ValueError(
            f"eqshard.{caller}: pass either {which} or target={target[0]!r}, not "
            "both: a target brings its own devices."
        )
    if target is None:
        devs = resolve_devices(caller, devices, backend)
    else:
        devs = target_devices(caller, target[0], num_slices=target[1])
    # Devices left idle by default are a costly typo; `devices=` chooses them.
    names = _check_shape(caller, dims, names, len(devs), use_all=devices is None)
    types = _axis_types(caller, names, axis_types)
    known = math.prod(d for d in dims if d != -1)
    shape = tuple(len(devs) // known if d == -1 else d for d in dims)
    devs = devs[: math.prod(shape)]
    if keep_device_order:
        array = np.empty(len(devs), dtype=object)
        array[:] = devs
        return Mesh(array.reshape(shape), names, axis_types=types)
    if target is not None and target[1] > 1:
        return _sliced_mesh(caller, shape, names, devs, types, target[1])
    if target is not None:
        # A target's mesh may split a physical axis (8 x 8 over a 4x4x4 torus),
        # as a user of that pod would arrange it.
        array = mesh_utils.create_device_mesh(
            shape, devs, allow_split_physical_axes=True
        )
        return Mesh(array, names, axis_types=types)
    return jax.make_mesh(shape, names, axis_types=types, devices=devs)


def _sliced_mesh(
    caller: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    devices: list[Any],
    types: tuple[AxisType, ...],
    num_slices: int,
) -> Mesh:
    """A mesh over `num_slices` slices: the first axis whose size they divide
    runs across them (DCN), every other step inside one slice (ICI)."""
    axis = next((i for i, d in enumerate(shape) if d % num_slices == 0), None)
    if axis is None:
        raise _shape_error(
            caller, shape, names, f"no axis size is a multiple of num_slices="
            f"{num_slices}; make one axis (usually the data axis) a multiple of "
            "it, or lay the slices out with create_hybrid_mesh."
        )  # fmt: skip
    dcn = tuple(num_slices if i == axis else 1 for i in range(len(shape)))
    ici = tuple(d // c for d, c in zip(shape, dcn))
    array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    return Mesh(array, names, axis_types=types)


_DEFAULT_NAMES = ("dp", "fsdp", "tp", "sp")


@typecheck
def create_mesh(
    axis_dims: Sequence[Int] | str = (1, -1, 1, 1),
    axis_names: Sequence[str] | None = None,
    *,
    devices: Sequence[Any] | None = None,
    backend: str | None = None,
    axis_types: AxisTypesArg = None,
    target: str | None = None,
    num_slices: Int = 1,
) -> Mesh:
    """Build a named device mesh from sizes or a mesh string; one size of `-1`
    takes the remaining devices.

    The sizes are one per axis name, or a mesh string: `"dp:2,fsdp:-1"` (named
    axes) or `"2,-1"` (sizes alone); a leading `!` keeps the devices in the order
    given instead of arranging them by topology (`jax.make_mesh`'s). The sizes must
    use every device; to use fewer, pass them as `devices`. Every axis is `Auto`
    unless `axis_types` says otherwise ([Explicit axes](../how-to/explicit-axes.md)).
    With `target`, the devices are compile-only ones of hardware this process
    need not have, for its real compiler ([Will it fit?](../how-to/will-it-fit.md)).

    **Arguments:**

    - `axis_dims`: the size of each axis (at most one is `-1`), or a mesh string.
    - `axis_names`: one distinct name per axis; by default `("dp", "fsdp", "tp",
      "sp")` for sizes, and the string's names for a string of `name:size` pairs.
    - `devices`: the devices to use (default `jax.devices(backend)`); `backend`:
      the JAX backend to take them from otherwise.
    - `axis_types`: one `jax.sharding.AxisType` for every axis or one per axis.
    - `target`: a TPU slice (`"v5p-1024"`, `"v5e:2x4"`; the `tpu` extra) or NVIDIA
      GPUs (`"h100"`, `"h100:8x8"`; the `gpu` extra and `JAX_PLATFORMS=cpu`).
    - `num_slices`: with a TPU `target`, that many slices over DCN; the first axis
      whose size is a multiple of it runs across them.

    **Returns:**

    A `jax.sharding.Mesh`.

    **Raises:**

    `ValueError` if sizes, names and `axis_types` differ in length, a name
    repeats, the sizes are invalid or do not fit the device count (giving both
    numbers), a mesh string has a bad entry (naming it), or for an unknown or
    invalid `target` (listing the names known) or one combined with `devices`,
    `backend` or (GPU) `num_slices`; `ImportError` naming the extra to install
    when a target's compiler is missing; `TypeError` for a string `axis_names`.

    !!! Example

        ```python
        mesh = eqshard.create_mesh((2, -1), ("dp", "tp"))  # 8 devices
        dict(mesh.shape)  # {"dp": 2, "tp": 4}
        dict(eqshard.create_mesh("tp:2,dp:-1").shape)  # {"tp": 2, "dp": 4}
        pod = eqshard.create_mesh((64, 8), ("fsdp", "tp"), target="v5p-1024")
        ```
    """
    slices = operator.index(num_slices)
    if target is None and slices != 1:
        raise ValueError(
            f"eqshard.create_mesh: num_slices={slices} is for a target's slices; "
            "give target= too, or leave num_slices out."
        )
    on = None if target is None else (target, slices)
    if isinstance(axis_dims, str):
        return _string_mesh(
            "create_mesh",
            axis_dims,
            axis_names,
            devices,
            backend,
            axis_types,
            argname="axis_names",
            target=on,
        )
    dims = tuple(map(operator.index, axis_dims))
    names = _DEFAULT_NAMES if axis_names is None else axis_names
    return _build_mesh(
        "create_mesh", dims, names, devices, backend, axis_types, target=on
    )


def _parse_mesh_string(
    caller: str, argname: str, axis_dims: str, names: tuple[str, ...] | None
) -> tuple[bool, tuple[int, ...], tuple[str, ...]]:
    """Split a mesh string into (keep_device_order, sizes, axis names). With
    `names=None`, a named string may use any names, and sizes alone are for
    `_DEFAULT_NAMES`."""
    text = axis_dims.strip()
    keep_order = text.startswith("!")
    tokens = [t.strip() for t in text.removeprefix("!").split(",")]
    named = ":" in tokens[0]
    dims, dim_names = [], []
    for token in tokens:
        name, _, size = token.rpartition(":")
        name, size = name.strip(), size.strip()
        if not token:
            problem = "empty entry"
        elif (":" in token) != named:
            problem = "named and positional entries are mixed"
        elif not re.fullmatch(r"-?[0-9]+", size):
            problem = f"{size!r} is not an integer size"
        elif named and names is None and not name:
            problem = "the axis name is empty"
        elif named and names is not None and name not in names:
            problem = f"{name!r} is not one of the names {names}"
        elif named and name in dim_names:
            problem = f"{name!r} repeats"
        else:
            dims.append(int(size))
            dim_names.append(name)
            continue
        raise _mesh_string_error(caller, argname, axis_dims, token, problem)
    if named:
        missing = [n for n in names or () if n not in dim_names]
        if missing:
            problem = f"no size for {', '.join(map(repr, missing))}"
            raise _mesh_string_error(caller, argname, axis_dims, text, problem)
        return keep_order, tuple(dims), tuple(dim_names)
    names = _DEFAULT_NAMES if names is None else names
    if len(dims) != len(names):
        problem = f"{len(dims)} size(s) for the {len(names)} names {names}"
        raise _mesh_string_error(caller, argname, axis_dims, text, problem)
    return keep_order, tuple(dims), names


def _string_mesh(
    caller: str,
    axis_dims: str,
    names: Sequence[str] | None,
    devices: Sequence[Any] | None,
    backend: str | None,
    axis_types: AxisTypesArg,
    *,
    argname: str,
    target: tuple[str, int] | None = None,
) -> Mesh:
    """The mesh of a mesh string, for `create_mesh` and `get_jax_mesh`."""
    given = None if names is None else _names_tuple(caller, names)
    keep_order, dims, dim_names = _parse_mesh_string(caller, argname, axis_dims, given)
    return _build_mesh(
        caller,
        dims,
        dim_names,
        devices,
        backend,
        axis_types,
        keep_device_order=keep_order,
        target=target,
    )


@typecheck
def get_jax_mesh(
    axis_dims: str,
    names: Sequence[str],
    *,
    devices: Sequence[Any] | None = None,
    backend: str | None = None,
    axis_types: AxisTypesArg = None,
) -> Mesh:
    """Build a mesh from a string such as `"dp:2,fsdp:-1,tp:1"` or `"2,-1,1"`
    (fjformer's name; [`eqshard.create_mesh`][] takes the same strings).

    A positional string gives one size per entry of `names`, in that order. A
    named string gives `name:size` pairs for every name in `names`, and the mesh
    axes follow the string's order, not `names`'. One size may be `-1`, as in
    [`eqshard.create_mesh`][]. A leading `!` keeps the devices in the order
    given instead of arranging them by topology (allowing a physical axis to be
    split across mesh axes).

    **Arguments:**

    - `axis_dims`: the mesh string.
    - `names`: the axis names.
    - `devices`, `backend`, `axis_types`: as for [`eqshard.create_mesh`][].

    **Returns:**

    A `jax.sharding.Mesh` with `AxisType.Auto` axes unless `axis_types` is given.

    **Raises:**

    `ValueError` naming the offending entry for an empty entry, a non-integer
    size, an unknown or repeated name, a mix of named and positional entries, or
    the wrong number of sizes; otherwise as [`eqshard.create_mesh`][].

    !!! Example

        ```python
        mesh = eqshard.compat.get_jax_mesh("tp:2,dp:-1", ("dp", "tp"))  # 8 devices
        mesh.axis_names  # ("tp", "dp")
        dict(mesh.shape)  # {"tp": 2, "dp": 4}
        ```
    """
    return _string_mesh(
        "compat.get_jax_mesh",
        axis_dims,
        names,
        devices,
        backend,
        axis_types,
        argname="names",
    )


def _unit_attribute(devices: Sequence[Any], num_units: int) -> str | None:
    """The device attribute whose values are the DCN units, or `None`.

    Slices when the devices have `slice_index` and there are `num_units` of
    them; else processes when there are `num_units` of those.
    """
    if all(hasattr(d, "slice_index") for d in devices):
        if len({d.slice_index for d in devices}) == num_units:
            return "slice_index"
    if len({d.process_index for d in devices}) == num_units:
        return "process_index"
    return None


@typecheck
def create_hybrid_mesh(
    ici_mesh_shape: Sequence[Int],
    dcn_mesh_shape: Sequence[Int],
    axis_names: Sequence[str],
    *,
    devices: Sequence[Any] | None = None,
    axis_types: AxisTypesArg = None,
    target: str | None = None,
    num_slices: Int | None = None,
) -> Mesh:
    """Build a mesh over several slices or hosts: fast (ICI) axes inside each one,
    slow (DCN) axes across them.

    Axis `i` has size `ici_mesh_shape[i] * dcn_mesh_shape[i]`: each unit's
    devices fill an `ici_mesh_shape` block (arranged by
    `jax.experimental.mesh_utils.create_hybrid_device_mesh`), and the units tile
    a `dcn_mesh_shape` grid in index order. The units are TPU slices
    (`slice_index`) if there are `prod(dcn_mesh_shape)` of them, else processes
    (GPUs and multi-process CPUs have a single slice, or none).

    **Arguments:**

    - `ici_mesh_shape`: the mesh shape inside one slice or process.
    - `dcn_mesh_shape`: how the slices or processes tile, one entry per axis.
    - `axis_names`: one distinct name per axis.
    - `devices`: the devices (default `jax.devices()`).
    - `axis_types`: as for [`eqshard.create_mesh`][] (default all `Auto`).
    - `target`: compile-only devices of this hardware instead, as for
      [`eqshard.create_mesh`][]: a TPU slice name or a GPU name such as
      `"h100:8x8"` (whose hosts are the DCN units).
    - `num_slices`: with a TPU `target`, the number of slices (default the
      product of `dcn_mesh_shape`).

    **Returns:**

    A `jax.sharding.Mesh`.

    **Raises:**

    As [`eqshard.create_mesh`][] for `target`; `ValueError` if the three
    sequences differ in length, a name repeats, a size is not positive, the
    product of `dcn_mesh_shape` is neither the number of slices nor of
    processes, or a unit does not hold exactly `prod(ici_mesh_shape)` devices.

    !!! Example

        ```python
        # One process of 8 devices: one DCN unit.
        mesh = eqshard.create_hybrid_mesh((2, 4), (1, 1), ("data", "model"))
        dict(mesh.shape)  # {"data": 2, "model": 4}
        ```
    """
    caller = "create_hybrid_mesh"
    ici = tuple(map(operator.index, ici_mesh_shape))
    dcn = tuple(map(operator.index, dcn_mesh_shape))
    _check_shape(caller, ici, axis_names, None)
    names = _check_shape(caller, dcn, axis_names, None)
    types = _axis_types(caller, names, axis_types)
    num_units = math.prod(dcn)
    if target is not None and devices is not None:
        raise ValueError(
            f"eqshard.{caller}: pass either devices= or target={target!r}, not "
            "both: a target brings its own devices."
        )
    if target is None and num_slices is not None:
        raise ValueError(
            f"eqshard.{caller}: num_slices={num_slices} is for a target's slices; "
            "give target= too, or leave num_slices out."
        )
    if target is not None:
        parsed = parse_target(caller, target)  # parsed once, used throughout
        slices = 1 if parsed.platform == "cuda" else num_units
        slices = slices if num_slices is None else operator.index(num_slices)
        devs = target_devices(caller, parsed, num_slices=slices)
    else:
        devs = resolve_devices(caller, devices, None)
    attr = _unit_attribute(devs, num_units)
    if attr is None:
        slices = len({getattr(d, "slice_index", 0) for d in devs})
        processes = len({d.process_index for d in devs})
        raise ValueError(
            f"eqshard.{caller}: dcn_mesh_shape={dcn} asks for "
            f"{num_units} slices or processes, but the {len(devs)} devices "
            f"span {slices} slice(s) and {processes} process(es). Make the "
            "product of dcn_mesh_shape one of those counts."
        )
    counts = collections.Counter(getattr(d, attr) for d in devs)
    if set(counts.values()) != {math.prod(ici)}:
        unit = attr.removesuffix("_index")
        raise ValueError(
            f"eqshard.{caller}: ici_mesh_shape={ici} needs "
            f"{math.prod(ici)} devices per {unit}, but the devices "
            f"per {unit} are {dict(sorted(counts.items()))}; give a shape whose "
            f"sizes multiply to the devices in one {unit}."
        )
    array = mesh_utils.create_hybrid_device_mesh(
        ici,
        dcn,
        devs,
        process_is_granule=attr == "process_index",
    )
    return Mesh(array, names, axis_types=types)
