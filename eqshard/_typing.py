"""Type aliases and the one runtime type-checking decorator used by eqshard."""

from collections.abc import Callable
from typing import Any, TYPE_CHECKING, TypeAlias

import jax.tree_util as jtu
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

# `jax.tree_util.PyTreeDef`, for annotations. jaxlib ships no type stubs for its
# compiled `pytree` module, so to a type checker JAX's name is a variable of unknown
# type, which an annotation cannot use.
if TYPE_CHECKING:
    PyTreeDef: TypeAlias = Any
else:
    PyTreeDef = jtu.PyTreeDef
