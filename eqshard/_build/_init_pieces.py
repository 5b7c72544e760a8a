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
import dataclasses
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from jax.core import Tracer

from .._internals import jaxpr as jaxprs


# Threads compiling the programs of a plan.
_WORKERS = min(4, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a plan: `jitted` on the values at `inputs`, its outputs going
    to `positions` of the program's outputs."""

    jitted: Any
    inputs: list[int]
    positions: list[int]


@dataclasses.dataclass
class _Distinct:
    """A distinct piece: its function (of `width` inputs), its outputs'
    shardings, and its uses (a `jaxprs.Piece` each)."""

    run: Callable[..., list[Any]]
    width: int
    shardings: list[Any]
    uses: list[jaxprs.Piece]


class Plan:
    """How to run a traced program in pieces: `run(consts, flat)` gives its
    outputs, the flat list the whole program would return. `consts` are the
    program's constants with `None` for each one fed on every run."""

    def __init__(
        self,
        consts: list[Any],
        keys: Callable[..., list[Any]],
        calls: list[Call],
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
        for call in self._calls:
            jitted = call.jitted
            if id(jitted) not in first and jitted not in self._compiled:
                first[id(jitted)] = jitted.lower(*(values[i] for i in call.inputs))
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
        for call in self._calls:
            results = call.jitted(*(values[i] for i in call.inputs))
            for position, result in zip(call.positions, results, strict=True):
                out[position] = result
        return out


def plan(
    closed: Any,
    shardings: list[Any],
    *,
    key_of: Callable[[Any, list[Any]], Hashable],
    is_fed: Callable[[Any], bool],
) -> Plan | None:
    """`closed` (a traced program whose outputs go to `shardings`) in pieces, or
    `None` if no piece repeats. Two pieces are the same program if `key_of` says
    so; constants for which `is_fed` holds are inputs of the programs (read on
    every run), the others stay constants of them. Raises
    `_internals.routes.Unrecognised` where the program cannot be read."""
    cut = jaxprs.cut(closed, is_fed=is_fed)
    if cut is None:
        return None
    pieces = _distinct(cut, shardings, key_of)
    if not pieces:  # nothing to build
        return None
    uses = [len(piece.uses) for piece in pieces]
    rounds = min(range(1, max(uses) + 1), key=lambda r: _cost(uses, r))
    if rounds == 1:
        return None
    fixed = [None if is_fed(c) else c for c in jaxprs.consts_of(closed)]
    return Plan(fixed, cut.keys, _calls(pieces, uses, rounds), cut.outputs)


def _distinct(
    cut: jaxprs.Cut,
    shardings: list[Any],
    key_of: Callable[[Any, list[Any]], Hashable],
) -> list[_Distinct]:
    """The distinct pieces of `cut`, each with its uses, in order."""
    distinct: dict[Hashable, _Distinct] = {}
    for piece in cut.pieces:
        out_shardings = [shardings[p] for p in piece.positions]
        # Keyed with every constant in place, as the kept programs are.
        key = key_of(piece.keyed, out_shardings)
        if key not in distinct:
            distinct[key] = _Distinct(
                piece.function(), len(piece.fed), out_shardings, []
            )
        distinct[key].uses.append(piece)
    return list(distinct.values())


def _calls(pieces: list[_Distinct], uses: list[int], rounds: int) -> list[Call]:
    """`rounds` calls of one program making `use // rounds` uses of each piece,
    then one call of another making the uses left over."""
    calls = []
    for first, counts, times in (
        (lambda n: 0, [u // rounds for u in uses], rounds),
        (lambda n: uses[n] // rounds * rounds, [u % rounds for u in uses], 1),
    ):
        if not any(counts):
            continue
        shardings_of_call = [
            sharding
            for piece, count in zip(pieces, counts, strict=True)
            for _ in range(count)
            for sharding in piece.shardings
        ]
        jitted = jax.jit(
            _joined(
                [
                    (piece.run, piece.width, count)
                    for piece, count in zip(pieces, counts, strict=True)
                ]
            ),
            out_shardings=shardings_of_call,
        )
        for call in range(times):
            made = [
                use
                for n, (piece, count) in enumerate(zip(pieces, counts, strict=True))
                for use in piece.uses[first(n) + call * count :][:count]
            ]
            calls.append(
                Call(
                    jitted,
                    [i for use in made for i in use.fed],
                    [p for use in made for p in use.positions],
                )
            )
    return calls


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
