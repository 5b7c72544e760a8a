import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


@pytest.mark.parametrize(
    "shape, spec, expected",
    [
        ((8, 8), P("dp", "tp"), P("dp", "tp")),
        ((3, 8, 5), P("dp", "tp", "sp"), P(None, "tp")),
        ((8,), P("dp", "tp"), P("dp")),
        ((8, 8), P("tp", "tp"), P("tp")),
        ((4, 6), P(("dp", "tp"), None), P("dp")),  # 4 % 8 != 0, 4 % 2 == 0
        ((8, 6), P(("tp", "dp")), P(("tp", "dp"))),
        ((), P("dp"), P()),
    ],
)
def test_corrected_spec(mesh, shape, spec, expected):
    assert eqshard.corrected_spec(shape, spec, mesh) == expected


def test_constraint_inside_jit_auto_axes(mesh):
    # An Equinox module with a callable leaf and static fields, inside filter_jit.
    linear = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    model = eqshard.shard((linear, jax.nn.gelu, None), P(), mesh)
    specs = (
        eqx.tree_at(lambda m: (m.weight, m.bias), linear, (P("dp", "tp"), P("tp"))),
        None,
        None,
    )

    @eqx.filter_jit
    def f(m, x):
        m = eqshard.with_sharding_constraint(m, specs)
        x = eqshard.with_sharding_constraint(x, P("dp"))
        return m, x * 2

    with jax.set_mesh(mesh):
        (out, act, none), x = f(model, jnp.ones((8, 2)))
    assert out.weight.sharding.spec == P("dp", "tp")
    assert out.bias.sharding.spec == P("tp")
    assert out.in_features == 8 and act is jax.nn.gelu and none is None
    assert x.sharding.spec == P("dp")


def test_constraint_resolves_logical_axis_names(mesh):
    rules = [("batch", "dp"), ("embed", "tp")]
    tree = {"x": jnp.ones((8, 16)), "y": jnp.ones((8,)), "n": 3}
    specs = {"x": eqshard.AxisNames("batch", "embed"), "y": P(), "n": None}
    out = eqshard.with_sharding_constraint(tree, specs, mesh=mesh, axis_rules=rules)
    assert out["x"].sharding == NamedSharding(mesh, P("dp", "tp"))
    assert out["y"].sharding == NamedSharding(mesh, P()) and out["n"] == 3

    @jax.jit
    def f(x):  # the rules context, as inside a Partitioner-partitioned function
        return eqshard.with_sharding_constraint(x, eqshard.AxisNames(None, "batch"))

    with jax.set_mesh(mesh), eqshard.logical_axis_rules(rules):
        assert f(jnp.ones((2, 8))).sharding.spec == P(None, "dp")
    with pytest.raises((TypeError, ValueError), match=r"rules"):
        # Bad rules are an error even when no leaf needs them.
        eqshard.with_sharding_constraint(
            tree, P(), mesh=mesh, axis_rules=[("batch", 3)]
        )
    with pytest.raises(TypeError, match=r"'x'.*`eqshard.AxisNames`"):
        eqshard.with_sharding_constraint(
            tree, {"x": "batch", "y": P(), "n": None}, mesh=mesh
        )


def test_constraint_explicit_axes_reshards(explicit_mesh):
    with jax.set_mesh(explicit_mesh):
        x = jax.device_put(jnp.ones((4, 8)), NamedSharding(explicit_mesh, P()))
        out = jax.jit(lambda t: eqshard.with_sharding_constraint(t, P("dp", "tp")))(x)
    assert out.sharding == NamedSharding(explicit_mesh, P("dp", "tp"))


def test_constraint_mixed_axis_types_raise():
    types = (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit)
    mixed = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=types)
    with pytest.raises(ValueError, match=r"'w'.*mixes mesh axes"):
        eqshard.with_sharding_constraint(
            {"w": jnp.ones((4, 8))}, P("dp", "tp"), mesh=mixed
        )


def test_constraint_inside_shard_map(mesh):
    # Inside `shard_map` over 'dp', 'dp' is a Manual axis: a replicated spec and
    # specs over the other axes constrain as `jax.lax.with_sharding_constraint`
    # does; naming 'dp' is an error.
    def body(tree):
        return eqshard.with_sharding_constraint(tree, {"a": P(), "b": P(None, "tp")})

    def run(fn, axis_names):
        mapped = jax.shard_map(
            fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names=axis_names
        )
        with jax.set_mesh(mesh):
            return jax.jit(mapped)({"a": jnp.ones((8, 4)), "b": jnp.ones((8, 4))})

    out = run(body, {"dp"})
    np.testing.assert_array_equal(out["a"], np.ones((8, 4)))
    run(lambda t: eqshard.with_sharding_constraint(t, P()), {"dp", "tp"})
    with pytest.raises(ValueError, match=r"P\('dp',\) at 'a' names 'dp'.*Manual"):
        run(
            lambda t: eqshard.with_sharding_constraint(t, {"a": P("dp"), "b": P()}),
            {"dp"},
        )


def test_constraint_without_mesh_is_a_no_op():
    x = jnp.ones(4)
    assert eqshard.with_sharding_constraint({"x": x}, P("dp"))["x"] is x


def test_constraint_on_invalid_modes(mesh):
    tree = {"w": jnp.ones((3, 8)), "ok": jnp.ones(8)}
    specs = {"w": P("dp", "tp"), "ok": P("dp")}
    with pytest.warns(
        UserWarning, match=r"'w' \(shape \(3, 8\)\).*Using P\(None, 'tp'\)"
    ):
        out = eqshard.with_sharding_constraint(tree, specs, mesh=mesh)
    assert out["w"].sharding.spec == P(None, "tp") and out["ok"].sharding.spec == P(
        "dp"
    )
    with pytest.raises(ValueError, match=r"'w' \(shape \(3, 8\)\)"):
        eqshard.with_sharding_constraint(tree, specs, mesh=mesh, on_invalid="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = eqshard.with_sharding_constraint(
            tree, specs, mesh=mesh, on_invalid="ignore"
        )
    assert out["w"].sharding.spec == P(None, "tp")


def test_explicit_mesh_inside_jit_without_set_mesh_gets_eqshards_error(explicit_mesh):
    def step(x):
        return eqshard.with_sharding_constraint(
            {"x": x}, {"x": P("dp")}, mesh=explicit_mesh
        )

    with pytest.raises(ValueError, match=r"'x'.*Explicit.*jax.set_mesh"):
        jax.jit(step)(jnp.ones(8))
    with jax.set_mesh(explicit_mesh):
        out = jax.jit(step)(jnp.ones(8))
    assert out["x"].sharding.spec == P("dp")


def test_replicated_spec_on_a_mixed_mesh():
    mixed = jax.make_mesh(
        (2, 4), ("dp", "tp"), axis_types=(AxisType.Auto, AxisType.Explicit)
    )

    def step(x):
        return eqshard.with_sharding_constraint(x, P(), mesh=mixed)

    for out in (jax.jit(step)(jnp.ones(8)), step(jnp.ones(8))):
        assert out.sharding.is_fully_replicated
        assert out.sharding.mesh.shape == mixed.shape
    with jax.set_mesh(mixed):
        out = jax.jit(lambda x: eqshard.with_sharding_constraint(x, P()))(jnp.ones(8))
    assert out.sharding.is_fully_replicated


def test_auto_mesh_under_an_explicit_set_mesh_gets_eqshards_error(mesh, explicit_mesh):
    def step(x):
        return eqshard.with_sharding_constraint({"x": x}, {"x": P("dp")}, mesh=mesh)

    with (
        jax.set_mesh(explicit_mesh),
        pytest.raises(ValueError, match=r"'x'.*Auto.*Explicit.*mesh="),
    ):
        jax.jit(step)(jnp.ones(8))


def test_constraint_on_invalid_is_checked_by_eqshard(mesh):
    with pytest.raises(ValueError, match="^eqshard.with_sharding_constraint: `on_inv"):
        eqshard.with_sharding_constraint(
            jnp.ones(8),
            P(),
            mesh=mesh,
            on_invalid="bogus",  # pyright: ignore[reportArgumentType]  # on purpose
        )


def test_correction_warning_points_at_the_callers_line(mesh):
    # Not at a line inside the type-check wrapper around with_sharding_constraint.
    def constrain(x):
        return eqshard.with_sharding_constraint(x, P("dp"), mesh=mesh)

    for call in (constrain, jax.jit(constrain)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(jnp.ones(3))
        assert [w.filename for w in caught] == [__file__]
        assert "cannot apply" in str(caught[0].message)


def test_unconstrained_on_explicit_axes_is_an_eqshard_error(explicit_mesh):
    with pytest.raises(
        ValueError, match=r"^eqshard.with_sharding_constraint: .* at 'w'"
    ):
        eqshard.with_sharding_constraint(
            {"w": jnp.ones(8)}, P(P.UNCONSTRAINED), mesh=explicit_mesh
        )


def test_constraint_outside_jit_on_a_size_0_array(mesh):
    # JAX's eager constraint gave the shards of a size-0 array the full shape, and
    # the array could then not be read.
    out = eqshard.with_sharding_constraint(jnp.zeros((2, 0)), P("dp"), mesh=mesh)
    assert out.sharding == NamedSharding(mesh, P("dp"))
    assert eqshard.gather(out).shape == (2, 0)
    assert {shard.data.shape for shard in out.addressable_shards} == {(1, 0)}


def test_a_deleted_array_is_an_eqshard_error(mesh):
    donated = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("dp")))
    donated.delete()
    with pytest.raises(
        ValueError, match=r"eqshard.with_sharding_constraint: .*'opt/mu'.*deleted"
    ):
        eqshard.with_sharding_constraint({"opt": {"mu": donated}}, P("dp"), mesh=mesh)


def test_a_sharding_on_an_abstract_mesh_needs_that_mesh_set(mesh):
    # JAX resolves it against the mesh set with `jax.set_mesh`: none, or one
    # without the axis, is eqshard's error naming the path.
    other = jax.sharding.AbstractMesh((8,), ("x",))
    specs = {"w": NamedSharding(other, P("x"))}
    tree = {"w": jnp.zeros(8)}
    match = r"(?s)eqshard.with_sharding_constraint: .*'w'.*abstract mesh"
    with pytest.raises(ValueError, match=match):
        eqshard.with_sharding_constraint(tree, specs)
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda t: eqshard.with_sharding_constraint(t, specs))(tree)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match + r".*'x'"):
        jax.jit(lambda t: eqshard.with_sharding_constraint(t, specs))(tree)
    # Under a mesh with its axes it applies.
    axis_x = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(axis_x):
        out = jax.jit(lambda t: eqshard.with_sharding_constraint(t, specs))(tree)
    assert out["w"].sharding == NamedSharding(axis_x, P("x"))
