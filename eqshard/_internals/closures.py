"""What a function reads besides its arguments: its closure's variables, the
globals its code names, default values, a `functools.partial`'s arguments.

One walk finds it (`find_reads`). `init_sharded` and eager `filter_shard_map`
key the traces they keep by it (`reads_key`): a value read that has changed is
traced again, never served stale; and `init_sharded` looks among the same
values for the NumPy data its trace captured (to refuse data that JAX would
narrow with a loss, out of sight). The walk reads `__closure__`, `__globals__` and code
objects.
"""

import dataclasses
import enum
import functools as ft
import hashlib
import inspect
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax._src import config as jax_config
from jax.sharding import AbstractMesh, Mesh, PartitionSpec, Sharding


# Modules whose functions are not looked into (taken as they are).
_LIBRARIES = ("jax", "jaxlib", "numpy", "equinox", "eqshard", "optax", "builtins")


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a function reads besides its arguments, found by one walk
    (`find_reads`): `objects`, the functions, classes, partials and methods
    met, in order; `values`, each value read, by name (a list of arrays is one
    value; a callable object is a value too); `modules`, the names of modules
    of the user's that are read."""

    objects: tuple[Any, ...]
    values: tuple[tuple[str, Any], ...]
    modules: tuple[str, ...]


def find_reads(fn: Any) -> Reads:
    """What `fn` reads besides its arguments: its closure's variables, the
    globals its code names, default values, a `functools.partial`'s arguments,
    a bound method's object, a callable object's data, a class's constants; and
    so on through the functions and classes found there (not into those of JAX,
    NumPy, Equinox or eqshard, which are taken as they are)."""
    objects: list[Any] = []
    values: list[tuple[str, Any]] = []
    modules: list[str] = []
    seen: set[int] = set()
    todo: list[Any] = [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if not _is_followed(obj):  # a callable object: its data, then its class
            values.append((f"the called {type(obj).__name__}", obj))
            todo.append(type(obj))
            func = getattr(obj, "__func__", None)  # Equinox's bound methods
            if inspect.isfunction(func):
                todo.append(func)
            continue
        objects.append(obj)
        if _in_library(obj):
            continue
        if inspect.isclass(obj):
            values += _class_values(obj, todo)
        for name, value in _read_by(obj, todo):
            if _is_followed(value):
                todo.append(value)
            elif inspect.ismodule(value):
                if not _in_library(value):
                    modules.append(name)
            else:
                values.append((name, value))
    return Reads(tuple(objects), tuple(values), tuple(modules))


def _read_by(obj: Any, todo: list[Any]) -> list[tuple[str, Any]]:
    """What `obj` (a partial, a method, a class or a function) reads, by name;
    the functions to look into next go to `todo`."""
    values: list[tuple[str, Any]] = []
    if isinstance(obj, ft.partial):
        values += [
            (f"argument {n} bound to {_name(obj.func)}", v)
            for n, v in enumerate(obj.args)
        ]
        values += [
            (f"{name} bound to {_name(obj.func)}", v)
            for name, v in obj.keywords.items()
        ]
        todo.append(obj.func)
    elif inspect.ismethod(obj):
        values.append((f"self of {_name(obj)}", obj.__self__))
        todo.append(obj.__func__)
    elif inspect.isclass(obj):
        todo.extend(v for v in vars(obj).values() if inspect.isfunction(v))
    elif inspect.isfunction(obj):
        code = obj.__code__
        cells = obj.__closure__ or ()
        read = f"read by {obj.__qualname__}"
        values += [
            (f"{name} ({read})", cell.cell_contents)
            for name, cell in zip(code.co_freevars, cells, strict=True)
            if _filled(cell)
        ]
        values += [
            (f"{name} ({read})", obj.__globals__[name])
            for name in _names(code)
            if name in obj.__globals__
        ]
        defaults = [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
        values += [(f"a default of {obj.__qualname__}", v) for v in defaults]
    return values


def direct_reads(fn: Any) -> list[tuple[str, Any]]:
    """What `fn`'s own code reads besides its arguments, by name: its closure's
    filled variables, then the globals it names (one level, nothing followed)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or ())
    found = [(name, cell.cell_contents) for name, cell in cells if _filled(cell)]
    space = getattr(fn, "__globals__", {})
    return found + [(name, space[name]) for name in code.co_names if name in space]


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a variable not assigned yet
        return False
    return True


def _names(code: Any) -> set[str]:
    """The global names that `code` and the code nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


class Unkeyable(Exception):
    """A value a function reads cannot be told apart from a changed one by a key
    (an object without a value of its own, a module of the user's): the caller
    traces on every call instead of keeping the trace."""


def trace_context() -> Hashable:
    """JAX's state that a trace depends on beyond its function and arguments
    (its configuration, thread-local contexts included, and the mesh set), as
    `jax.jit` keys its own cache."""
    return jax_config.trace_context()


def reads_key(
    read: Reads, value_key: Callable[[Any], Hashable], keep: list[Any]
) -> Hashable:
    """A key of everything a function reads besides its arguments (`read`, from
    `find_reads`): each function, class and partial met, by identity (kept alive in
    `keep`); each value read by `value_key`. Raises `Unkeyable` where a value
    cannot be keyed, or where the function reads a module of the user's (whose
    attributes may change out of sight)."""
    if read.modules:
        raise Unkeyable(f"{read.modules[0]}: a module")
    keep.extend(read.objects)
    return (
        tuple((id(obj), getattr(obj, "__code__", None)) for obj in read.objects),
        tuple((name, value_key(value)) for name, value in read.values),
    )


def _in_library(obj: Any) -> bool:
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    return (module or "").split(".")[0] in _LIBRARIES


def _is_followed(value: Any) -> bool:
    return (
        inspect.isfunction(value)
        or inspect.isclass(value)
        or inspect.ismethod(value)
        or isinstance(value, ft.partial)
    )


def _class_values(cls: type, todo: list[Any]) -> list[tuple[str, Any]]:
    """A user class's own attributes that are not functions (class constants),
    by name; the functions of properties, static and class methods and
    Equinox's wrapped methods go to `todo`."""
    values = []
    for name, value in vars(cls).items():
        if name.startswith("__") or inspect.isfunction(value):
            continue
        wrapped = [
            getattr(value, attribute, None)
            for attribute in ("fget", "fset", "__func__", "method", "__wrapped__")
        ]
        wrapped = [f for f in wrapped if inspect.isfunction(f)]
        if wrapped:  # a property, static or class method, Equinox's methods
            todo.extend(wrapped)
        elif name != "_abc_impl":  # (the registry of an abstract base class)
            values.append((f"{name} (of {cls.__qualname__})", value))
    return values


_SCALARS = (type(None), bool, int, float, complex, str, bytes)
# Immutable values that compare by value (JAX's specs, shardings and meshes hash
# by value from C++, where `__hash__` reads as `object`'s).
_VALUES = (
    PartitionSpec,
    Sharding,
    Mesh,
    AbstractMesh,
    np.dtype,
    enum.Enum,
    frozenset,
    range,
    slice,
)


def value_key(
    value: Any,
    array_key: Callable[[Any], Hashable],
    keep: list[Any],
    *,
    depth: int = 0,
) -> Hashable:
    """A key that differs when `value` does: scalars and strings by value, NumPy
    data by content, JAX arrays by `array_key`, containers and pytrees (an
    Equinox module, a NamedTuple) by their structure and leaves, an object
    that defines its own hash by it, and a plain object by its attributes. A
    library's function or class is keyed by identity (kept alive in `keep`).
    Raises `Unkeyable` for anything else (a user's function held in data, an
    object with slots and no hash of its own), and past 32 levels."""
    if depth > 32:
        raise Unkeyable("too deep")
    again = ft.partial(value_key, array_key=array_key, keep=keep, depth=depth + 1)
    if isinstance(value, _SCALARS) or isinstance(value, _VALUES):
        return (type(value), value)
    if isinstance(value, np.ndarray | np.generic):
        data = np.ascontiguousarray(value)
        digest = hashlib.sha256(data.reshape(-1).view(np.uint8).data).hexdigest()
        return ("numpy", value.dtype.str, value.shape, digest)
    if isinstance(value, jax.Array):
        return ("array", array_key(value))
    if _is_followed(value) or inspect.ismodule(value):
        if not _in_library(value):
            raise Unkeyable(f"a function in data: {value!r}")
        keep.append(value)
        return ("object", id(value))
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        return (type(value), tuple(map(again, value)))
    if type(value) is dict:
        return (dict, tuple((again(k), again(v)) for k, v in value.items()))
    leaves, treedef = jtu.tree_flatten(value)
    if not (len(leaves) == 1 and leaves[0] is value):  # a pytree
        try:
            hash(treedef)
        except TypeError:  # a static field that cannot be hashed
            raise Unkeyable(f"a pytree of {type(value).__name__}") from None
        return (treedef, tuple(map(again, leaves)))
    hashes = type(value).__hash__
    if hashes is not None and hashes is not object.__hash__:
        try:
            return (type(value), hash(value), value)
        except TypeError:
            raise Unkeyable(type(value).__name__) from None
    attributes = getattr(value, "__dict__", None)
    if hashes is object.__hash__ and type(attributes) is dict:
        return (type(value), again(attributes))
    raise Unkeyable(type(value).__name__)
