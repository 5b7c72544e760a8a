# Reading XLA's compiled text (eqshard/_step/_hlo/_text.py), checked on programs
# compiled here for the 8 virtual CPU devices: the groups of each spelling against
# the devices that share mesh coordinates, sizes against the arrays' own. A line
# the reader does not understand must raise, naming JAX's version and the line.

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from eqshard._step._hlo._flow import Program
from eqshard._step._hlo._text import (
    HloTextError,
    parse,
    parse_instruction,
    replica_groups,
)


def _compile(fn, *structs, out=None) -> str:
    text = jax.jit(fn, out_shardings=out).lower(*structs).compile().as_text()
    assert text is not None  # typed `str | None`: None where a backend has no text
    return text


def _struct(mesh, shape, *spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))


def _groups_along(mesh, *axes):
    """The device groups of a collective over `axes`: the devices (by position in
    the mesh) that share their coordinates on the other axes."""
    ids = np.arange(mesh.size).reshape(mesh.devices.shape)
    keep = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(ids.ndim) if i not in keep]
    size = int(np.prod([ids.shape[i] for i in keep]))
    return sorted(map(sorted, ids.transpose(rest + keep).reshape(-1, size).tolist()))


def _spelling(line):
    found = re.search(r"replica_groups=(\S)", line)
    if found is None:
        return None
    return {"{": "explicit", "[": "iota", "m": "mesh"}[found[1]]


def _mlp_step(w1, w2, x):
    def loss(w1, w2):
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - g1, w2 - g2, value


# The axes a case's collectives may be over: a list, or a function of the line.
_Axes = list[tuple[str, ...]] | Callable[[str], list[tuple[str, ...]]]


def test_replica_groups_of_each_spelling_are_the_devices_along_the_axes(mesh):
    # Sums over mesh axes, in several layouts: each group must read as the
    # devices that differ only along the axes summed over. XLA spells simple sums
    # with Shardy's `mesh[...]`, and the combined reductions of a training step
    # as iota or explicit lists: there the partial sums of the activations
    # (shape (4, 32)) are over 'tp', the weights' gradients over 'dp'.
    def by_shape(line: str) -> list[tuple[str, ...]]:
        if "f32[4,32]" in line:
            return [("tp",)]
        if "f32[8,16]" in line or "f32[6,32]" in line:
            return [("dp",)]
        return [("dp",), ("tp",)]

    cases: list[tuple[Callable[..., Any], list[list[Any]], P | None, _Axes]] = [
        (lambda a: a.sum(1), [[(8, 8), None, "tp"]], P(), [("tp",)]),
        (lambda a: a.sum(0), [[(8, 8), "dp", None]], P(), [("dp",)]),
        (lambda a: a.sum(1), [[(8, 8), "dp", "tp"]], P("dp"), [("tp",)]),
        (lambda a: a.sum(0), [[(8, 8), "dp", "tp"]], P("tp"), [("dp",)]),
        # A sum over both axes: one reduction over both, or one over each.
        (
            lambda a: a.sum(),
            [[(8, 8), "dp", "tp"]],
            P(),
            [("dp", "tp"), ("dp",), ("tp",)],
        ),
        (
            _mlp_step,
            [[(16, 32), None, "tp"], [(32, 24), None, "tp"], [(8, 16), "dp", None]],
            None,
            by_shape,
        ),
    ]
    seen = set()
    for fn, structs, out, axes in cases:
        text = _compile(
            fn,
            *(_struct(mesh, *struct) for struct in structs),
            out=None if out is None else NamedSharding(mesh, out),
        )
        for line in text.splitlines():
            if " all-reduce(" in line:
                seen.add(_spelling(line))
                attrs = parse_instruction(line).attrs
                groups = sorted(map(sorted, replica_groups(attrs, 8)))
                accepted = axes(line) if callable(axes) else axes
                assert groups in [_groups_along(mesh, *a) for a in accepted], line
    assert seen == {"explicit", "iota", "mesh"}


@pytest.mark.parametrize(
    "text, groups",
    [
        # As XLA prints them (the first four copied from compiles on this JAX).
        ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("[4,2]<=[2,2,2]T(1,0,2)", [[0, 1], [4, 5], [2, 3], [6, 7]]),
        ("{{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("{}", [list(range(8))]),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (
            "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}",
            [[0, 4], [1, 5], [2, 6], [3, 7]],
        ),
        # Sub-axes, as XLA's replica_group.cc defines them: `a:(pre)size` is the
        # part of axis `a` of that size with `pre` devices' worth more major.
        ("mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['a'=8] {'a':(2)4}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh['a'=8] {'a':(1)2,'a':(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ],
)
def test_replica_group_spellings(text, groups):
    assert replica_groups({"replica_groups": text}, 8) == groups


def test_mesh_groups_with_device_ids():
    # `mesh[...], device_ids=(...) {axes}` splits at the comma into two
    # attributes, as the line parser reads it.
    line = (
        "  %all-reduce = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups="
        "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_1'}, use_global_device_ids=true, to_apply=%add"
    )
    attrs = parse_instruction(line).attrs
    assert replica_groups(attrs, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_shapes_bytes_and_dtypes(mesh):
    # Sub-byte types packed by the layout (`E(4)`), and a tuple with XLA's
    # `/*index=5*/` comments.
    text = _compile(
        lambda a, b, c: (a, b, c),
        _struct(mesh, (16,), "tp", dtype=jnp.int4),
        _struct(mesh, (16,), "tp", dtype=jnp.bool_),
        _struct(mesh, (16,), "tp", dtype=jnp.bfloat16),
        out=NamedSharding(mesh, P()),
    )
    program = Program(text, caller="test", num_devices=8)
    results = program.entry.instructions[program.entry.root].slots
    assert [(s.dtype, s.dims, s.nbytes) for s in results] == [
        ("s4", (16,), 8),
        ("pred", (16,), 16),
        ("bf16", (16,), 32),
    ]
    line = (
        "  %t = (f32[2]{0}, s32[], f32[3]{0}, f32[3]{0}, f32[3]{0}, /*index=5*/"
        "f64[2,2]{1,0}) tuple(%a, %b, %c, %d, %e, %f)"
    )
    shapes = parse_instruction(line).slots
    assert [s.nbytes for s in shapes] == [8, 4, 12, 12, 12, 32]


@pytest.fixture(scope="module")
def sample(mesh):
    return _compile(
        lambda a: a.sum(1),
        _struct(mesh, (8, 8), None, "tp"),
        out=NamedSharding(mesh, P()),
    )


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda t: t.replace("f32[8]{0} all-reduce", "q99[8]{0} all-reduce"), "shape"),
        (lambda t: t.replace("all-reduce(", "all-frobnicate("), "unknown collective"),
        (
            lambda t: re.sub(
                r"replica_groups=\S+( \{[^}]*\})?", "replica_groups=<?>", t
            ),
            "replica groups",
        ),
        (lambda t: t.replace("ENTRY ", "ENTRY_POINT "), "outside any computation"),
        (lambda t: t + "\nsomething new\n", "outside any computation"),
    ],
)
def test_text_it_cannot_read_raises_naming_the_versions_and_the_line(
    sample, change, what
):
    changed = change(sample)
    assert changed != sample
    with pytest.raises(HloTextError, match=re.escape(f"JAX {jax.__version__}")) as e:
        Program(changed, caller="analyze_step", num_devices=8).collectives()
    message = str(e.value)
    assert message.startswith("eqshard.analyze_step:")
    assert what in message
    assert "The line is:" in message or "outside" not in what


def test_parse_keeps_every_computation(sample):
    module = parse(sample, caller="test")
    assert module.entry in module.computations
    calls = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", sample))
    assert calls <= module.computations.keys()
