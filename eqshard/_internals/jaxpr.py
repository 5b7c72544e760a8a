"""Reads of traced programs (jaxprs): primitives, their parameters, variables,
constants and the programs nested in them.

Three readers use them, each through its own functions here:

- `init_sharded` (`_build/`): `cut` splits a traced constructor into its keys'
  work and its pieces; `nested_consts` lists the data a trace captured;
  `consts_of` and `as_function` run a program with other constants.
- `search_layout` (`_search/_flow.py`): through the views of `equations.py`,
  built on the reads here (`eqn_name`, `eqn_param`, `inner_program`).
- `analyze_step` (`_step/`): `boundary_of`, the shardings and donations of the
  one `jit` call a step makes.

A primitive these do not know is read as "some other operation" where that is
safe (it only makes a reader's hints vaguer); a known primitive whose parameters
are not laid out as expected raises `Unrecognised`, and the caller takes its
plain route. Nothing here guesses.
"""

import dataclasses
import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    jaxpr_as_fun,
    jaxprs_in_params,
    Literal,
    Var,
)
from jax.sharding import Sharding

from .routes import Unrecognised


def eqn_param(eqn: Any, name: str) -> Any:
    """`eqn`'s parameter `name`, or `Unrecognised` if it has none."""
    params = getattr(eqn, "params", None)
    if not isinstance(params, dict) or name not in params:
        raise Unrecognised(f"'{eqn_name(eqn)}' without its parameter '{name}'")
    return params[name]


def eqn_name(eqn: Any) -> str:
    return getattr(getattr(eqn, "primitive", None), "name", "?")


def inner_program(value: Any, what: str) -> Jaxpr:
    """The program of a parameter that holds one (a `ClosedJaxpr` or a `Jaxpr`)."""
    program = getattr(value, "jaxpr", value)
    if not isinstance(program, Jaxpr):
        raise Unrecognised(f"{what} is a {type(value).__name__}, not a program")
    return program


# ----------------------------------------------------- constants, as a function


def consts_of(closed: ClosedJaxpr) -> list[Any]:
    """The constants of a traced program, in order."""
    return list(closed.consts)


def as_function(
    closed: ClosedJaxpr, consts: Sequence[Any] | None = None
) -> Callable[..., Any]:
    """`closed`'s program as a function of its inputs, with `consts` for its
    constants (by default its own)."""
    if consts is None:
        return jaxpr_as_fun(closed)
    return jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, list(consts)))


def nested_consts(closed: ClosedJaxpr) -> list[Any]:
    """The constants of `closed` and of every program nested in its equations'
    parameters (a `jit`'s, a `scan`'s body, a `cond`'s branches, ...)."""
    found: list[Any] = []

    def params(value: Any) -> None:
        if isinstance(value, ClosedJaxpr):
            found.extend(value.consts)
            program(value.jaxpr)
        elif isinstance(value, Jaxpr):
            program(value)
        elif isinstance(value, tuple | list):
            for item in value:
                params(item)

    def program(jaxpr: Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            for value in eqn.params.values():
                params(value)

    params(closed)
    return found


# ------------------------------------------------------------ a step's boundary


@dataclasses.dataclass
class Boundary:
    """The shardings and donations of the one `jit` call that a step makes, by
    the position of the step's inputs and outputs (`None`: not given)."""

    in_shardings: list[Sharding | None]
    out_shardings: list[Sharding | None]
    donated: list[bool]


def boundary_of(traced: Any, n_in: int, n_out: int) -> Boundary | None:
    """The boundary of the one `jit` (`jax.jit`, `eqx.filter_jit`, ...) that
    `traced` (a `jax.jit(...).trace(...)` of `n_in` inputs and `n_out` outputs)
    calls, or `None` when its program is not exactly one such call."""
    jaxpr = inner_program(getattr(traced, "jaxpr", None), "the trace's program")
    if len(jaxpr.eqns) != 1 or eqn_name(jaxpr.eqns[0]) not in ("jit", "pjit"):
        return None
    eqn = jaxpr.eqns[0]
    ins, donated = eqn_param(eqn, "in_shardings"), eqn_param(eqn, "donated_invars")
    outs = eqn_param(eqn, "out_shardings")
    if not len(eqn.invars) == len(ins) == len(donated) or len(eqn.outvars) != len(outs):
        raise Unrecognised("a 'jit' whose shardings do not match its variables")
    position = {id(v): i for i, v in enumerate(jaxpr.invars)}
    found = Boundary([None] * n_in, [None] * n_out, [False] * n_in)
    for var, sharding, donate in zip(eqn.invars, ins, donated, strict=True):
        i = position.get(id(var))
        if i is not None and i < n_in:
            found.in_shardings[i] = sharding if isinstance(sharding, Sharding) else None
            found.donated[i] = bool(donate)
    made = {id(v): s for v, s in zip(eqn.outvars, outs, strict=True)}
    for k, var in enumerate(jaxpr.outvars[:n_out]):
        sharding = made.get(id(var))
        found.out_shardings[k] = sharding if isinstance(sharding, Sharding) else None
    return found


def without_boundary(closed: ClosedJaxpr) -> Callable[..., list[Any]] | None:
    """`closed` (as `jax.make_jaxpr` makes it) as a function of its inputs with
    its one `jit` call's body run in place of the call, so that another `jit`
    gives it other shardings and donations; `None` when its program is not
    exactly one `jit` call."""
    jaxpr = closed.jaxpr
    if len(jaxpr.eqns) != 1 or eqn_name(jaxpr.eqns[0]) not in ("jit", "pjit"):
        return None
    eqn = jaxpr.eqns[0]
    body = eqn_param(eqn, "jaxpr")
    if not isinstance(body, ClosedJaxpr):
        raise Unrecognised(f"a 'jit' whose program is a {type(body).__name__}")
    run = jaxpr_as_fun(body)
    consts = dict(zip(map(id, jaxpr.constvars), closed.consts, strict=True))

    def value(var: Any, known: dict[int, Any]) -> Any:
        if isinstance(var, Literal):
            return var.val
        if id(var) in known:
            return known[id(var)]
        if id(var) in consts:
            return consts[id(var)]
        raise Unrecognised("a program output that is no variable of it")

    def function(*args: Any) -> list[Any]:
        known = {id(v): x for v, x in zip(jaxpr.invars, args, strict=True)}
        outs = run(*[value(v, known) for v in eqn.invars])
        known.update(zip(map(id, eqn.outvars), outs, strict=True))
        return [value(v, known) for v in jaxpr.outvars]

    return function


# ------------------------------------------------- a constructor cut in pieces

# Results of at most this many elements, not floating, are keys (or integer
# bookkeeping on them): computed once, before the pieces.
_SMALL = 1 << 12


@dataclasses.dataclass(frozen=True)
class Piece:
    """The equations that make some outputs of a cut program, as a program.

    `keyed` has every constant in place (to tell pieces apart); `function()`
    takes the constants that are fed on every run as inputs. `fed` are the
    indices of its inputs among the cut's values (the program's constants and
    inputs, then the keys), `positions` those of its outputs among the
    program's."""

    keyed: ClosedJaxpr
    fed: list[int]
    positions: list[int]
    _fixed: list[Var]  # constants kept in the function
    _inputs: list[Var]  # the function's inputs (`fed`'s variables)

    def function(self) -> Callable[..., list[Any]]:
        jaxpr = self.keyed.jaxpr
        const_of = dict(zip(jaxpr.constvars, self.keyed.consts, strict=True))
        program = _jaxpr(self._fixed, self._inputs, jaxpr.outvars, jaxpr.eqns)
        return jaxpr_as_fun(ClosedJaxpr(program, [const_of[v] for v in self._fixed]))


@dataclasses.dataclass(frozen=True)
class Cut:
    """A traced program cut in pieces: its keys' work (`keys(*sources)` gives the
    values of the keys the pieces read, from the program's constants and inputs)
    and its pieces, one per group of outputs that share an equation."""

    keys: Callable[..., list[Any]]
    pieces: list[Piece]
    outputs: int


def _jaxpr(
    constvars: list[Var], invars: list[Var], outvars: list[Any], eqns: list[Any]
) -> Jaxpr:
    """A part of the traced program, as a program of its own."""
    debug = DebugInfo(
        "init_sharded",
        "a piece of the traced program",
        tuple(f"x{n}" for n in range(len(invars))),
        tuple(f"y{n}" for n in range(len(outvars))),
    )
    return Jaxpr(constvars, invars, outvars, eqns, debug_info=debug)


def is_key_work(eqn: Any) -> bool:
    """Whether `eqn` belongs to the keys: a primitive (no nested program, no
    effects) whose results are small and not floating."""
    if eqn.effects or any(True for _ in jaxprs_in_params(eqn.params)):
        return False
    return all(
        hasattr(var.aval, "dtype")
        and not jnp.issubdtype(var.aval.dtype, jnp.inexact)
        and var.aval.size <= _SMALL
        for var in eqn.outvars
    )


def key_step(eqn: Any) -> Callable[[list[Any]], list[Any]]:
    """`eqn` as a function of its inputs' values, run op by op. A static slice
    (`x[3]`, the most common operation on keys) is run as the same dynamic
    slice, which is compiled once for every start rather than once for each:
    the same elements, moved."""
    primitive, params = eqn.primitive, dict(eqn.params)
    if eqn_name(eqn) == "slice":
        strides = eqn_param(eqn, "strides")
        starts, limits = (
            eqn_param(eqn, "start_indices"),
            eqn_param(eqn, "limit_indices"),
        )
        if all(stride in (None, 1) for stride in strides or ()):
            begin = [np.int32(start) for start in starts]
            sizes = [limit - start for start, limit in zip(starts, limits, strict=True)]
            return lambda values: [jax.lax.dynamic_slice(values[0], begin, sizes)]
    if primitive.multiple_results:
        return lambda values: list(primitive.bind(*values, **params))
    return lambda values: [primitive.bind(*values, **params)]


def _operand(var: Any) -> Var | Literal:
    if not isinstance(var, Var | Literal):
        raise Unrecognised(f"an operand that is a {type(var).__name__}")
    return var


def _run_keys(
    steps: list[tuple[Callable[[list[Any]], list[Any]], list[Any], list[Var]]],
    sources: list[Var],
    outputs: list[Var],
    *values: Any,
) -> list[Any]:
    """The values of `outputs`, computed by `steps` (the keys' equations, in
    order) from the values of `sources`."""
    env = dict(zip(sources, values, strict=True))
    for step, ins, outs in steps:
        args = [env[v] if isinstance(v, Var) else v.val for v in ins]
        env.update(zip(outs, step(args), strict=True))
    return [env[v] for v in outputs]


def _split(jaxpr: Jaxpr, sources: list[Var]) -> tuple[list[Any], list[Any]]:
    """The equations of the keys (in order), and the others."""
    key_eqns, rest = [], []
    is_key = set(sources)
    for eqn in jaxpr.eqns:
        ins = [_operand(v) for v in eqn.invars]
        if is_key_work(eqn) and all(not isinstance(v, Var) or v in is_key for v in ins):
            key_eqns.append(eqn)
            is_key.update(eqn.outvars)
        else:
            rest.append(eqn)
    return key_eqns, rest


def _groups(jaxpr: Jaxpr, rest: list[Any]) -> list[tuple[list[int], list[int]]]:
    """Each group of outputs that share an equation outside the keys: (their
    positions, the indices in `rest` of the equations they need)."""
    made_by = {var: n for n, eqn in enumerate(rest) for var in eqn.outvars}
    owner = list(range(len(jaxpr.outvars)))

    def find(n: int) -> int:
        while owner[n] != n:
            owner[n] = owner[owner[n]]
            n = owner[n]
        return n

    used_by: dict[int, int] = {}  # equation -> an output using it
    needs: list[set[int]] = []
    for position, var in enumerate(jaxpr.outvars):
        needed: set[int] = set()
        todo = [var] if isinstance(var, Var) else []
        while todo:
            n = made_by.get(todo.pop())
            if n is None or n in needed:
                continue
            needed.add(n)
            todo.extend(v for v in rest[n].invars if isinstance(v, Var))
            if n in used_by:
                owner[find(position)] = find(used_by[n])
            else:
                used_by[n] = position
        needs.append(needed)
    groups: dict[int, list[int]] = {}
    for position in range(len(jaxpr.outvars)):
        groups.setdefault(find(position), []).append(position)
    return [
        (positions, sorted(set().union(*(needs[p] for p in positions))))
        for positions in groups.values()
    ]


def cut(closed: ClosedJaxpr, *, is_fed: Callable[[Any], bool]) -> Cut | None:
    """`closed` cut into its keys' work and its pieces (see `_build/_init_pieces`),
    or `None` if it has effects (it then runs whole). Constants for which
    `is_fed` holds are inputs of the pieces, the others stay constants of them.
    Every equation is read here: running the cut reads nothing more."""
    jaxpr = closed.jaxpr
    if jaxpr.effects:
        return None
    sources: list[Var] = [*jaxpr.constvars, *jaxpr.invars]
    const_of = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    key_eqns, rest = _split(jaxpr, sources)
    steps = [(key_step(e), list(e.invars), list(e.outvars)) for e in key_eqns]
    found: list[tuple[ClosedJaxpr, list[Var], list[Var], list[int]]] = []
    key_outputs: dict[Var, None] = {}  # in order
    for positions, eqn_ids in _groups(jaxpr, rest):
        eqns = [rest[n] for n in eqn_ids]
        outvars = [jaxpr.outvars[p] for p in positions]
        made = {var for eqn in eqns for var in eqn.outvars}
        inputs: list[Var] = []
        for var in [v for eqn in eqns for v in eqn.invars] + outvars:
            if isinstance(var, Var) and var not in made and var not in inputs:
                inputs.append(var)
        consts = [v for v in inputs if v in const_of]
        fixed = [v for v in consts if not is_fed(const_of[v])]
        fed = [v for v in inputs if v not in fixed]
        args = [v for v in inputs if v not in const_of]
        keyed = ClosedJaxpr(
            _jaxpr(consts, args, outvars, eqns), [const_of[v] for v in consts]
        )
        found.append((keyed, fixed, fed, positions))
        key_outputs.update((v, None) for v in fed if v not in sources)
    index = {var: n for n, var in enumerate([*sources, *key_outputs])}
    pieces = [
        Piece(keyed, [index[v] for v in fed], positions, fixed, fed)
        for keyed, fixed, fed, positions in found
    ]
    keys = ft.partial(_run_keys, steps, sources, list(key_outputs))
    return Cut(keys, pieces, len(jaxpr.outvars))
