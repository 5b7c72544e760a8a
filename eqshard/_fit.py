"""The command's planner for the user's own model: load it abstractly, name an
optimizer, and propose partition rules that fit a per-device budget.

`python -m eqshard --model MODULE:CALLABLE` goes: `load_model` (the callable under
`eqx.filter_eval_shape`: nothing is allocated) -> the user's rules -> a
`plan_training` against `--device-memory`. With `--fit`, `propose_rules` adds
`auto_fsdp` over the mesh's data axes to every rule, lowering its size threshold
until the plan fits, and `rules_text` writes the specs it chose as a rules file
(one line per group of arrays that differ only in layer numbers).
"""

import importlib
import importlib.util
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from jaxtyping import PyTree

from ._auto import auto_fsdp
from ._plan import TrainingPlan
from ._rules import match_partition_rules
from ._specs import entry_axes
from ._tree import is_array, path_name


OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor", "none")
# The size thresholds `propose_rules` tries, largest first: arrays below it stay
# replicated, which costs memory but no communication.
THRESHOLDS = (2**20, 2**14, 0)


def _import(module: str) -> Any:
    if module.endswith(".py") or "/" in module:
        path = pathlib.Path(module)
        if not path.is_file():
            raise ValueError(f"--model: no file {module!r}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--model: cannot import the file {module!r}")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = loaded
        spec.loader.exec_module(loaded)
        return loaded
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: modules of the current directory
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ValueError(
            f"--model: cannot import {module!r} ({error}); run from the directory "
            "that holds it, set PYTHONPATH, or give a file path (model.py:fn)"
        ) from None


def load_model(text: str) -> PyTree:
    """The abstract model `MODULE:CALLABLE` (or `path/to/file.py:CALLABLE`) makes:
    the callable is called with no arguments under `eqx.filter_eval_shape`, so
    nothing is allocated; it may return a module or an abstract one."""
    module, sep, name = text.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(
            f"--model {text!r}: write MODULE:CALLABLE, e.g. mymodels:llama_7b or "
            "models.py:llama_7b (a function of no arguments returning the model)"
        )
    target = _import(module)
    fn = target
    for attribute in name.split("."):
        try:
            fn = getattr(fn, attribute)
        except AttributeError:
            raise ValueError(f"--model {text!r}: {module!r} has no {name!r}") from None
    if not callable(fn):
        raise ValueError(f"--model {text!r}: {name!r} is not callable")
    shapes = eqx.filter_eval_shape(fn)
    if not any(is_array(leaf) for leaf in jtu.tree_leaves(shapes)):
        raise ValueError(f"--model {text!r}: the model it returns has no arrays")
    return shapes


def make_optimizer(name: str) -> Any:
    """The optax optimizer of that name (learning rate 1e-4; the rate does not
    change the memory), or `None` for `"none"`."""
    if name == "none":
        return None
    try:
        import optax
    except ImportError:
        raise ValueError(
            f"--optimizer {name}: planning an optimizer's state needs optax "
            "(`pip install optax`); or pass --optimizer none to plan without one"
        ) from None
    makers: dict[str, Callable[[], Any]] = {
        "adamw": lambda: optax.adamw(1e-4),
        "adam": lambda: optax.adam(1e-4),
        "sgd": lambda: optax.sgd(1e-4),
        "lion": lambda: optax.lion(1e-4),
        "adafactor": lambda: optax.adafactor(1e-4),
    }
    if name not in makers:
        raise ValueError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return makers[name]()


def data_axes(mesh: Mesh | AbstractMesh) -> tuple[str, ...]:
    """The mesh's data axes, which FSDP shards parameters over."""
    return tuple(a for a in mesh.axis_names if a in ("data", "dp", "fsdp"))


def spec_text(spec: PartitionSpec) -> str:
    """`spec` in the rules-file form: `dp,tp`, `None,tp`, `dp+fsdp`, `()`."""
    if not len(spec):
        return "()"
    return ",".join("+".join(entry_axes(entry)) or "None" for entry in spec)


def _pattern(name: str, sep: str) -> str:
    """A regex for the path `name` with its sequence indices generalised."""
    parts = [r"\d+" if part.isdigit() else re.escape(part) for part in name.split(sep)]
    return "^" + re.escape(sep).join(parts) + "$"


def rules_text(tree: PyTree, specs: PyTree, *, header: Sequence[str] = ()) -> str:
    """A rules file that gives every array of `tree` its spec in `specs`: one line
    per group of paths that differ only in sequence indices (the layers), or one
    line per path where a group's specs differ."""
    names = [
        path_name(path, "/")
        for path, leaf in jtu.tree_flatten_with_path(tree)[0]
        if is_array(leaf)
    ]
    spec_leaves = [
        spec
        for spec in jtu.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        if isinstance(spec, PartitionSpec)
    ]
    groups: dict[str, list[tuple[str, PartitionSpec]]] = {}
    for name, spec in zip(names, spec_leaves, strict=True):
        groups.setdefault(_pattern(str(name), "/"), []).append((str(name), spec))
    lines = [f"# {line}" for line in header]
    for pattern, members in groups.items():
        if len({spec for _, spec in members}) == 1:
            lines.append(f"{pattern}  {spec_text(members[0][1])}")
        else:
            for name, spec in members:
                lines.append(f"^{re.escape(name)}$  {spec_text(spec)}")
    lines.append(".*  ()")
    return "\n".join(lines) + "\n"


def fsdp_rules(
    rules: Sequence[tuple[Any, PartitionSpec]],
    mesh: Mesh | AbstractMesh,
    axes: tuple[str, ...],
    min_size: int,
) -> list[tuple[Any, Any]]:
    """`rules` with FSDP over `axes` added to each spec, and a last rule that
    shards whatever they leave out."""
    out: list[tuple[Any, Any]] = [
        (regex, auto_fsdp(axes, base=spec, min_size=min_size, mesh=mesh))
        for regex, spec in rules
    ]
    out.append((".*", auto_fsdp(axes, min_size=min_size, mesh=mesh)))
    return out


def propose_rules(
    shapes: PyTree,
    rules: Sequence[tuple[Any, PartitionSpec]],
    mesh: Mesh | AbstractMesh,
    plan: Callable[[PyTree], TrainingPlan],
) -> tuple[PyTree, TrainingPlan, int]:
    """The specs of `rules` plus FSDP over the mesh's data axes, with the largest
    size threshold (in `THRESHOLDS`) whose plan fits, else the smallest; returns
    the specs, their plan and the threshold."""
    axes = data_axes(mesh)
    if not axes:
        raise ValueError(
            f"--fit adds FSDP over the mesh's data axes ('dp', 'fsdp' or 'data'), "
            f"but the mesh {dict(mesh.shape)} has none; add one to --mesh"
        )
    tried = []
    for min_size in THRESHOLDS:
        specs = match_partition_rules(fsdp_rules(rules, mesh, axes, min_size), shapes)
        tried.append((specs, plan(specs), min_size))
        if tried[-1][1].fits:
            break
    return tried[-1]
