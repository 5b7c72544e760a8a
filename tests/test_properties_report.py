# The property suite for `StepReport.from_json` on hostile text: starting from a
# real report's `to_json` (a step with collectives, several parts and leaves), a
# mutation replaces a value anywhere in the document with another JSON value,
# removes or adds a field, wraps a value in a list or an object, nests it deeply,
# or damages the text itself. `from_json` only ever gives a report back (one that
# then works: its table, totals, diff and JSON) or raises eqshard's `ValueError`,
# which names the JSON path of a field it found wrong. Nothing is compiled per
# example, so the whole file takes a few seconds.
#
# `HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_properties_report.py`
# searches longer.

import functools
import json
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st
from jax.sharding import AxisType, PartitionSpec as P

import eqshard


@functools.cache
def _report_text() -> str:
    """A real report's JSON: a tensor-parallel MLP's gradient step on (2, 4), with
    all-reduces over both axes whose parts belong to leaves."""
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    k1, k2 = jax.random.split(jax.random.key(0))
    model = {
        "up": jax.random.normal(k1, (16, 64)),
        "down": jax.random.normal(k2, (64, 16)),
    }
    model = eqshard.shard(model, {"up": P(None, "tp"), "down": P("tp", None)}, mesh)
    x = eqshard.shard(np.ones((8, 16), np.float32), P("dp"), mesh)

    def step(model, x):
        def loss(model):
            return jnp.mean((jax.nn.relu(x @ model["up"]) @ model["down"]) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        return jax.tree.map(lambda p, g: p - 0.1 * g, model, grads), value

    return eqshard.analyze_step(step, model, x).to_json()


def _document() -> Any:
    return json.loads(_report_text())


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _places(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path into the document: keys of objects, indices of lists."""
    out = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _places(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _places(item, (*path, i))
    return out


def _get(document: Any, path: tuple) -> Any:
    for key in path:
        document = document[key]
    return document


def _set(document: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(document, path[:-1])[path[-1]] = value
    return document


def _mutate(data: st.DataObject, document: Any) -> Any:
    """One to three mutations of the document, at paths drawn from it."""
    for _ in range(data.draw(st.integers(1, 3))):
        places = _places(document)
        path = data.draw(st.sampled_from(places))
        old = _get(document, path)
        kind = data.draw(
            st.sampled_from(
                ["replace", "remove", "add", "wrap", "nest", "negate", "stringify"]
            )
        )
        event(kind)
        if kind == "replace":
            document = _set(document, path, data.draw(_VALUES))
        elif kind == "remove" and path:
            parent = _get(document, path[:-1])
            del parent[path[-1]]
        elif kind == "add" and isinstance(old, dict | list):
            value = data.draw(_VALUES)
            if isinstance(old, dict):
                old[data.draw(st.sampled_from([*old, "extra"] or ["extra"]))] = value
            else:
                old.append(value)
        elif kind == "wrap":
            document = _set(
                document, path, data.draw(st.sampled_from([[old], {"": old}]))
            )
        elif kind == "nest":
            depth = data.draw(st.sampled_from([2, 50, 5000]))
            value: Any = old
            for _ in range(depth):
                value = [value]
            document = _set(document, path, value)
            break  # too deep to walk again
        elif kind == "negate" and type(old) is int:
            document = _set(document, path, -old - data.draw(st.integers(0, 2)))
        elif kind == "stringify":
            document = _set(document, path, json.dumps(old))
    return document


def _check(text: str | bytes) -> None:
    """`from_json` gives back a report that works, or eqshard's ValueError."""
    try:
        report = eqshard.StepReport.from_json(text)
    except ValueError as error:
        message = str(error)
        assert message.startswith("eqshard.StepReport.from_json: "), message
        assert re.search(r"^  at ('[^']+'|the top level): expected ", message, re.M)
        event("refused")
        return
    event("read")
    assert isinstance(report, eqshard.StepReport)
    # Everything a report does works on what was read.
    assert report.table() and report.summary() and repr(report)
    assert report.total_bytes >= 0 and report.attributed_share >= 0
    assert all(row.link_bytes >= 0 for row in report.collectives)
    report.by_path()
    report.diff(eqshard.StepReport.from_json(_report_text()))
    assert eqshard.StepReport.from_json(report.to_json()) == report


def test_a_real_report_reads_back():
    text = _report_text()
    report = eqshard.StepReport.from_json(text)
    assert report.to_json() == text
    # The document has what the mutations should reach: collectives with parts
    # that belong to leaves.
    assert report.collectives and any(
        p.paths for r in report.collectives for p in r.parts
    )


@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_mutated_documents(data):
    document = _mutate(data, _document())
    try:
        text = json.dumps(document)
    except RecursionError:  # nested too deeply for `json.dumps` itself
        text = "[" * 5000 + "]" * 5000
    _check(text)


@settings(deadline=None, max_examples=100)
@given(data=st.data())
def test_damaged_text(data):
    text = _report_text()
    where = data.draw(st.integers(0, len(text)))
    kind = data.draw(st.sampled_from(["truncate", "insert", "delete", "bytes"]))
    event(kind)
    if kind == "truncate":
        _check(text[:where])
    elif kind == "insert":
        _check(
            text[:where]
            + data.draw(st.sampled_from(list('{}[],:"0-e ')))
            + text[where:]
        )
    elif kind == "delete":
        _check(text[:where] + text[where + 1 :])
    else:
        _check(data.draw(st.binary(max_size=64)))


@settings(deadline=None, max_examples=30)
@given(
    opening=st.sampled_from(["[", '{"a":', '{"format": 1, "jax": "x", "mesh": [']),
    depth=st.integers(1, 200_000),
)
def test_deep_nesting(opening, depth):
    _check(opening * depth)
    closing = {"[": "]", '{"a":': "}"}.get(opening, "]")
    _check(opening * depth + "0" + closing * depth)


@given(value=_VALUES)
def test_any_json_value(value):
    _check(json.dumps(value))


def test_integers_beyond_64_bits_are_refused():
    # JSON's integers have no bound; a report's are XLA's 64-bit figures. One
    # past them would read, then overflow in `summary()` (a float of 10**400).
    document = _document()
    document["memory"]["argument_bytes"] = 10**400
    with pytest.raises(ValueError, match=r"at 'memory/argument_bytes': expected an "):
        eqshard.StepReport.from_json(json.dumps(document))
    document["memory"]["argument_bytes"] = 2**63
    with pytest.raises(ValueError, match="an integer below 2\\*\\*63"):
        eqshard.StepReport.from_json(json.dumps(document))
    document["memory"]["argument_bytes"] = 2**40  # large, but a report's
    assert "TiB" in eqshard.StepReport.from_json(json.dumps(document)).summary()
