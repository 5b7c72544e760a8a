"""Type aliases and the one runtime type-checking decorator used by eqshard."""

import collections
import collections.abc
import functools
import inspect
import re
import sys
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, Literal, TYPE_CHECKING, TypeAlias, TypeVar

import jax.tree_util as jtu
import numpy as np
from beartype import beartype
from beartype.door import is_bearable
from beartype.roar import BeartypeCallHintParamViolation, BeartypeException
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import (
    AbstractArray,
    config as jaxtyping_config,
    jaxtyped,
    TypeCheckError,
)

from ._internals.errors import is_unsortable_keys


_F = TypeVar("_F", bound=Callable[..., Any])


def typecheck(fn: _F) -> _F:
    """The decorator of every public function: its annotations checked with
    beartype at call time (`JAXTYPING_DISABLE=1` turns that off), an argument
    of the wrong type reported in one line (the function, the argument, what
    was given and what is expected) rather than as beartype's or jaxtyping's
    dump of the whole call, and two mistakes that would otherwise surface in
    beartype's or JAX's words, whatever the function, reported as eqshard's, in
    the function's name: a `mesh` argument that is not a mesh, and a dict whose
    keys JAX cannot sort (keys of several types), named by its path.

    `beartype(fn)` checks the arguments and the return value once per call;
    `jaxtyped(typechecker=beartype)` also binds the arguments to the signature,
    records array dimensions and checks the arguments again with the return
    value (several times beartype's own cost), so it is kept only for the
    functions whose annotations name jaxtyping's arrays (`Float[Array, "n"]`),
    whose dimensions must agree across arguments."""
    checked = _checker(fn)
    caller = fn.__qualname__
    signature = inspect.signature(fn)
    parameters = signature.parameters
    # How beartype's message on this function's own arguments begins, and how the
    # first line of jaxtyping's ends (also on the return value, which it checks
    # with the arguments).
    where = f"{fn.__module__}.{fn.__qualname__}"
    own = (f" {where}() parameter ", f" of {where}.")
    names = list(parameters)
    takes_mesh = "mesh" in parameters
    # Where `mesh` is among the positional arguments, if it can be one.
    at = names.index("mesh") if takes_mesh else None
    if takes_mesh and parameters["mesh"].kind is inspect.Parameter.KEYWORD_ONLY:
        at = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if takes_mesh:
            mesh = args[at] if at is not None and at < len(args) else None
            mesh = kwargs.get("mesh", mesh)
            if mesh is not None and not isinstance(mesh, _MESHES):
                raise _mesh_type_error(caller, mesh)
        try:
            if jaxtyping_config.jaxtyping_disable:
                return fn(*args, **kwargs)
            return checked(*args, **kwargs)
        except (BeartypeCallHintParamViolation, TypeCheckError) as error:
            found = _argument_type_error(caller, own, signature, args, kwargs, error)
            if found is None:
                raise
            raise found from None
        except ValueError as error:
            if not is_unsortable_keys(error):
                raise
            found = _unsortable_dict_error(caller, names, args, kwargs)
            if found is None:
                raise
            raise found from error

    return typing.cast(_F, wrapper)


def _checker(fn: _F) -> _F:
    """`fn` with its annotations checked at call time: by beartype alone, or
    within jaxtyping's `jaxtyped` where an annotation names jaxtyping's arrays
    (whose dimensions it records across the arguments)."""
    try:
        hints = typing.get_type_hints(fn, include_extras=True).values()
    except (NameError, TypeError):  # jaxtyping reads what it can of them
        return jaxtyped(typechecker=beartype)(fn)
    if any(_names_arrays(hint) for hint in hints):
        return jaxtyped(typechecker=beartype)(fn)
    return beartype(fn)


def _names_arrays(hint: Any) -> bool:
    """Whether `hint` names a jaxtyping array (`Float[Array, "n"]`), in it or in
    one of its members."""
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return True
    return any(_names_arrays(member) for member in typing.get_args(hint))


_MESHES = (Mesh, AbstractMesh)


def _argument_type_error(
    caller: str,
    own: tuple[str, str],
    signature: inspect.Signature,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    error: BeartypeCallHintParamViolation | TypeCheckError,
) -> TypeError | None:
    """beartype's or jaxtyping's error on one of `caller`'s own arguments, in one
    line: the argument, what was given and what its annotation expects (`None`
    for any other error, such as one raised inside the function). `own`: how
    the first line of beartype's message on them reads in its middle
    (`" module.name() parameter "`), and how jaxtyping's ends."""
    text = str(error)
    first = text.split("\n", 1)[0]
    if isinstance(error, BeartypeCallHintParamViolation):
        named = re.search(r"\(\) parameter (\w+)=", first)
        if own[0] not in first or not first.startswith(("Function ", "Method ")):
            return None
    else:
        named = re.search(r"typechecking parameter '(\w+)'", text)
        if not first.endswith(own[1]):
            return None
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    if named is not None:
        name: str | None = named.group(1)
    else:  # jaxtyping could not tell which (beartype checks one item of a list,
        # another each time), or blamed the return value checked with them
        name = next(
            (
                n
                for n, value in bound.items()
                if signature.parameters[n].kind not in _VARIADIC
                and not _fits(value, signature.parameters[n].annotation)
            ),
            None,
        )
    if name is None or name not in bound or name not in signature.parameters:
        return None
    value = bound[name]
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    expected = type_text(signature.parameters[name].annotation)
    return TypeError(
        f"eqshard.{caller}: `{name}` is {shown} ({type(value).__name__}); "
        f"expected {expected}."
    )


def _fits(value: Any, annotation: Any) -> bool:
    """Whether `value` fits `annotation`, every item of a sequence or mapping
    checked (beartype checks one); what this cannot read, beartype judges."""
    origin, members = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return any(_fits(value, m) for m in members)
    if origin is Literal:
        return value in members
    if origin in (list, tuple, collections.abc.Sequence) and len(members) == 1:
        return isinstance(value, origin) and all(_fits(x, members[0]) for x in value)
    if origin in (dict, collections.abc.Mapping) and len(members) == 2:
        return isinstance(value, origin) and all(
            _fits(k, members[0]) and _fits(v, members[1]) for k, v in value.items()
        )
    try:
        return bool(is_bearable(value, annotation))
    except (BeartypeException, TypeError, ValueError):
        return True  # an annotation beartype cannot check alone: not the culprit


_NUMPY_NAMES = {np.integer: "a NumPy integer", np.floating: "a NumPy float"}
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def type_text(annotation: Any) -> str:
    """An annotation as a person reads it: `int or None`, `a sequence of str`,
    `one of 'gpipe', 'circular'`."""
    if annotation is type(None) or annotation is None:
        return "None"
    origin, members = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        texts = list(dict.fromkeys(type_text(m) for m in members))
        return (
            ", ".join(texts[:-1]) + f" or {texts[-1]}" if len(texts) > 1 else texts[0]
        )
    if origin is Literal:
        return "one of " + ", ".join(repr(m) for m in members)
    if origin in (Sequence, list, tuple, collections.abc.Sequence) and members:
        return f"a sequence of {type_text(members[0])}"
    if origin in (Mapping, dict, collections.abc.Mapping) and len(members) == 2:
        return f"a mapping from {type_text(members[0])} to {type_text(members[1])}"
    if origin is not None:
        annotation = origin
    if annotation is Callable or annotation is collections.abc.Callable:
        return "a function"
    if isinstance(annotation, type):
        if annotation in _NUMPY_NAMES:
            return _NUMPY_NAMES[annotation]
        module = annotation.__module__.split(".")[0]
        prefix = {"numpy": "np.", "builtins": ""}.get(module, "")
        if module == "jax":
            prefix = "jax.sharding." if annotation in _MESHES + (AxisType,) else "jax."
        return prefix + annotation.__qualname__
    return str(annotation).replace("typing.", "")


def _mesh_type_error(caller: str, mesh: Any) -> TypeError:
    return TypeError(
        f"eqshard.{caller}: `mesh` is {mesh!r} ({type(mesh).__name__}), not a mesh. "
        "Pass a `jax.sharding.Mesh` (e.g. `eqshard.create_mesh((2, 4), ('dp', "
        "'tp'))`), an `AbstractMesh` where devices are not needed, or None for "
        "the mesh set by `jax.set_mesh`."
    )


def _is_unsortable(x: Any) -> bool:
    if type(x) not in (dict, collections.defaultdict):
        return False  # an OrderedDict keeps its order; other mappings are not nodes
    try:
        sorted(x)
    except TypeError:
        return True
    return False


def _unsortable_dict_error(
    caller: str, names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> ValueError | None:
    """The error naming the first dict in the arguments whose keys cannot be
    sorted (found by flattening only down to it), or `None` if there is none."""
    given = list(zip(names, args)) + list(kwargs.items())
    for name, value in given:
        leaves = jtu.tree_flatten_with_path(value, is_leaf=_is_unsortable)[0]
        for path, leaf in leaves:
            if not _is_unsortable(leaf):
                continue
            where = (
                f"the dict at '{jtu.keystr(path, simple=True, separator='/')}' in "
                f"`{name}`"
                if path
                else f"the dict `{name}`"
            )
            types = sorted({type(key).__name__ for key in leaf})
            return ValueError(
                f"eqshard.{caller}: {where} has keys of several types "
                f"({', '.join(types)}), which JAX cannot sort to flatten it. Give "
                "it keys of one type, e.g. strings: "
                "`{str(key): value for key, value in d.items()}`."
            )
    return None


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


# The `axis_types` of the mesh builders: one `AxisType` for every axis, one per
# axis, or `None` (every axis `Auto`).
AxisTypesArg: TypeAlias = AxisType | Sequence[AxisType] | None

# An integer argument: a Python or NumPy integer (`np.int64(7)` from a shape or a
# config works). Functions taking one convert it with `operator.index`.
Int: TypeAlias = int | np.integer

# Arguments whose values the function validates itself, with eqshard's error
# (naming the choices, or the first bad rule): type checkers see the precise type,
# the runtime check admits any value, so that beartype's error does not hide it.
# The choices of each, for `check_choice`, stand next to their `Literal`s. Two
# kinds of rules: partition rules (`rules=`, `(regex, spec)` pairs) and logical
# axis rules (`axis_rules=`, `(logical_name, mesh_axes)` pairs). `OnInvalid` is
# the one vocabulary for what to do when something does not fit: raise, or apply
# the documented fallback (correct, replicate, report) with or without a warning.
ON_INVALID = ("raise", "warn", "ignore")
CHECK_VALUES = ("sample", "full")
if TYPE_CHECKING:
    OnInvalid: TypeAlias = Literal["raise", "warn", "ignore"]
    CheckValues: TypeAlias = Literal["sample", "full"]
    PartitionRulesArg: TypeAlias = Sequence[Any]
    AxisRulesArg: TypeAlias = Sequence[Any]
    StackAxis: TypeAlias = str | tuple[str, ...] | None
else:
    OnInvalid = CheckValues = str
    PartitionRulesArg = AxisRulesArg = StackAxis = Any


def check_choice(value: Any, choices: Sequence[str], *, caller: str, name: str) -> None:
    """Raises eqshard's error unless the option `name` of `caller` is one of
    `choices`: checked whether type checks are on or not."""
    if not (isinstance(value, str) and value in choices):
        quoted = [f'"{choice}"' for choice in choices]
        listed = ", ".join(quoted[:-1]) + f" or {quoted[-1]}"
        raise ValueError(f"eqshard.{caller}: `{name}` is {value!r}; use {listed}.")


def sequence_fix(value: Any) -> str:
    """How to turn `value`, given where a sequence (of rules) is expected, into one."""
    if isinstance(value, Mapping):
        return (
            "For a dict, pass `list(rules.items())`: rules are pairs tried in "
            "order, and a name or regex may have several."
        )
    if isinstance(value, Iterator):
        return "Pass a list, e.g. `list(rules)`: a generator can be read only once."
    return "Pass a list of pairs."


# Modules whose frames stand between a user's call and an eqshard warning: eqshard
# itself and the type-check wrappers around its functions (`typecheck`, and
# jaxtyping's import hook in a test run that asks for it), whose depth depends on
# the configuration.
_INTERNAL = ("eqshard", "jaxtyping", "beartype")


def _internal(frame: FrameType) -> bool:
    module = frame.f_globals.get("__name__", "")
    return module.split(".")[0] in _INTERNAL or frame.f_code.co_filename.startswith(
        "<@beartype"
    )


def outside_caller() -> FrameType:
    """The frame of the first caller outside eqshard and the type-check wrappers."""
    frame = sys._getframe(1)
    while frame.f_back is not None and _internal(frame):
        frame = frame.f_back
    return frame


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn`, attributed to the first caller outside eqshard and the
    type-check wrappers (a fixed `stacklevel` pointed inside the wrapper)."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and _internal(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
