"""Type aliases and the one runtime type-checking decorator used by eqshard."""

from collections.abc import Callable
from typing import Any, TypeAlias

from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import jaxtyped


# Every public function carries `@typecheck`. It checks the annotations with
# beartype at call time; `JAXTYPING_DISABLE=1` turns it into a pass-through.
typecheck = jaxtyped(typechecker=beartype)

# A leaf of a spec tree.
SpecLeaf: TypeAlias = PartitionSpec | NamedSharding | None

# A key path as produced by `jax.tree_util`: a tuple of keys (DictKey, SequenceKey,
# GetAttrKey, ...).
KeyPath: TypeAlias = tuple[Any, ...]

# The `is_leaf` argument of `jax.tree_util` functions.
IsLeaf: TypeAlias = Callable[[Any], bool] | None
