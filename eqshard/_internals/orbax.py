"""orbax's type handlers: how orbax describes a checkpoint's files to tensorstore.

`restore`'s block reads on CPU (`_checkpoint/_blocks.py`) open the files with
the tensorstore spec orbax itself reads with, in one tensorstore context. These
come from `orbax.checkpoint.type_handlers`, which is not orbax's stable API:
when it does not have what is read here, or gives something of another form,
the reads raise `Unrecognised` and `restore` takes orbax's own read (the plain
route, `routes.py`). orbax is imported here only once the caller has checked it
is installed.
"""

import dataclasses
from typing import Any

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
