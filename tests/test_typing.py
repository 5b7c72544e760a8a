# The shared `@typecheck` of public functions (eqshard/_typing.py): a wrong type
# for a public entry point's argument is eqshard's one-line TypeError naming the
# function, the argument, what was given and what is expected, never jaxtyping's
# dump of the whole call. beartype checks the annotations, within jaxtyping's
# `jaxtyped` where they name jaxtyping's arrays (whose dimensions must agree).

import re
from collections.abc import Sequence
from typing import Literal

import jax
import jaxtyping
import numpy as np
import pytest
from jax.sharding import AxisType

import eqshard
from eqshard._typing import typecheck


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: eqshard.create_mesh(target=8),  # pyright: ignore[reportArgumentType]
            "eqshard.create_mesh: `target` is 8 (int); expected str or None.",
        ),
        (
            lambda: eqshard.create_mesh((8,), ("x",), num_slices=2.0),  # pyright: ignore[reportArgumentType]
            "eqshard.create_mesh: `num_slices` is 2.0 (float); expected int or a "
            "NumPy integer.",
        ),
        (
            lambda: eqshard.search_layout(len, [1], max_candidates=4.0),  # pyright: ignore[reportArgumentType]
            "eqshard.search_layout: `max_candidates` is 4.0 (float); expected int, "
            "a NumPy integer or None.",
        ),
        (
            lambda: eqshard.filter_jit(3),  # pyright: ignore[reportArgumentType]
            "eqshard.filter_jit: `fn` is 3 (int); expected a function or None.",
        ),
    ],
)
def test_a_wrong_type_is_one_line_naming_the_argument(call, message):
    # (The calls pass wrong types on purpose: the error path under test.)
    with pytest.raises(TypeError) as caught:
        call()
    assert str(caught.value) == message


def test_a_wrong_closed_option(mesh):
    # `pipeline` checks its closed options itself (1F1B gets its own reason).
    with pytest.raises(ValueError) as caught:
        eqshard.pipeline(
            lambda p, x: x,
            {},
            jax.numpy.zeros((8, 4)),
            microbatches=4,
            schedule="1f1b",  # pyright: ignore[reportArgumentType]
            mesh=mesh,
        )
    assert "\n" not in str(caught.value)
    assert re.match(
        r"eqshard\.pipeline: schedule='1f1b' is not offered", str(caught.value)
    )


@typecheck
def _names(names: Sequence[str]) -> int:
    return len(names)


def test_a_bad_item_of_a_sequence_is_named():
    # beartype checks one random item of a sequence, and jaxtyping, checking
    # again to find the argument, may pick a good one and name none: the
    # argument whose item is wrong is then found and named all the same.
    raised = []
    for _ in range(60):
        try:
            _names(["x", 1])  # pyright: ignore[reportArgumentType]
        except TypeError as error:
            raised.append(str(error))
    assert raised
    for message in raised:
        assert message == (
            "eqshard._names: `names` is ['x', 1] (list); expected a sequence of str."
        )


@typecheck
def _inner(name: str) -> str:
    return name


@typecheck
def _outer(count: int, *, kind: Literal["a", "b"] = "a", sizes: Sequence[int] = ()):
    return _inner(count)  # pyright: ignore[reportArgumentType]  (a bug inside)


def test_only_the_functions_own_arguments_are_rewritten():
    with pytest.raises(TypeError, match=r"^eqshard\._outer: `kind` is 'c' \(str\); "):
        _outer(1, kind="c")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"expected one of 'a', 'b'\.$"):
        _outer(1, kind="c")  # pyright: ignore[reportArgumentType]
    # A wrong type inside the function is the inner function's error.
    with pytest.raises(TypeError, match=r"^eqshard\._inner: `name` is 1 \(int\)"):
        _outer(1)
    # Right types pass through the check.
    assert _inner("x") == "x"
    mesh = eqshard.create_mesh((8,), ("x",), axis_types=AxisType.Auto)
    assert mesh.shape == {"x": 8}


@typecheck
def _rows(
    a: jaxtyping.Float[np.ndarray, "n 2"], b: jaxtyping.Float[np.ndarray, "n 2"]
) -> int:
    return a.shape[0]


def test_array_dimensions_agree_across_arguments():
    assert _rows(np.zeros((3, 2)), np.zeros((3, 2))) == 3
    with pytest.raises(TypeError, match=r"^eqshard\._rows: `b` is "):
        _rows(np.zeros((3, 2)), np.zeros((4, 2)))


def test_jaxtyping_disable_turns_the_check_off():
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        assert _inner(1) == 1  # pyright: ignore[reportArgumentType]
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    with pytest.raises(TypeError, match=r"^eqshard\._inner: `name` is 1 \(int\)"):
        _inner(1)  # pyright: ignore[reportArgumentType]
