"""Fast paths and their plain-JAX routes.

Each fast path that rests on reads of JAX's internals sits behind one function
that asks `plain(name)` first, and takes the plain route when the switch says so
or when a read raises `Unrecognised` (then `fall_back` warns, once per path and
reason). The switch is the environment variable `EQSHARD_PLAIN_ROUTES`, read at
every call: a comma-separated list of path names, or `all`.

- `init`: `init_sharded` built in pieces; plain: one `jax.jit` of the build.
- `copies`: the CPU copy engine (threads, aligned blocks); plain:
  `jax.device_put` and `jax.device_get`.
- `restore`: `restore`'s own block reads on CPU; plain: orbax's read.
- `save`: in one process, `save` writes each shard from one replica (`orbax.py`);
  plain: orbax's default, replica-parallel saving.
"""

import os
import warnings
from typing import Literal, TypeAlias


Route: TypeAlias = Literal["init", "copies", "restore", "save"]
ROUTES: tuple[Route, ...] = ("init", "copies", "restore", "save")
VARIABLE = "EQSHARD_PLAIN_ROUTES"

_warned: set[tuple[str, str]] = set()


class Unrecognised(Exception):
    """A read of JAX's internals met something it does not know: the caller takes
    its plain route. Never reaches users."""


def plain(name: Route) -> bool:
    """Whether `name`'s plain route is forced by `EQSHARD_PLAIN_ROUTES`."""
    value = os.environ.get(VARIABLE, "")
    if not value:
        return False
    asked = {part.strip() for part in value.split(",") if part.strip()}
    unknown = asked - {*ROUTES, "all"}
    if unknown:
        raise ValueError(
            f"eqshard: {VARIABLE}={value!r} names {sorted(unknown)}, which are not "
            f"fast paths. Use a comma-separated list of {list(ROUTES)}, or 'all'."
        )
    return "all" in asked or name in asked


def fall_back(name: Route, why: str) -> None:
    """Say once (per path and reason) that `name` took its plain route."""
    if (name, why) in _warned:
        return
    _warned.add((name, why))
    warnings.warn(
        f"eqshard: the fast path '{name}' met something in this JAX "
        f"({_jax_version()}) it does not recognise ({why}); it took its plain "
        f"route, which gives the same result. Set {VARIABLE}={name} to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )


def _jax_version() -> str:
    import jax

    return f"jax {jax.__version__}"
