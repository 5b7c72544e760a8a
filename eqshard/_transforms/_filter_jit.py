"""`filter_jit`: `eqx.filter_jit` with spec trees for the inputs and outputs, and
Equinox's donation options, on `_jit.JitFunction`.

The specs are resolved at the first call with arguments of each structure, shapes,
dtypes and placements (and under each mesh set), against those arguments, by
`_jit_specs.py`'s `Specs`.
"""

from collections.abc import Callable
from typing import Any, Literal, TYPE_CHECKING, TypeAlias

from jax.sharding import AbstractMesh, Mesh
from jaxtyping import PyTree

from .._typing import check_choice, typecheck
from ._jit import Front, JitFunction
from ._jit_checks import Donation
from ._jit_specs import CALLER, Specs


# Equinox's choices for `donate`, checked by `filter_jit` itself (as `_typing`'s
# aliases of the arguments a function validates).
_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")
if TYPE_CHECKING:
    Donate: TypeAlias = Literal[
        "all", "all-except-first", "warn", "warn-except-first", "none"
    ]
else:
    Donate = str


@typecheck
def filter_jit(
    fn: Callable[..., Any] | None = None,
    *,
    in_specs: PyTree = None,
    out_specs: PyTree = None,
    donate: Donate = "none",
    mesh: Mesh | AbstractMesh | None = None,
) -> Any:
    """`eqx.filter_jit` that places its inputs and outputs by spec trees: a step
    that keeps its layout without constraints written inside it.

    Arrays among the arguments are traced, everything else held static, as
    `eqx.filter_jit` does. The arguments are taken with the shardings `in_specs`
    gives them and the output made in those of `out_specs`, so the updated state
    comes back laid out as it went in and the step compiles once. `fn` is traced
    with the mesh set, so [`eqshard.with_sharding_constraint`][] inside needs no
    `mesh=`. When specs are resolved, and how rules match, is told in
    [the how-to](../how-to/filter-jit.md#when-the-specs-are-resolved).

    **Arguments:**

    - `fn`: the function; `filter_jit(in_specs=..., ...)` without it gives a
      decorator.
    - `in_specs`: one entry per positional argument, or one for all: a spec tree
      or a prefix of one, partition rules matched against the argument, or a
      callable of the abstract argument; [`eqshard.host`][] leaves are moved to
      the device inside the program. `None` takes an argument as it is placed.
    - `out_specs`: the same for the output, where an integer `k` stands for the
      layout of argument `k` (`out_specs=(0, P())`); `None` leaves an output's
      layout to the compiler.
    - `donate`: `"all"`, `"all-except-first"` (quiet about buffers no output
      could reuse), `"warn"`, `"warn-except-first"` (reporting them) or `"none"`
      (the default), as in `eqx.filter_jit`.
    - `mesh`: the mesh for `PartitionSpec`s; defaults to the mesh set by
      `jax.set_mesh`, then to the mesh the arguments are placed on. An
      `AbstractMesh` serves only a function called inside another `jax.jit`.

    **Returns:**

    The compiled function, with `lower(*args)` and `compile(*args)` for
    ahead-of-time use; [`eqshard.analyze_step`][] reads its shardings and donations.

    **Raises:**

    At the first call with a structure: `ValueError` naming the first path where a
    spec tree does not match, every array whose spec cannot apply, an argument
    placed otherwise than its spec asks, donation misuse (an array given twice,
    shared buffers, a deleted array), an axis the mesh lacks, or no mesh found;
    `TypeError` for keyword arguments, a spec leaf that is not a spec, an
    unhashable non-array leaf, a `jax.ShapeDtypeStruct` argument (use `lower`),
    or an `AbstractMesh` outside another `jit`.

    !!! Example

        ```python
        step = eqshard.filter_jit(
            train_step, in_specs=(P("dp"), rules), out_specs=(1, P()),
            donate="all-except-first", mesh=mesh,
        )
        state, loss = step(batch, state)
        ```
    """
    check_choice(donate, _DONATE, caller=CALLER, name="donate")
    if fn is None:
        return lambda f: filter_jit(
            f, in_specs=in_specs, out_specs=out_specs, donate=donate, mesh=mesh
        )
    if not callable(fn):
        raise TypeError(
            f"eqshard.{CALLER}: `fn` must be callable, got {fn!r}; use "
            "`eqshard.filter_jit(fn, in_specs=..., out_specs=...)`, or as a "
            "decorator `@eqshard.filter_jit(in_specs=..., out_specs=...)`."
        )
    donation = Donation(
        start={"none": None}.get(donate, 1 if "except" in donate else 0),
        text=f"`donate={donate!r}`",
        quiet=donate in ("all", "all-except-first"),
    )
    return JitFunction(
        fn, Front(CALLER), Specs(fn, in_specs, out_specs, mesh), donation
    )
