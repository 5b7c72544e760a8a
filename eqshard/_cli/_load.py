"""The user's code, as the command loads it: `import_target` imports what
`--model`, `--step` and `--args` name (`MODULE:CALLABLE` or
`path/to/file.py:CALLABLE`, a file under a module name of its own), and
`user_code_error` summarises an exception of that code (its innermost frames
in the user's files; `sys.exit` in that code is one too: the command's exit
code is never the user's code's). A module written as the docs teach starts
with `jax.config.update("jax_num_cpu_devices", 8)`: imported by the command,
whose devices are already made (`--devices`, `--target`), that line is
skipped with a note (`_devices_kept`). Also the command's exit codes and its
two kinds of error: `UsageError` (a bad option, or a `--model`, `--step` or
`--args` that names no module, file or callable: exit 2) and
`UserCodeError` (exit 3)."""

import contextlib
import hashlib
import importlib
import importlib.util
import os
import pathlib
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax


# The command's exit codes (its --help and docs/how-to/command-line.md list them).
EXIT_OK = 0
EXIT_DOES_NOT_FIT = 1  # also when the reader of the output goes away
EXIT_USAGE = 2
EXIT_USER_CODE = 3


class UsageError(Exception):
    """A bad option: reported as one line on stderr, with exit code 2."""


class UserCodeError(Exception):
    """The user's model or step raised: reported with the summary of its
    traceback, with exit code 3 (1 would read as "does not fit")."""


# What the user's code may raise, and the command reports as its error (exit 3):
# `sys.exit` included, whose code would otherwise be the command's.
USER_ERRORS = (Exception, SystemExit)


# Where the frames of a traceback that are not the user's come from.
_LIBRARY_DIRS = tuple(
    str(pathlib.Path(p).resolve())
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}
) + (str(pathlib.Path(__file__).resolve().parent.parent),)
_FRAMES = 6  # the user's frames a summary shows, the innermost


def user_code_error(what: str, error: BaseException) -> UserCodeError:
    """The one message for an exception of the user's code: `what` raised it, its
    type and message, and the innermost frames of the user's files."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [
        f
        for f in frames
        if not str(pathlib.Path(f.filename)).startswith(_LIBRARY_DIRS)
        and not f.filename.startswith("<frozen ")  # the import machinery
    ]
    shown = (mine or list(frames))[-_FRAMES:]
    message = " ".join(str(error).split())[:400]
    lines = [f"{what} raised {type(error).__name__}: {message}"]
    if isinstance(error, SystemExit):
        lines = [f"{what} called sys.exit({error.code!r})"]
    for frame in shown:
        where = os.path.relpath(frame.filename) if frame.filename else "?"
        where = frame.filename if where.startswith("..") else where
        lines.append(f"  {where}:{frame.lineno} in {frame.name}: {frame.line}")
    lines.append(
        "This is an error of your code, not of the plan: fix it and run the "
        f"command again (exit code {EXIT_USER_CODE})."
    )
    return UserCodeError("\n".join(lines))


def _module_name(path: pathlib.Path) -> str:
    """A module name of the user's file's own: never a standard or installed
    module's (`sub/typing.py` is not `typing`), the same for the same file (so
    `--model m.py:model --step m.py:step` load it once)."""
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    return f"_eqshard_user_{stem}_{digest}"


def _import(module: str, option: str) -> Any:
    if module.endswith(".py") or "/" in module:
        path = pathlib.Path(module).resolve()
        if not path.is_file():
            raise ValueError(f"{option}: no file {module!r}")
        name = _module_name(path)
        loaded = sys.modules.get(name)
        if loaded is not None:
            return loaded  # `--model m.py:model --step m.py:step`: one module
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{option}: cannot import the file {module!r}")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # for its dataclasses, pickling, ...
        try:
            with _devices_kept(option, module):
                spec.loader.exec_module(loaded)
        except USER_ERRORS as error:  # the user's code
            del sys.modules[name]
            raise user_code_error(f"{option}: importing {module!r}", error) from None
        return loaded
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: modules of the current directory
    try:
        with _devices_kept(option, module):
            return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and module.startswith(error.name):
            raise ValueError(
                f"{option}: cannot import {module!r} ({error}); run from the "
                "directory that holds it, set PYTHONPATH, or give a file path "
                "(model.py:fn)"
            ) from None
        raise user_code_error(f"{option}: importing {module!r}", error) from None
    except USER_ERRORS as error:  # the user's module raised while imported
        raise user_code_error(f"{option}: importing {module!r}", error) from None


@contextlib.contextmanager
def _devices_kept(option: str, module: str) -> Iterator[None]:
    """While the user's module is imported, `jax.config.update` of
    `jax_num_cpu_devices` (the first line of a module written as the docs
    teach) keeps the command's devices, made already, with a note on stderr
    where the number differs; JAX would raise."""
    config = jax.config
    update = config.update

    def kept(name: str, value: Any, *rest: Any, **kwargs: Any) -> None:
        have = getattr(config, "jax_num_cpu_devices")  # (not typed by JAX)
        if name != "jax_num_cpu_devices" or value == have:
            update(name, value, *rest, **kwargs)
            return
        print(
            f"python -m eqshard: note: {option} {module!r} sets "
            f"jax_num_cpu_devices to {value!r}; the command keeps its own "
            f"{have} (--devices, or --target's devices)",
            file=sys.stderr,
        )

    config.update = kept  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        del config.update  # the class's method again


_EXAMPLES = {
    "--model": "mymodels:llama_7b or models.py:llama_7b (a function of no "
    "arguments returning the model)",
    "--step": "mymodels:train_step or models.py:train_step (the training step "
    "as you call it: a function or an eqshard.filter_jit object)",
    "--args": "mymodels:step_args or models.py:step_args (a function of no "
    "arguments returning the step's arguments, as a tuple)",
}


def import_target(text: str, option: str) -> Callable[..., Any]:
    """The callable `MODULE:CALLABLE` (or `path/to/file.py:CALLABLE`) names, for
    `option` (`--model` or `--step`)."""
    module, sep, name = text.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(
            f"{option} {text!r}: write MODULE:CALLABLE, e.g. {_EXAMPLES[option]}"
        )
    fn = _import(module, option)
    for attribute in name.split("."):
        try:
            fn = getattr(fn, attribute)
        except AttributeError:
            raise ValueError(f"{option} {text!r}: {module!r} has no {name!r}") from None
    if not callable(fn):
        raise ValueError(f"{option} {text!r}: {name!r} is not callable")
    return fn
