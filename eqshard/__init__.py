"""eqshard: functional, typed, filtered pytree sharding for JAX and Equinox.

The root holds the everyday path: meshes, trees and paths, partition rules and
logical axis names, the spec-tree family, shard/gather/constraint/init,
checkpoints, and the readers and plans. Families of their own live in
namespaces: `eqshard.t5x` (t5x's partitioner, data layout and hardware meshes)
and `eqshard.compat` (fjformer's and eformer's odds and ends).

The base modules, which every wing reads: `_typing.py` (type aliases,
`@typecheck`, `warn`), `_tree.py` (leaves named by path, prefix trees, the
messages listing paths) and `_tree_utils.py` (the public tree utilities),
`_keys.py` (typed PRNG keys on host), `_report.py` (what every report shares),
`_caches.py` (the registry of caches, `clear_caches`) and `_deprecated.py` (old
names kept for one release). `__main__.py` runs the command (`_cli`). Each wing's
`__init__.py` names its own modules (`tests/test_architecture.py` checks).
"""

from importlib.metadata import version as _version
from typing import Any as _Any

from . import compat as compat, t5x as t5x
from ._build._init import init_sharded as init_sharded
from ._caches import clear_caches as clear_caches
from ._checkpoint import (
    load_safetensors as load_safetensors,
    restore as restore,
    save as save,
    save_safetensors as save_safetensors,
)
from ._deprecated import moved as _moved, moved_table as _moved_table
from ._keys import HostKey as HostKey
from ._mesh._build import (
    create_hybrid_mesh as create_hybrid_mesh,
    create_mesh as create_mesh,
)
from ._mesh._current import (
    axis_index as axis_index,
    axis_size as axis_size,
    current_mesh as current_mesh,
    mesh_axis_size as mesh_axis_size,
)
from ._move._gather import gather as gather, iter_gather as iter_gather
from ._move._shard import named_shardings as named_shardings, shard as shard
from ._move._shard_plan import (
    shard_plan as shard_plan,
    ShardPlan as ShardPlan,
    ShardPlanRow as ShardPlanRow,
)
from ._readers._inspect import (
    extract_shardings as extract_shardings,
    get_partition_spec as get_partition_spec,
    ShardingReport as ShardingReport,
    ShardingRow as ShardingRow,
)
from ._readers._layout import (
    check_layout as check_layout,
    LayoutError as LayoutError,
    LayoutMismatch as LayoutMismatch,
    LayoutReport as LayoutReport,
)
from ._readers._plan import plan_training as plan_training, TrainingPlan as TrainingPlan
from ._readers._strategy import (
    analyze_sharding_strategy as analyze_sharding_strategy,
)
from ._search._report import (
    LayoutCandidate as LayoutCandidate,
    LayoutSearch as LayoutSearch,
)
from ._search._search import search_layout as search_layout
from ._spectree._auto import auto_fsdp as auto_fsdp, AutoFSDP as AutoFSDP
from ._spectree._check_spec import ShardingProblem as ShardingProblem
from ._spectree._derive import (
    abstract as abstract,
    derive_specs as derive_specs,
    restrict_specs as restrict_specs,
    stack_specs as stack_specs,
)
from ._spectree._logical import (
    AxisNames as AxisNames,
    get_logical_axis_rules as get_logical_axis_rules,
    logical_axis_rules as logical_axis_rules,
    set_logical_axis_rules as set_logical_axis_rules,
)
from ._spectree._logical_convert import (
    composite_axis_rules as composite_axis_rules,
    declared_axis_names as declared_axis_names,
    logical_to_mesh_axes as logical_to_mesh_axes,
    logical_to_mesh_specs as logical_to_mesh_specs,
)
from ._spectree._memory import Host as Host, host as host
from ._spectree._rules import match_partition_rules as match_partition_rules
from ._spectree._rules_report import (
    explain_partition_rules as explain_partition_rules,
    RulesReport as RulesReport,
    RulesReportRow as RulesReportRow,
)
from ._spectree._stacked import Stacked as Stacked, stacked as stacked
from ._step._report import StepReport as StepReport
from ._step._step import analyze_step as analyze_step
from ._step._time import (
    StepTime as StepTime,
    transformer_flops as transformer_flops,
)
from ._transforms._attention import dot_product_attention as dot_product_attention
from ._transforms._attention_module import (
    ContextParallelAttention as ContextParallelAttention,
)
from ._transforms._balance import (
    balance_sequence as balance_sequence,
    unbalance_sequence as unbalance_sequence,
)
from ._transforms._constraint import (
    corrected_spec as corrected_spec,
    with_sharding_constraint as with_sharding_constraint,
)
from ._transforms._explicit import auto_axes as auto_axes
from ._transforms._filter_jit import filter_jit as filter_jit
from ._transforms._pipeline import pipeline as pipeline
from ._transforms._shard_map import filter_shard_map as filter_shard_map
from ._transforms._stack_layers import (
    stack_layers as stack_layers,
    unstack_layers as unstack_layers,
)
from ._transforms._stage_view import (
    stage_view as stage_view,
    unstage_view as unstage_view,
)
from ._tree import is_array as is_array, tree_path_to_string as tree_path_to_string
from ._tree_utils import (
    flatten_tree as flatten_tree,
    named_tree_map as named_tree_map,
    tree_apply as tree_apply,
    unflatten_tree as unflatten_tree,
)


__version__ = _version("eqshard")

# What a user calls. The classes these return (`ShardingReport`, `ShardingRow`,
# `ShardingProblem`, `RulesReport`, `RulesReportRow`, `TrainingPlan`,
# `LayoutReport`, `LayoutMismatch`, `LayoutError`, `StepReport`, `LayoutSearch`,
# `LayoutCandidate`, `StepTime`, `ShardPlan`, `ShardPlanRow`, `AutoFSDP`, `Stacked`,
# `Host`, `HostKey`) are importable from here too, and documented with their
# functions.
__all__ = [
    # Meshes.
    "create_mesh",
    "create_hybrid_mesh",
    "current_mesh",
    "mesh_axis_size",
    "axis_size",
    "axis_index",
    # Trees and paths.
    "is_array",
    "tree_path_to_string",
    "flatten_tree",
    "unflatten_tree",
    "named_tree_map",
    "tree_apply",
    # Partition rules.
    "match_partition_rules",
    "explain_partition_rules",
    "auto_fsdp",
    "stacked",
    "host",
    # Logical axis names.
    "AxisNames",
    "logical_axis_rules",
    "set_logical_axis_rules",
    "get_logical_axis_rules",
    "logical_to_mesh_axes",
    "logical_to_mesh_specs",
    "composite_axis_rules",
    "declared_axis_names",
    # Spec trees.
    "abstract",
    "derive_specs",
    "stack_specs",
    "restrict_specs",
    # Shard, gather, constrain, initialise.
    "shard",
    "shard_plan",
    "gather",
    "iter_gather",
    "init_sharded",
    "clear_caches",
    "with_sharding_constraint",
    "auto_axes",
    "corrected_spec",
    "named_shardings",
    "filter_shard_map",
    "pipeline",
    "stage_view",
    "unstage_view",
    "stack_layers",
    "unstack_layers",
    "dot_product_attention",
    "balance_sequence",
    "unbalance_sequence",
    "ContextParallelAttention",
    # Checkpoints.
    "save",
    "restore",
    "load_safetensors",
    "save_safetensors",
    # Readers and plans.
    "check_layout",
    "plan_training",
    "analyze_sharding_strategy",
    "get_partition_spec",
    "extract_shardings",
    # The compiled step.
    "filter_jit",
    "analyze_step",
    "search_layout",
    "transformer_flops",
]


# The root names of 0.1.0 that moved to `eqshard.t5x` and `eqshard.compat`, or were
# renamed, in 0.2: old name -> new one, served for one release by `__getattr__`.
_MOVED = _moved_table(
    {"eqshard.t5x": t5x.__all__, "eqshard.compat": compat.__all__}, __all__
)


def __getattr__(name: str) -> _Any:
    # Each old name warns, naming its new home (PEP 562).
    return _moved(name, _MOVED)
