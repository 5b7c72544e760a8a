"""JAX's and XLA's errors, recognised by their text or class name.

JAX does not export every error's class (`ShardingTypeError` lives in
`jax._src.core`) and tells some failures apart only in the message, so eqshard
knows them by name or by words. Each recogniser is one predicate here; the
words are JAX's or XLA's of the installed version. Nothing outside this package
matches on an error's text or class name (`tests/test_architecture.py` checks).
"""

# JAX's words when a dict's keys cannot be sorted to flatten it.
_UNSORTABLE = "Comparator raised exception while sorting pytree dictionary keys"

# JAX's words for an operation mixing arrays typed on another mesh (the Explicit
# one) with the Auto axes `auto_axes` sets.
_MIXED_MESHES = "should match the aval mesh"


def is_sharding_type_error(error: BaseException) -> bool:
    """Whether `error` is JAX's error on an operation whose result's sharding is
    ambiguous on Explicit axes (its class is private to JAX: known by name)."""
    return type(error).__name__ == "ShardingTypeError"


def is_mixed_meshes(error: BaseException) -> bool:
    """Whether `error` is JAX's on arrays typed on another mesh than the one an
    operation runs on."""
    return _MIXED_MESHES in str(error)


def is_resource_exhausted(error: BaseException) -> bool:
    """Whether `error` is XLA's refusal of a program that does not fit a device."""
    return str(error).startswith("RESOURCE_EXHAUSTED")


def is_unsortable_keys(error: BaseException) -> bool:
    """Whether `error` is JAX's on flattening a dict whose keys it cannot sort
    (keys of several types)."""
    return _UNSORTABLE in str(error)
