"""What a function reads besides its arguments: its closure's variables, the
globals its code names, default values, a `functools.partial`'s arguments.

`init_sharded` looks there for the NumPy data its trace captured (to refuse data
that JAX would narrow with a loss, out of sight). The scan reads
`__closure__`, `__globals__` and code objects; a value it cannot read is skipped
by the caller (the check cannot run: the build goes on).
"""

import functools as ft
import inspect
from typing import Any


# Modules whose functions are not searched for the NumPy data they close over.
_LIBRARIES = ("jax", "jaxlib", "numpy", "equinox", "eqshard", "optax", "builtins")


def closed_over(fn: Any) -> list[tuple[str, Any]]:
    """What `fn` reads besides its arguments, by name: its closure's variables, the
    globals its code names, default values, a `functools.partial`'s arguments,
    a bound method's object; and so on through the functions and classes found
    there (not those of JAX, NumPy, Equinox or eqshard). Values are given whole
    (a list of arrays is one value)."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    todo: list[Any] = [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        module = getattr(obj, "__module__", None) or ""
        if module.split(".")[0] in _LIBRARIES:
            continue
        values = _read_by(obj, todo)
        for name, value in values:
            if (
                inspect.isfunction(value)
                or inspect.isclass(value)
                or isinstance(value, ft.partial)
            ):
                todo.append(value)
            elif not inspect.ismodule(value):
                found.append((name, value))
    return found


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
