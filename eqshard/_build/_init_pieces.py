"""`init_sharded`'s program in pieces: each distinct piece compiled once.

A model of twelve blocks is traced into one program that makes every array of
every block; XLA compiles it whole, and its compile time grows with the number
of blocks (on CPU about 0.05 s per array), although the blocks are the same work
with other keys. So the traced program is cut up:

1. **The keys.** The equations whose results are small and not floating (the
   splitting of keys, slicing one out, integer bookkeeping) are run first, op by
   op, as eager construction runs them (a static slice as a dynamic one, so that
   it compiles once for every index). These are exact integer operations: any
   program computes the same bits.
2. **The pieces.** Each output of the model is traced back to those keys (and
   to the program's inputs and constants): the equations it needs are its piece.
   Outputs that share an equation are one piece (such as a user's jitted
   constructor making several arrays). Pieces are told apart by what they are
   (the key of the kept programs, `_init._program_key`: the equations, types,
   parameters and constants, and the shardings of their outputs), so the twelve
   query weights are one piece, used twelve times with their own keys.
3. **The programs.** A program costs far more to compile than a piece in it
   (on CPU about 0.35 s, and 0.045 s per piece), so the pieces are not compiled
   one by one: one program makes `uses // rounds` uses of every piece and runs
   `rounds` times (for twelve blocks, one block's arrays per run), and another
   makes the uses left over (the embedding, the head), once. `rounds` is chosen
   to compile the fewest pieces and programs (`_cost`); where that is one round,
   no piece repeats enough to pay, and `plan` returns `None`: the whole program
   is kept. The programs are compiled side by side in threads, and each puts its
   outputs in their shardings, so each device still computes only its own
   shards.

A piece computes its outputs from the same keys with the same equations as the
whole program does, in the same shardings, so its values are the whole
program's (see `init_sharded` for when those are the jitted constructor's bit
for bit).
"""

import concurrent.futures
import functools as ft
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    jaxpr_as_fun,
    jaxprs_in_params,
    Var,
)


# Results of at most this many elements, not floating, are keys (or integer
# bookkeeping on them): computed once, before the pieces.
_SMALL = 1 << 12


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


def _is_key_work(eqn: Any) -> bool:
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


def _bind(eqn: Any, values: list[Any]) -> list[Any]:
    """`eqn` run on `values`, op by op. A static slice (`x[3]`, the most common
    operation on keys) is run as the same dynamic slice, which is compiled once
    for every start rather than once for each: the same elements, moved."""
    params = eqn.params
    if eqn.primitive.name == "slice" and all(
        stride in (None, 1) for stride in params["strides"] or ()
    ):
        starts = [np.int32(start) for start in params["start_indices"]]
        sizes = [
            limit - start
            for start, limit in zip(
                params["start_indices"], params["limit_indices"], strict=True
            )
        ]
        return [jax.lax.dynamic_slice(values[0], starts, sizes)]
    out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _run_keys(
    eqns: list[Any], sources: list[Var], outputs: list[Var], *values: Any
) -> list[Any]:
    """The values of `outputs`, computed by `eqns` (the keys' equations, in
    order) from the values of `sources`."""
    env = dict(zip(sources, values, strict=True))
    for eqn in eqns:
        ins = [env[v] if isinstance(v, Var) else v.val for v in eqn.invars]
        env.update(zip(eqn.outvars, _bind(eqn, ins), strict=True))
    return [env[v] for v in outputs]


# Threads compiling the programs of a plan.
_WORKERS = min(4, os.cpu_count() or 1)


class Plan:
    """How to run a traced program in pieces: `run(consts, flat)` gives its
    outputs, the flat list the whole program would return. `consts` are the
    program's constants with `None` for each one fed on every run."""

    def __init__(
        self,
        consts: list[Any],
        keys: Callable[..., list[Any]],
        calls: list[tuple[Any, list[int], list[int]]],
        outputs: int,
    ):
        self._consts = consts
        self._keys = keys
        self._calls = calls
        self._outputs = outputs
        self._compiled: set[Any] = set()

    def _compile(self, values: list[Any]) -> None:
        """Compiles the programs not compiled yet, several at a time: each is
        lowered here (under this thread's JAX configuration), and compiled in a
        pool of threads (XLA releases the GIL). JAX keeps what it compiled, so
        the calls that follow compile nothing."""
        first: dict[int, Any] = {}
        for jitted, inputs, _ in self._calls:
            if id(jitted) not in first and jitted not in self._compiled:
                first[id(jitted)] = jitted.lower(*(values[i] for i in inputs))
                self._compiled.add(jitted)
        if len(first) > 1:
            with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
                list(pool.map(lambda lowered: lowered.compile(), first.values()))

    def run(self, consts: Sequence[Any], flat: Sequence[Any]) -> list[Any]:
        """The outputs, from the program's constants to feed (`consts`) and its
        inputs (`flat`). Under a trace (`init_sharded` inside `jax.jit`), the
        programs are traced in turn, not compiled here."""
        fed = iter(consts)
        values = [next(fed) if c is None else c for c in self._consts]
        values += flat
        values += self._keys(*values)
        out: list[Any] = [None] * self._outputs

        if not any(isinstance(value, Tracer) for value in values):
            self._compile(values)
        for jitted, inputs, positions in self._calls:
            results = jitted(*(values[i] for i in inputs))
            for position, result in zip(positions, results, strict=True):
                out[position] = result
        return out


def plan(
    closed: ClosedJaxpr,
    shardings: list[Any],
    *,
    key_of: Callable[[ClosedJaxpr, list[Any]], Hashable],
    is_fed: Callable[[Any], bool],
) -> Plan | None:
    """`closed` (whose outputs go to `shardings`) in pieces, or `None` if no piece
    repeats. Two pieces are the same program if `key_of` says so; constants for
    which `is_fed` holds are inputs of the programs (read on every run), the
    others stay constants of them."""
    jaxpr = closed.jaxpr
    if jaxpr.effects:
        return None
    sources: list[Var] = [*jaxpr.constvars, *jaxpr.invars]
    const_of = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    key_eqns, rest = [], []
    is_key = set(sources)
    for eqn in jaxpr.eqns:
        if _is_key_work(eqn) and all(
            not isinstance(var, Var) or var in is_key for var in eqn.invars
        ):
            key_eqns.append(eqn)
            is_key.update(eqn.outvars)
        else:
            rest.append(eqn)
    made_by = {var: n for n, eqn in enumerate(rest) for var in eqn.outvars}

    # Each output's equations, outside the keys; outputs sharing one are joined.
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

    # The distinct pieces, each with its uses: (inputs, output positions).
    distinct: dict[Hashable, tuple[Callable[..., Any], int, list[Any], list[Any]]] = {}
    key_outputs: dict[Var, None] = {}  # in order
    for positions in groups.values():
        eqn_ids = sorted(set().union(*(needs[p] for p in positions)))
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
        out_shardings = [shardings[p] for p in positions]
        # Keyed with every constant in place, as the kept programs are.
        key = key_of(
            ClosedJaxpr(
                _jaxpr(consts, [v for v in inputs if v not in const_of], outvars, eqns),
                [const_of[v] for v in consts],
            ),
            out_shardings,
        )
        if key not in distinct:
            run = jaxpr_as_fun(
                ClosedJaxpr(
                    _jaxpr(fixed, fed, outvars, eqns), [const_of[v] for v in fixed]
                )
            )
            distinct[key] = (run, len(fed), out_shardings, [])
        distinct[key][3].append((fed, positions))
        key_outputs.update((v, None) for v in fed if v not in sources)

    pieces = list(distinct.values())
    if not pieces:  # nothing to build
        return None
    uses = [len(piece[3]) for piece in pieces]
    rounds = min(range(1, max(uses) + 1), key=lambda r: _cost(uses, r))
    if rounds == 1:
        return None
    index = {var: n for n, var in enumerate([*sources, *key_outputs])}
    calls = []
    # `rounds` calls of one program making `use // rounds` uses of each piece,
    # then one call of another making the uses left over.
    for first, counts, times in (
        (lambda n: 0, [u // rounds for u in uses], rounds),
        (lambda n: uses[n] // rounds * rounds, [u % rounds for u in uses], 1),
    ):
        if not any(counts):
            continue
        shardings_of_call = [
            sharding
            for (_, _, out_shardings, _), count in zip(pieces, counts, strict=True)
            for _ in range(count)
            for sharding in out_shardings
        ]
        jitted = jax.jit(
            _joined(
                [
                    (run, width, count)
                    for (run, width, _, _), count in zip(pieces, counts)
                ]
            ),
            out_shardings=shardings_of_call,
        )
        for call in range(times):
            made_uses = [
                use
                for n, ((*_, piece_uses), count) in enumerate(zip(pieces, counts))
                for use in piece_uses[first(n) + call * count :][:count]
            ]
            calls.append(
                (
                    jitted,
                    [index[v] for fed, _ in made_uses for v in fed],
                    [p for _, positions in made_uses for p in positions],
                )
            )
    keys = ft.partial(_run_keys, key_eqns, sources, list(key_outputs))
    fixed = [None if is_fed(c) else c for c in closed.consts]
    return Plan(fixed, keys, calls, len(jaxpr.outvars))


# What a program costs to compile, in pieces: on CPU, about 0.35 s for a program
# and 0.045 s more for each piece in it.
_PROGRAM_COST = 8


def _cost(uses: list[int], rounds: int) -> int:
    """What the pieces, used `uses` times each, cost to compile when they are
    made in `rounds` calls of one program (and one of another for the uses left
    over)."""
    each = [u // rounds for u in uses]
    left = [u % rounds for u in uses]
    programs = (any(each) and 1) + (any(left) and 1)
    return _PROGRAM_COST * programs + sum(each) + sum(left)


def _joined(
    parts: list[tuple[Callable[..., list[Any]], int, int]],
) -> Callable[..., list[Any]]:
    """A function making `count` uses of each piece `(run, width, count)` of
    `parts` (`run` takes `width` inputs), from their inputs in that order,
    returning their outputs in that order."""

    def run(*values: Any) -> list[Any]:
        given = iter(values)
        out: list[Any] = []
        for piece, width, count in parts:
            for _ in range(count):
                out += piece(*(next(given) for _ in range(width)))
        return out

    return run
