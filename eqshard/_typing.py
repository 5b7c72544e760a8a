"""Type aliases and the one runtime type-checking decorator used by eqshard."""

from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import numpy as np
from beartype import beartype
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import jaxtyped


# Every public function carries `@typecheck`. It checks the annotations with
# beartype at call time; `JAXTYPING_DISABLE=1` turns it into a pass-through.
typecheck = jaxtyped(typechecker=beartype)

# What eqshard counts as an array: concrete JAX and NumPy arrays, and the
# abstract `jax.ShapeDtypeStruct` used to plan without allocating.
ArrayOrStruct: TypeAlias = jax.Array | np.ndarray | jax.ShapeDtypeStruct

# A leaf of a spec tree.
SpecLeaf: TypeAlias = PartitionSpec | NamedSharding | None

# A path key as produced by `jax.tree_util` (DictKey, SequenceKey, ...).
KeyPath: TypeAlias = tuple[Any, ...]

IsLeaf: TypeAlias = Callable[[Any], bool] | None
