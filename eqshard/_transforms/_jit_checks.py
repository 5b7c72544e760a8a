"""What `JitFunction` (`_jit.py`) checks before a call runs, and the messages it
raises: arguments whose structure `in_specs` does not fit (`argument_pairs`),
arrays whose sharding cannot apply, arguments without data, donations that XLA
would crash the process on, non-array leaves that cannot be hashed; and, after
JAX refused a call, the argument placed otherwise than its spec asks
(`check_placements`).

`Donation` is the front ends' donation strategy (`filter_jit`'s Equinox options,
`t5x.PartitionedFn`'s `donate_argnums`). Errors raised while the function is
traced are marked (`mark_traced`), so that a call tells them from JAX's errors
before tracing without reading their text.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import NamedSharding

from .._internals.cpu import buffer_address
from .._internals.routes import Unrecognised
from .._mesh._current import mesh_repr
from .._spectree._check_spec import check_leaves, is_spec_leaf, spec_error_message
from .._tree import (
    broadcast_prefix,
    deleted_error,
    is_array,
    is_deleted,
    path_str,
    paths_text,
    repeated_arrays,
)
from .._typing import KeyPath
from ._jit_keys import typed


ARGS_NOTE = (
    "Paths start with the index of the argument among the non-static positional "
    "arguments."
)


@dataclasses.dataclass(frozen=True)
class Donation:
    """Which arguments a function donates: those at `positions` (among all the
    positional arguments, as `jax.jit`'s `donate_argnums`), or every non-static one
    from the non-static position `start` on. `text` names the option in messages;
    `quiet` silences JAX's warning about buffers no output could reuse."""

    positions: frozenset[int] = frozenset()
    start: int | None = None
    text: str = ""
    quiet: bool = False


def check_shapes(
    paths: Sequence[KeyPath],
    leaves: Sequence[Any],
    shardings: Sequence[NamedSharding | None],
    caller: str,
) -> None:
    """Raises the eqshard message for every array whose sharding cannot apply."""
    problems = check_leaves(list(zip(paths, shardings, strict=True)), leaves, None)
    if problems:
        raise ValueError(spec_error_message(caller, problems))


def argument_pairs(
    caller: str, dynamic: Any, in_shardings: Any
) -> list[tuple[KeyPath, Any]]:
    """One `(path, sharding)` pair per leaf of the non-static arguments `dynamic`;
    a structure that `in_specs` does not fit raises naming the first path."""
    try:
        return broadcast_prefix(
            in_shardings, dynamic, is_leaf=is_spec_leaf, name="in_specs", caller=caller
        )
    except ValueError as e:
        raise ValueError(
            f"{e} Here `tree` is the tuple of non-static positional arguments: "
            "give `in_specs` one entry per argument (wrap a single argument's "
            f"spec tree in a 1-tuple), or one spec for all. {ARGS_NOTE}"
        ) from None


def mark_traced(error: BaseException) -> None:
    """Marks `error` as raised while the function was traced (by eqshard's checks
    or the function itself): not JAX's, before tracing, about the arguments."""
    try:
        error.__eqshard_traced__ = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type without a `__dict__`
        pass


def is_traced(error: BaseException) -> bool:
    """Whether `error` was raised while the function was traced."""
    return getattr(error, "__eqshard_traced__", False)


def first_buffer(leaf: jax.Array) -> int | None:
    """Where the first addressable shard of a placed array lies in memory (two
    arrays over the same buffers share it); `None` if there is none here."""
    try:
        return buffer_address(leaf, 0)
    except (IndexError, RuntimeError, Unrecognised):
        return None


def abstract_error(caller: str, name: str, paths: Sequence[KeyPath]) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: {name} is called with "
        f"`jax.ShapeDtypeStruct` arguments at {paths_text(paths)}, which have "
        "no data to run on. Pass arrays; for abstract arguments use "
        f"`{name}.lower(...)` (or `.compile(...)`), or "
        f"`eqshard.analyze_step`. {ARGS_NOTE}"
    )


def check_runnable(
    caller: str,
    name: str,
    donation: Donation,
    paths: Sequence[KeyPath],
    leaves: Sequence[Any],
    donated: Sequence[bool],
) -> None:
    """Raises for arguments a call cannot run with: arrays without data, and
    donations that would crash the process (`check_donation`)."""
    abstract = [
        path
        for path, leaf in zip(paths, leaves, strict=True)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if abstract:
        raise abstract_error(caller, name, abstract)
    if any(donated):
        check_donation(caller, name, donation, leaves, paths, donated)


def check_donation(
    caller: str,
    name: str,
    donation: Donation,
    leaves: Sequence[Any],
    paths: Sequence[KeyPath],
    donated: Sequence[bool],
) -> None:
    """Raises before a donation that XLA would crash the process on: a
    deleted array (donated by an earlier call), one array at two leaves of
    which one is donated, or two donated arrays over the same buffers."""
    gone = [path for path, leaf in zip(paths, leaves, strict=True) if is_deleted(leaf)]
    if gone:
        raise ValueError(f"{deleted_error(caller, gone)} {ARGS_NOTE}")
    for first, again in repeated_arrays(leaves):
        if donated[first] or donated[again]:
            raise ValueError(
                f"eqshard.{caller}: {name} is given one array at "
                f"both '{path_str(paths[first])}' and '{path_str(paths[again])}', "
                f"and {donation.text} donates it: its buffer cannot be given "
                "away and used in the same call. Pass a copy (`jnp.copy(x)`) at "
                f"one of them, or do not donate that argument. {ARGS_NOTE}"
            )
    # Only among the donated leaves (to keep calls cheap): two array objects
    # over the same buffers (e.g. rebuilt from another's shards).
    seen: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        if (
            not donated[i]
            or not isinstance(leaf, jax.Array)
            or isinstance(leaf, Tracer)
        ):
            continue
        buffer = first_buffer(leaf)
        if buffer is None:
            continue
        j = seen.setdefault(buffer, i)
        if j != i and leaves[j] is not leaf:
            raise ValueError(
                f"eqshard.{caller}: {name} is given two arrays at "
                f"'{path_str(paths[j])}' and '{path_str(paths[i])}' that share "
                f"their buffers, and {donation.text} donates both: one "
                "buffer cannot be given away twice. Pass a copy (`jnp.copy(x)`) "
                f"at one of them, or do not donate those arguments. {ARGS_NOTE}"
            )


def check_placements(
    caller: str, place_hint: str, dynamic: Any, in_shardings: Any, error: Exception
) -> None:
    """Raises eqshard's message in place of JAX's `error`, raised before tracing,
    if an argument's spec cannot apply or the argument is placed otherwise than
    its sharding in `in_shardings` asks (`place_hint`: what to place it with)."""
    try:
        pairs = argument_pairs(caller, dynamic, in_shardings)
    except ValueError:
        return
    paths = [path for path, _ in pairs]
    leaves = jtu.tree_leaves(dynamic)
    shardings = [sharding for _, sharding in pairs]
    try:
        check_shapes(paths, leaves, shardings, f"{caller} (in_specs)")
    except ValueError as ours:
        raise ours from error
    for path, leaf, sharding in zip(paths, leaves, shardings, strict=True):
        if (
            isinstance(leaf, jax.Array)
            and leaf.committed
            and sharding is not None
            and not leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        ):
            raise ValueError(
                f"eqshard.{caller}: the argument at '{path_str(path)}' is "
                f"already placed with {leaf.sharding}, but `in_specs` asks for "
                f"{sharding.spec} on mesh {mesh_repr(sharding.mesh)}; jax.jit "
                f"does not move placed arrays. Place it first with "
                f"{place_hint}, or change its spec. " + ARGS_NOTE
            ) from error


def deleted_arguments_error(
    caller: str, dynamic: Any, error: Exception
) -> ValueError | None:
    """eqshard's message for JAX's "Array has been deleted" (which names none),
    if an argument is deleted."""
    paths = [p for p, x in jtu.tree_flatten_with_path(dynamic)[0] if is_deleted(x)]
    if not paths:
        return None
    failure = ValueError(f"{deleted_error(caller, paths)} {ARGS_NOTE}")
    failure.__cause__ = error
    return failure


def unhashable_error(
    caller: str,
    static_argnums: tuple[int, ...],
    pairs: Sequence[tuple[KeyPath, Any]],
    static_args: tuple[Any, ...],
) -> TypeError:
    """The message for the first of the non-array leaves `pairs` that cannot be
    hashed, else for the static arguments."""
    for path, value in pairs:
        try:
            hash(typed(value))
        except TypeError:
            return TypeError(
                f"eqshard.{caller}: the argument leaf at "
                f"'{path_str(path)}' is {value!r} (a "
                f"{type(value).__name__}), which is neither an array nor "
                "hashable. Non-array leaves are compiled into the function, "
                "so they must be hashable: make it an array, or hashable."
            )
    return TypeError(
        f"eqshard.{caller}: the static arguments {static_args!r} "
        f"(positions {static_argnums}) must be hashable."
    )


def non_array_pairs(dynamic: Any) -> list[tuple[KeyPath, Any]]:
    """Every non-array leaf of `dynamic`, with its path."""
    return [
        (path, leaf)
        for path, leaf in jtu.tree_flatten_with_path(dynamic)[0]
        if not is_array(leaf)
    ]


def keywords_error(caller: str, name: str, kwargs: dict[str, Any]) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: {name} is called with the keyword "
        f"arguments {', '.join(map(repr, sorted(kwargs)))}; pass them "
        "positionally: `in_specs`, `out_specs` and donation count positional "
        "arguments."
    )
