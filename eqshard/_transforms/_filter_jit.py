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

    Arrays are traced, everything else held static, as in `eqx.filter_jit`; the
    arguments take the shardings of `in_specs` and the output those of
    `out_specs`, so the updated state comes back laid out as it went in and the
    step compiles once. `fn` is traced with the mesh set (no `mesh=` needed by
    [`eqshard.with_sharding_constraint`][] inside). Specs' resolution, rules and
    `donate`: [the how-to](../how-to/filter-jit.md#when-the-specs-are-resolved).

    **Arguments:**

    - `fn`: the function; without it, `filter_jit(in_specs=..., ...)` is a decorator.
    - `in_specs`: one entry per positional argument, or one for all: a spec tree
      or prefix, partition rules, or a callable of the abstract argument
      ([`eqshard.host`][] leaves move to the device in the program); `None`
      takes an argument as it is placed.
    - `out_specs`: the same for the output, where an integer `k` stands for
      argument `k`'s layout (`(0, P())`); `None` leaves it to the compiler.
    - `donate`: `"all"`, `"all-except-first"`, `"warn"`, `"warn-except-first"`
      or `"none"` (the default), as in `eqx.filter_jit`.
    - `mesh`: for `PartitionSpec`s; defaults to `jax.set_mesh`'s, then the
      arguments'. An `AbstractMesh` serves only inside another `jax.jit`.

    **Returns:**

    The compiled function, with `lower(*args)` and `compile(*args)` for
    ahead-of-time use; [`eqshard.analyze_step`][] reads its shardings and donations.

    **Raises:**

    At the first call with a structure: `ValueError` naming the first path where a
    spec tree does not match, every array whose spec cannot apply, an argument
    placed against its spec, donation misuse (an array given twice, shared or
    deleted buffers), an axis the mesh lacks, or no mesh; `TypeError` for keyword
    arguments, a spec leaf that is no spec, an unhashable non-array leaf, a
    `jax.ShapeDtypeStruct` argument (use `lower`), or an `AbstractMesh` outside `jit`.

    !!! Example

        ```python
        step = eqshard.filter_jit(train_step, in_specs=(P("dp"), rules),
                                  out_specs=(1, P()), donate="all-except-first")
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
