"""fjformer's and eformer's odds and ends, under their own names.

Code ported from fjformer's `partition_utils` or eformer's `escale` finds here
the helpers that are not eqshard's everyday path. `_patterns.py` turns
fjformer's pattern strings into partition rules, which go through the spec-tree
wing like any others, and makes weight-decay masks from paths;
`_misc.py` holds metrics for logging, PRNG keys threaded through calls, padding,
and `make_shard_and_gather_fns` (per-leaf functions over `shard` and `gather`);
fjformer's mesh strings and a few readers of meshes and specs are re-exported
from the base modules and the readers. Each is documented with its everyday
counterpart at the root of `eqshard` where there is one (for example
[`eqshard.create_mesh`][] takes the mesh strings of
[`eqshard.compat.get_jax_mesh`][]).
"""

from .._mesh._build import get_jax_mesh as get_jax_mesh
from .._mesh._current import (
    get_mesh_axis_names as get_mesh_axis_names,
    names_in_current_mesh as names_in_current_mesh,
)
from .._readers._inspect import (
    extract_sharding_structure as extract_sharding_structure,
)
from .._tree_utils import (
    get_names_from_partition_spec as get_names_from_partition_spec,
)
from ._misc import (
    get_metrics as get_metrics,
    make_shard_and_gather_fns as make_shard_and_gather_fns,
    pad_to_multiple as pad_to_multiple,
    RngFunction as RngFunction,
    round_up_to_multiple as round_up_to_multiple,
    wrap_function_with_rng as wrap_function_with_rng,
)
from ._patterns import (
    create_pattern_based_partition_spec as create_pattern_based_partition_spec,
    get_weight_decay_mask as get_weight_decay_mask,
)


__all__ = [
    "get_metrics",
    "wrap_function_with_rng",
    "RngFunction",
    "pad_to_multiple",
    "round_up_to_multiple",
    "get_weight_decay_mask",
    "get_jax_mesh",
    "create_pattern_based_partition_spec",
    "make_shard_and_gather_fns",
    "get_names_from_partition_spec",
    "names_in_current_mesh",
    "get_mesh_axis_names",
    "extract_sharding_structure",
]
