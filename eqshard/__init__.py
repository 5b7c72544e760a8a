"""eqshard: functional, typed, filtered pytree sharding for JAX and Equinox."""

import importlib.metadata


__version__ = importlib.metadata.version("eqshard")
from ._tree import (
    flatten_tree as flatten_tree,
    get_names_from_partition_spec as get_names_from_partition_spec,
    named_tree_map as named_tree_map,
    tree_apply as tree_apply,
    tree_path_to_string as tree_path_to_string,
    unflatten_tree as unflatten_tree,
)
