"""The rows of a step report, built from the compiled program (`_step.py`).

Each leaf becomes a `StepLeaf` (its program's sharding and bytes per device);
each collective that `_hlo._flow.Program` finds a `CollectiveRow`, its arrays
named by the leaves their data comes from or goes to (else by the arguments of
the op producing or consuming it), its device groups mapped to mesh axes;
arguments that JAX moves at every call a `MovedInput`; XLA's logged warnings a
`StepWarning`, with the leaves of the instructions whose op name they quote;
on XLA:CPU, which reports no host memory, the bytes of the leaves in host memory
(`host_memory`), with a note saying so.
"""

import dataclasses
import os
import site
import sysconfig
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding

from .._internals.xla import logged_warnings
from .._mesh._targets import device_memory
from .._spectree._memory import is_host_memory
from .._typing import warn
from ._args import Leaf, spec_text
from ._hlo._flow import Collective, Part, Program
from ._records import (
    CollectivePart,
    CollectiveRow,
    MovedInput,
    StepLeaf,
    StepMemory,
    StepWarning,
)


def mesh_of(shardings: Sequence[Any]) -> Mesh | None:
    """The mesh of the first `NamedSharding` on a concrete mesh, if any."""
    for sharding in shardings:
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def leaf_row(path: str, struct: Any, sharding: Any, donated: bool = False) -> StepLeaf:
    itemsize = int(getattr(struct.dtype, "itemsize", 0))
    shard = (
        sharding.shard_shape(tuple(struct.shape))
        if sharding is not None
        else struct.shape
    )
    return StepLeaf(
        path=path,
        shape=tuple(int(d) for d in struct.shape),
        dtype=str(struct.dtype),
        spec=spec_text(sharding),
        bytes_per_device=int(np.prod(shard, dtype=np.int64)) * itemsize,
        donated=donated,
    )


def moved(leaf: Leaf, row: StepLeaf, program: Sharding) -> MovedInput | None:
    """The argument as moved at every call, or `None` if it is not."""
    if leaf.kind == "host":
        have = "host (NumPy)"
    elif leaf.kind == "uncommitted" and leaf.have is not None:
        if leaf.have.is_equivalent_to(program, len(row.shape)):
            return None
        have = f"uncommitted, {spec_text(leaf.have)}"
    else:
        return None
    return MovedInput(row.path, row.shape, row.dtype, have, row.spec)


def memory(stats: Any, devices: Sequence[Any]) -> StepMemory:
    """The figures of XLA's `memory_analysis()` of a program for `devices`."""
    platform = devices[0].platform if devices else "cpu"
    return StepMemory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        xla_peak_bytes=int(getattr(stats, "peak_memory_in_bytes", 0)),
        host_argument_bytes=int(getattr(stats, "host_argument_size_in_bytes", 0)),
        host_output_bytes=int(getattr(stats, "host_output_size_in_bytes", 0)),
        host_temp_bytes=int(getattr(stats, "host_temp_size_in_bytes", 0)),
        platform="gpu" if platform == "cuda" else platform,
        device_memory=device_memory(devices),
    )


def host_memory(
    figures: StepMemory,
    rows: Sequence[StepLeaf],
    shardings: Sequence[Any],
    n_arguments: int,
) -> tuple[StepMemory, tuple[StepWarning, ...]]:
    """`figures` with the host argument and output bytes computed from the
    memory kinds of the program's shardings (`rows` and `shardings`: the
    arguments, then the outputs), where the backend reports none (XLA:CPU,
    which counts them in `argument_bytes` and `output_bytes`), and a note that
    says so; as they are otherwise."""
    host = [is_host_memory(s) for s in shardings]
    reported = figures.host_argument_bytes or figures.host_output_bytes
    if figures.platform != "cpu" or reported or not any(host):
        return figures, ()
    held = [row for row, h in zip(rows, host, strict=True) if h]
    argument = sum(r.bytes_per_device for r in held[: sum(host[:n_arguments])])
    output = sum(r.bytes_per_device for r in held[sum(host[:n_arguments]) :])
    note = StepWarning(
        "eqshard: XLA:CPU reports no host memory; host_argument_bytes "
        f"({argument:,}) and host_output_bytes ({output:,}) are the per-device "
        "bytes of the arguments and outputs in host memory, by their memory kinds "
        "(XLA:CPU counts them in argument_bytes and output_bytes too)",
        tuple(r.path for r in held),
        "",
    )
    figures = dataclasses.replace(
        figures, host_argument_bytes=argument, host_output_bytes=output
    )
    return figures, (note,)


def collective_row(
    collective: Collective,
    arguments: Sequence[str],
    outputs: Sequence[str],
    mesh: Mesh | None,
) -> CollectiveRow:
    """The row of one collective; a kernel's row warns that what it
    communicates is not counted."""
    if collective.kind == "kernel":
        where = (
            f" (at {relative_source(collective.source)})" if collective.source else ""
        )
        warn(
            f"eqshard.analyze_step: the step runs the kernel {collective.name!r}"
            f"{where}, a Pallas/Mosaic custom-call: what it communicates is not "
            "in the compiled program's text and is not counted. Its row in the "
            "report has no bytes.",
            RuntimeWarning,
        )
    parts = tuple(
        _part(collective.kind, part, arguments, outputs) for part in collective.parts
    )
    if collective.kind == "collective-permute":
        group_size = 2
    elif collective.groups:
        group_size = len(collective.groups[0])
    else:
        group_size = max(collective.slices, 1)
    axes = (
        _dcn_axes(collective.groups, mesh)
        if collective.dcn
        else _axes(collective.groups, mesh)
    )
    return CollectiveRow(
        name=collective.name,
        kind=collective.kind,
        parts=parts,
        count=collective.count,
        axes=axes,
        group_size=group_size,
        op_name=collective.op_name,
        source=relative_source(collective.source),
        conditional=collective.conditional,
        unknown_trip_count=collective.unknown_trips,
        overlapped=collective.overlapped,
        dcn=collective.dcn,
    )


def _part(
    kind: str, part: Part, arguments: Sequence[str], outputs: Sequence[str]
) -> CollectivePart:
    """One array of a collective, named by its leaves."""
    paths = [arguments[i] for i in sorted(part.arguments)]
    paths += [outputs[i] for i in sorted(part.results)]
    via = ""
    if not paths:
        # A reduction combines the partial results of the op producing it; a
        # gather feeds the op consuming it; a resharding sits between both.
        producers = [arguments[i] for i in sorted(part.producers)]
        consumers = [arguments[i] for i in sorted(part.consumers)]
        consumers += [outputs[i] for i in sorted(part.consumer_results)]
        if kind in ("all-reduce", "reduce-scatter"):
            paths, via = producers, "producer"
        elif kind == "all-gather":
            paths, via = consumers, "consumer"
        else:
            paths, via = list(dict.fromkeys(producers + consumers)), "neighbours"
    return CollectivePart(
        shape=part.shape.dims,
        dtype=part.shape.dtype,
        bytes=part.shape.nbytes,
        paths=tuple(paths),
        via=via if paths else "",
    )


def _axes(groups: Sequence[Sequence[int]], mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes along which the devices of each group differ (device ids
    are positions in the mesh: the program's device assignment is its devices in
    order)."""
    if mesh is None or not groups:
        return ()
    shape = mesh.devices.shape
    varying: set[int] = set()
    for group in groups:
        if not group or max(group) >= mesh.size:
            continue
        coords = np.array(np.unravel_index(list(group), shape))
        varying.update(int(a) for a in np.nonzero(coords.min(1) != coords.max(1))[0])
    return tuple(name for a, name in enumerate(mesh.axis_names) if a in varying)


def _dcn_axes(groups: Sequence[Sequence[int]], mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes of a transfer between slices: those along which its
    groups' devices (ids) differ where the mesh holds them, else those along
    which the mesh's slices differ (its groups are one device per slice)."""
    if mesh is None:
        return ()
    position = {int(d.id): k for k, d in enumerate(mesh.devices.flat)}
    if groups and all(i in position for group in groups for i in group):
        return _axes([[position[i] for i in group] for group in groups], mesh)
    slices = np.vectorize(lambda d: int(getattr(d, "slice_index", 0) or 0))(
        mesh.devices
    )
    return tuple(
        name
        for a, name in enumerate(mesh.axis_names)
        if (np.diff(slices, axis=a) != 0).any()
    )


def _installed() -> list[str]:
    """The directories packages are installed in (site-packages and the
    standard library), longest first: a file under one is named from it."""
    paths = {os.path.join(p, "") for p in site.getsitepackages()}
    paths |= {os.path.join(site.getusersitepackages(), "")}
    for name in ("purelib", "platlib", "stdlib", "platstdlib"):
        paths.add(os.path.join(sysconfig.get_paths()[name], ""))
    return sorted(paths, key=len, reverse=True)


def relative_source(source: str) -> str:
    """A source file as the user's project names it: under the working directory,
    relative to it; in an installed package, from the package
    (`equinox/nn/_linear.py:97`: under any `site-packages` or `dist-packages`
    directory, or the standard library); anything else as it is."""
    cwd = os.path.join(os.getcwd(), "")
    if source.startswith(cwd):
        return source[len(cwd) :]
    for marker in ("site-packages", "dist-packages"):
        found = source.rfind(os.sep + marker + os.sep)
        if found >= 0:
            return source[found + len(marker) + 2 :]
    for directory in _installed():
        if source.startswith(directory):
            return source[len(directory) :]
    return source


def step_warnings(
    log: str, program: Program, arguments: Sequence[str], outputs: Sequence[str]
) -> tuple[StepWarning, ...]:
    """XLA's warnings in `log`, each with the leaves of the instructions carrying
    the op name it quotes."""
    found = []
    for logged in logged_warnings(log):
        paths: dict[str, None] = {}
        if logged.op_name is not None:
            quoted = f'op_name="{logged.op_name}"'
            for name, position, instruction in program.instructions():
                if quoted in instruction.attrs.get("metadata", ""):
                    args, results = program.flow(name, position)
                    paths.update(dict.fromkeys(arguments[i] for i in sorted(args)))
                    paths.update(dict.fromkeys(outputs[i] for i in sorted(results)))
        source = ""
        if logged.stack_frame is not None:
            source = relative_source(program.module.sources.get(logged.stack_frame, ""))
        found.append(StepWarning(logged.message, tuple(paths), source))
    return tuple(found)
