"""Old names that keep working for one release, each with a `DeprecationWarning`
naming its replacement: root names that moved to a namespace (read through the
root's module `__getattr__`), keywords that were renamed (`renamed_keywords`, with
their values where those were renamed too) and option values that were renamed
(`renamed_literals`).
"""

import functools
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast, TypeVar

from ._typing import outside_caller, warn


_F = TypeVar("_F", bound=Callable[..., Any])

_IMPORT_SYSTEM = ("importlib", "_frozen_importlib")

# The root names of eqshard 0.1.0 (`git show v0.1.0:eqshard/__init__.py`), the
# one release before this one: only these may be served under an old name.
RELEASED_ROOT: frozenset[str] = frozenset(
    {
        "analyze_sharding_strategy",
        "axis_index",
        "axis_size",
        "AxisNames",
        "bounds_from_last_device",
        "composite_rules",
        "corrected_spec",
        "create_hybrid_mesh",
        "create_mesh",
        "create_pattern_based_partition_spec",
        "current_mesh",
        "DataLayout",
        "default_mesh",
        "explain_partition_rules",
        "extract_sharding_structure",
        "extract_shardings",
        "flatten_tree",
        "gather",
        "get_coords",
        "get_cpu_mesh",
        "get_gpu_mesh",
        "get_jax_mesh",
        "get_logical_axis_rules",
        "get_mesh",
        "get_mesh_axis_names",
        "get_metrics",
        "get_names_from_partition_spec",
        "get_partition_spec",
        "get_weight_decay_mask",
        "HardwareMesh",
        "iter_gather",
        "LocalChunker",
        "LocalChunkInfo",
        "logical_axis_rules",
        "logical_to_mesh_axes",
        "logical_to_mesh_specs",
        "make_shard_and_gather_fns",
        "match_partition_rules",
        "mesh_axis_size",
        "named_shardings",
        "named_tree_map",
        "names_in_current_mesh",
        "pad_to_multiple",
        "PartitionedFn",
        "Partitioner",
        "RngFunction",
        "round_up_to_multiple",
        "RulesReport",
        "RulesReportRow",
        "set_logical_axis_rules",
        "shard",
        "ShardingProblem",
        "ShardingReport",
        "ShardingRow",
        "standard_logical_axis_rules",
        "tree_apply",
        "tree_path_to_string",
        "unflatten_tree",
        "with_sharding_constraint",
        "wrap_function_with_rng",
    }
)
# Root names of 0.1.0 that were renamed at the root: old -> new.
RENAMED_ROOT: dict[str, str] = {"composite_rules": "composite_axis_rules"}


def moved_table(
    namespaces: Mapping[str, Iterable[str]], root: Iterable[str]
) -> dict[str, str]:
    """Old root name -> where it lives now, for `eqshard.__getattr__`: each root
    name of 0.1.0 that is no longer at the `root` but in a namespace's `__all__`
    (`{"eqshard.t5x": t5x.__all__, ...}`), and the renamed ones."""
    gone = RELEASED_ROOT - set(root)
    table = {
        name: f"{namespace}.{name}"
        for namespace, names in namespaces.items()
        for name in sorted(gone & set(names))
    }
    for old, new in RENAMED_ROOT.items():
        table[old] = f"eqshard.{new}"
    return table


def moved(name: str, table: Mapping[str, str]) -> Any:
    """The object an old root `name` stands for in `table` (`moved_table`), after
    warning where it went; `AttributeError` for a name that never was eqshard's."""
    new = table.get(name)
    if new is None:
        raise AttributeError(f"module 'eqshard' has no attribute {name!r}")
    module, _, attribute = new.rpartition(".")
    value = getattr(importlib.import_module(module), attribute)
    # `from eqshard import X` asks twice, the import system first: warn once, at
    # the line of the import.
    caller = outside_caller()
    if caller.f_globals.get("__name__", "").startswith(_IMPORT_SYSTEM):
        return value
    warn(
        f"eqshard.{name} is now {new}; use that name (the old one goes in "
        "eqshard 0.3).",
        DeprecationWarning,
    )
    return value


def renamed_attribute(owner: str, old: str, new: str) -> None:
    """Warns that the attribute `old` of `owner` is now `new`."""
    warn(
        f"eqshard.{owner}.{old} is now `{new}`; use that name (the old one goes in "
        "eqshard 0.3).",
        DeprecationWarning,
    )


def _value(value: Any) -> str:
    """An option's value as the docs write it: `"warn"`, `False`."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _renamed(caller: str, old: str, new: str) -> None:
    """Warns that `old` (a keyword, or a keyword with its value) is now `new`."""
    warn(
        f"eqshard.{caller}: {old} is now {new}; use that (the old spelling goes in "
        "eqshard 0.3).",
        DeprecationWarning,
    )


def renamed_keywords(
    caller: str, **renames: str | tuple[str, Mapping[Any, str]]
) -> Callable[[_F], _F]:
    """Decorator: each old keyword in `renames` is passed on as the new one, with a
    `DeprecationWarning`; both at once is eqshard's `TypeError`. A rename is
    `old="new"`, or `old=("new", {old_value: new_value})` where the values were
    renamed too (`strict=("on_invalid", {True: "raise", False: "ignore"})`)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, rename in renames.items():
                if old not in kwargs:
                    continue
                new, values = (rename, None) if isinstance(rename, str) else rename
                if new in kwargs:
                    raise TypeError(
                        f"eqshard.{caller}: got both `{old}` and `{new}`; `{old}` is "
                        f"the old name of `{new}`: pass `{new}` only."
                    )
                value = kwargs.pop(old)
                if values is None:
                    _renamed(caller, f"the keyword `{old}`", f"`{new}`")
                else:
                    mapped = values.get(value, value)
                    _renamed(
                        caller,
                        f"`{old}={_value(value)}`",
                        f"`{new}={_value(mapped)}`",
                    )
                    value = mapped
                kwargs[new] = value
            return fn(*args, **kwargs)

        return cast(_F, wrapper)

    return decorate


def renamed_literals(caller: str, keyword: str, **renames: str) -> Callable[[_F], _F]:
    """Decorator: each old value of the option `keyword` in `renames` (old -> new)
    is passed on as the new one, with a `DeprecationWarning`."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = kwargs.get(keyword)
            if isinstance(value, str) and value in renames:
                new = renames[value]
                _renamed(
                    caller, f"`{keyword}={_value(value)}`", f"`{keyword}={_value(new)}`"
                )
                kwargs[keyword] = new
            return fn(*args, **kwargs)

        return cast(_F, wrapper)

    return decorate
