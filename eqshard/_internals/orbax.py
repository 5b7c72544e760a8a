"""orbax's type handlers: how orbax describes a checkpoint's files to tensorstore,
and the handler `save` writes `jax.Array`s with in one process.

`restore`'s block reads on CPU (`_checkpoint/_blocks.py`) open the files with
the tensorstore spec orbax itself reads with, in one tensorstore context. These
come from `orbax.checkpoint.type_handlers`, which is not orbax's stable API:
when it does not have what is read here, or gives something of another form,
the reads raise `Unrecognised` and `restore` takes orbax's own read (the plain
route, `routes.py`). orbax is imported here only once the caller has checked it
is installed.

`save`'s handler (`one_replica_writer`): orbax's default on CPU and TPU is
replica-parallel saving, where each replica of a shard writes a slice of it, so
that the hosts of a multi-host run share the writing of a replicated array. In
one process, the one host writes every slice anyway, and cutting them costs a
compiled `slice` per array shape and device on the first save (50 arrays on a
mesh of 8 devices: 400 compiles). So one process saves each
shard whole from one replica, through orbax's own handler made without that
option; several processes keep orbax's default, which buys them the sharing.
`EQSHARD_PLAIN_ROUTES=save` takes orbax's default in one process too.
"""

import dataclasses
from typing import Any

import jax

from .routes import Unrecognised


@dataclasses.dataclass(frozen=True)
class ReadSpecs:
    """How tensorstore opens a checkpoint's arrays as orbax would: one `context`
    (one cache of the checkpoint's index), and a JSON spec per array."""

    context: Any
    specs: dict[int, dict[str, Any]]


def _type_handlers() -> Any:
    import orbax.checkpoint as ocp

    handlers = getattr(ocp, "type_handlers", None)
    for name in (
        "get_ts_context",
        "ParamInfo",
        "get_json_tspec_read",
        "is_ocdbt_checkpoint",
    ):
        if not hasattr(handlers, name):
            raise Unrecognised(f"orbax.checkpoint.type_handlers.{name} is missing")
    return handlers


def read_specs(directory: str, names: dict[int, str], *, zarr3: bool) -> ReadSpecs:
    """The tensorstore context and specs orbax reads the arrays `names` (their
    names among the checkpoint's files, by position) of the checkpoint at
    `directory` with. Raises `Unrecognised` if orbax's type handlers are not as
    read here."""
    from etils import epath

    handlers = _type_handlers()
    try:
        ocdbt = handlers.is_ocdbt_checkpoint(epath.Path(directory))
        context = handlers.get_ts_context(use_ocdbt=ocdbt)
        specs = {}
        for k, name in names.items():
            info = handlers.ParamInfo(
                name=name,
                parent_dir=epath.Path(directory),
                is_ocdbt_checkpoint=ocdbt,
                use_zarr3=zarr3,
                ts_context=context,
            )
            specs[k] = handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
    except (TypeError, AttributeError) as error:  # another signature or form
        raise Unrecognised(f"orbax's type handlers: {error}") from error
    for k, spec in specs.items():
        if not (isinstance(spec, dict) and "driver" in spec):
            raise Unrecognised(
                f"orbax's tensorstore spec for {names[k]!r} is {type(spec).__name__}"
                ", not a JSON spec with a driver"
            )
    return ReadSpecs(context, specs)


class _OneReplicaArrays:
    """orbax's registry of type handlers, but that `jax.Array`s go to `arrays` (a
    handler): the registry a `PyTreeCheckpointHandler` saves through."""

    def __init__(self, handlers: Any, arrays: Any):
        self._handlers = handlers
        self._arrays = arrays

    def add(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("eqshard.save's registry of orbax handlers is read-only.")

    def get(self, ty: Any) -> Any:
        if ty == self._arrays.typestr() or (
            isinstance(ty, type) and issubclass(ty, jax.Array)
        ):
            return self._arrays
        return self._handlers.get_type_handler(ty)

    def has(self, ty: Any) -> bool:
        return ty == self._arrays.typestr() or self._handlers.has_type_handler(ty)


def one_replica_writer() -> Any:
    """A `PyTreeCheckpointHandler` as `StandardCheckpointHandler` makes it, but
    whose handler of `jax.Array`s saves each shard from one replica (see this
    module's docstring); `None` if another handler of `jax.Array`s has been
    registered with orbax (which is kept). Raises `Unrecognised` if orbax's
    handlers are not as read here."""
    import orbax.checkpoint as ocp

    handlers: Any = getattr(ocp, "type_handlers", None)
    for name in ("ArrayHandler", "get_type_handler", "has_type_handler"):
        if not hasattr(handlers, name):
            raise Unrecognised(f"orbax.checkpoint.type_handlers.{name} is missing")
    try:
        if type(handlers.get_type_handler(jax.Array)) is not handlers.ArrayHandler:
            return None
        # The store orbax's own handler has, which records typed PRNG keys.
        from orbax.checkpoint._src.metadata import array_metadata_store

        arrays = handlers.ArrayHandler(
            use_replica_parallel=False,
            array_metadata_store=array_metadata_store.Store(),
        )
        return ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=96,
            type_handler_registry=_OneReplicaArrays(handlers, arrays),
        )
    except (ImportError, TypeError, AttributeError) as error:
        raise Unrecognised(f"orbax's array handler: {error}") from error
