"""What both checkpoint formats share: the names of a tree's arrays, the
targets they are read into (shape, placed dtype, sharding), and the one message
for a checkpoint that does not match `like`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, Sharding
from jaxtyping import PyTree

from .._keys import is_key
from .._tree import (
    collision_message,
    grouped_paths,
    is_array,
    path_name,
    paths_text,
    placed_dtype,
)
from .._typing import KeyPath


def import_optional(module: str, extra: str, caller: str) -> Any:
    """The optional dependency `module`, or an `ImportError` saying how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ImportError(
            f"eqshard.{caller} needs the `{error.name}` package: "
            f'`pip install "eqshard[{extra}]"`.'
        ) from None


def named_arrays(
    tree: PyTree, caller: str, sep: str = "/"
) -> dict[str, tuple[int, KeyPath, Any]]:
    """`{name: (index, path, leaf)}` for the array leaves of `tree` (`index` in
    `jax.tree_util.tree_leaves(tree)`), named by their paths joined by `sep`; two
    arrays of one name are an error."""
    named: dict[str, tuple[int, KeyPath, Any]] = {}
    for i, (path, leaf) in enumerate(jtu.tree_flatten_with_path(tree)[0]):
        if not is_array(leaf):
            continue
        name = path_name(path, sep) or "<root>"
        if name in named:
            message = collision_message(name, named[name][1], path)
            raise ValueError(f"eqshard.{caller}: {message}")
        named[name] = (i, path, leaf)
    return named


def stored_like(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a leaf has in a checkpoint: a typed PRNG key's data, in
    native byte order."""
    if is_key(leaf):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(int(n) for n in leaf.shape), np.dtype(leaf.dtype).newbyteorder("=")


def abstract_target_error(
    caller: str, paths: list[KeyPath], mesh: AbstractMesh
) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: reads arrays onto devices, so it needs a concrete "
        f"`Mesh`, but the arrays at {paths_text(paths)} would go "
        f"on an abstract mesh ({mesh}). Pass a mesh of devices as `mesh` "
        "(`eqshard.create_mesh(...)`, or a `jax.sharding.Mesh`), and "
        "`PartitionSpec`s rather than `NamedSharding`s on an abstract mesh as "
        "`specs`."
    )


def target_structs(
    named: dict[str, tuple[int, KeyPath, Any]],
    placed: list[Any],
    casts: list[np.dtype | None],
    caller: str,
) -> dict[str, jax.ShapeDtypeStruct]:
    """A struct per name: the leaf's shape, the dtype JAX places (of its cast, or
    its own), and its sharding (that of its leaf in `placed`: the struct
    `abstract` made, or the leaf of `like` itself)."""
    targets = {}
    unplaced = []
    on_abstract = []
    for name, (i, path, leaf) in named.items():
        # A `None` spec keeps the leaf's own sharding.
        sharding = getattr(placed[i], "sharding", None) or getattr(
            leaf, "sharding", None
        )
        if not isinstance(sharding, Sharding):
            unplaced.append(path)
            continue
        if isinstance(sharding, NamedSharding) and not isinstance(sharding.mesh, Mesh):
            on_abstract.append((path, sharding.mesh))
            continue
        cast = casts[i]
        dtype = (
            leaf.dtype
            if is_key(leaf)
            else placed_dtype(np.dtype(leaf.dtype if cast is None else cast))
        )
        targets[name] = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)
    if on_abstract:
        paths = [path for path, _ in on_abstract]
        raise abstract_target_error(caller, paths, on_abstract[0][1])
    if unplaced:
        raise ValueError(
            f"eqshard.{caller}: no sharding for the arrays at "
            f"{paths_text(unplaced)}: `like` has NumPy arrays or "
            "structs without a sharding there, and `specs` gives none. Pass "
            "`specs` (and `mesh`), e.g. from `eqshard.match_partition_rules`."
        )
    return targets


def check_against(
    targets: dict[str, jax.ShapeDtypeStruct],
    named: dict[str, tuple[int, KeyPath, Any]],
    found: dict[str, tuple[tuple[int, ...], np.dtype]],
    casts: list[np.dtype | None],
    *,
    caller: str,
    where: str,
    fix: str,
    labels: dict[str, str] | None = None,
) -> None:
    """Raises one `ValueError` listing every name of `targets` missing from
    `found` (`{name: (shape, dtype)}` of what `where` holds), every name extra in
    it, and every one stored with another shape, or another dtype than `like`'s
    (unless both are placed as one, or a floating one is cast). `labels` add what
    a name is called in the files."""
    labels = labels or {}
    missing = [n for n in targets if n not in found]
    extra = [n for n in found if n not in targets]
    differ: list[tuple[str, str]] = []  # (name, what differs)
    for name in targets:
        if name not in found:
            continue
        i, _, leaf = named[name]
        shape, dtype = stored_like(leaf)
        saved_shape, saved_dtype = found[name]
        floating = jnp.issubdtype(saved_dtype, jnp.floating)
        if saved_shape != shape:
            differ.append((name, f"shape {saved_shape} there, {shape} in `like`."))
        elif not (
            placed_dtype(saved_dtype) == placed_dtype(dtype)
            or (casts[i] is not None and floating)
        ):
            hint = (
                " (pass `dtype=` to cast floating arrays)"
                if floating and jnp.issubdtype(dtype, jnp.floating)
                else ""
            )
            differ.append((name, f"{saved_dtype} there, {dtype} in `like`{hint}."))
    # An optimizer state's arrays share their parameter's line, where the same.
    names = [name for name, _ in differ]
    keys = [(what, labels.get(name)) for name, what in differ]
    lines = [
        f"  - '{names[g.leader]}'{g.suffix}{labels.get(names[g.leader], '')}: "
        f"{differ[g.leader][1]}"
        for g in grouped_paths(names, keys)
    ]
    if missing:
        lines.insert(0, f"  - in `like`, not there: {paths_text(missing)}.")
    if extra:
        named_extra = [f"{n}{labels.get(n, '')}" for n in extra]
        lines.insert(0, f"  - there, not in `like`: {paths_text(named_extra)}.")
    if lines:
        raise ValueError(
            "\n".join(
                [f"eqshard.{caller}: {where} does not match `like`:", *lines, fix]
            )
        )
