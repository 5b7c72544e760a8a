"""`t5x.Partitioner`'s configuration: its arguments checked together, its
logical axis rules, the mesh `default_mesh` picks for it, and the error for
rules whose data axes its mesh lacks.
"""

import math
import operator
import typing
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from .._mesh._current import mesh_repr
from .._spectree._check_spec import axes_repr
from .._spectree._logical import LogicalRules, normalize_rules
from .._spectree._logical_convert import standard_logical_axis_rules
from .._typing import AxisRulesArg, Int
from ._topology import default_mesh


def _config_error(problem: str, fix: str) -> ValueError:
    return ValueError(f"eqshard.t5x.Partitioner: {problem} {fix}")


def _given(**options: Any) -> list[str]:
    """The names of the options that are not `None`, in order."""
    return [name for name, value in options.items() if value is not None]


def check_config(
    num_partitions: int | None,
    model_parallel_submesh: Sequence[Int] | None,
    mesh: Mesh | None,
    *,
    backend: str | None,
    ici_mesh_shape: Sequence[Int] | None,
    dcn_mesh_shape: Sequence[Int] | None,
) -> None:
    """Raises if `Partitioner`'s arguments do not go together."""
    given = _given(
        num_partitions=num_partitions,
        model_parallel_submesh=model_parallel_submesh,
        mesh=mesh,
    )
    if len(given) != 1:
        raise _config_error(
            "exactly one of `num_partitions`, `model_parallel_submesh` and "
            f"`mesh` must be given, got {' and '.join(given) or 'none'}.",
            "Pass `mesh=` to use a mesh of your own, or one of the others to "
            "let eqshard.t5x.default_mesh pick one for the hardware.",
        )
    if mesh is not None:
        extra = _given(
            backend=backend,
            ici_mesh_shape=ici_mesh_shape,
            dcn_mesh_shape=dcn_mesh_shape,
        )
        if extra:
            raise _config_error(
                f"{' and '.join(extra)} only shape the default mesh, but "
                "`mesh=` was given.",
                "Build the mesh with them yourself (e.g. "
                "eqshard.create_hybrid_mesh), or drop `mesh=`.",
            )
    if num_partitions is not None and num_partitions < 1:
        raise _config_error(
            f"`num_partitions` must be at least 1, got {num_partitions}.",
            "It is the number of devices each model replica is split over.",
        )
    if (ici_mesh_shape is None) != (dcn_mesh_shape is None):
        raise _config_error(
            "`ici_mesh_shape` and `dcn_mesh_shape` describe a multi-slice mesh "
            "together, but only one was given.",
            "Pass both (e.g. ici (1, 4, 2) and dcn (2, 1, 1)), or neither.",
        )


def axis_rules_for(
    axis_rules: AxisRulesArg | None, *, multislice: bool
) -> LogicalRules:
    """The logical axis rules: those given, or t5x's standard ones; on a
    multi-slice mesh, the batch goes over the slices too."""
    if axis_rules is None:
        rules = standard_logical_axis_rules()
    else:
        rules = normalize_rules(axis_rules, caller="t5x.Partitioner")
    if multislice:
        rules = tuple(
            (name, ("replica", "data") if name == "batch" else axes)
            for name, axes in rules
        )
    return rules


def partitioner_mesh(
    num_partitions: int | None,
    model_parallel_submesh: Sequence[Int] | None,
    *,
    backend: str | None,
    ici_mesh_shape: Sequence[Int] | None,
    dcn_mesh_shape: Sequence[Int] | None,
) -> Mesh:
    """The mesh `default_mesh` picks for the hardware. Exactly one of the first
    two is given (checked by `check_config`); with a submesh, `default_mesh`
    ignores the number of partitions."""
    submesh = None
    partitions = num_partitions
    if model_parallel_submesh is not None:
        submesh = tuple(map(operator.index, model_parallel_submesh))
        partitions = math.prod(submesh)
    return default_mesh(
        typing.cast(int, partitions),
        submesh,
        backend=backend,
        ici_mesh_shape=None
        if ici_mesh_shape is None
        else tuple(map(operator.index, ici_mesh_shape)),
        dcn_mesh_shape=None
        if dcn_mesh_shape is None
        else tuple(map(operator.index, dcn_mesh_shape)),
    )


def no_data_axes_error(
    data_axes: tuple[str, ...], mesh: Mesh, *, default: bool
) -> ValueError | None:
    """The error for rules whose data axes `mesh` lacks, or `None`."""
    missing = [axis for axis in data_axes if axis not in mesh.shape]
    if not missing:
        return None
    return _config_error(
        f"the {'default ' if default else ''}rules map "
        "the logical axis 'batch' (the data axes) to "
        f"{axes_repr(data_axes)}, but the mesh "
        f"{mesh_repr(mesh)} has no axis {', '.join(map(repr, missing))}.",
        "Pass `axis_rules` for this mesh, with a rule such as "
        f"('batch', {mesh.axis_names[0]!r}).",
    )
