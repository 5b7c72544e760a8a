"""`init_sharded` and eager `filter_shard_map` keep their traces: a warm call
traces nothing and compiles nothing, while a value the function reads that has
changed (a closed-over int, a config object's field, an array) is read again,
never served stale."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from probes import Compiles

import eqshard
from eqshard._build import _init
from eqshard._transforms import _shard_map


@pytest.fixture
def mesh():
    return eqshard.create_mesh((2, 4), ("dp", "tp"))


def _count_traces(monkeypatch, module, name):
    """`{name: n}`: how many times `module._trace` has been called since."""
    count = {name: 0}
    trace = module._trace

    def counted(*args, **kwargs):
        count[name] += 1
        return trace(*args, **kwargs)

    monkeypatch.setattr(module, "_trace", counted)
    return count


@pytest.fixture
def traces(monkeypatch):
    """How many times `init_sharded` traced its constructor."""
    return _count_traces(monkeypatch, _init, "init")


def test_a_warm_build_traces_nothing(mesh, traces):
    def build(key):
        return {"w": jax.random.normal(key, (8, 16)), "b": jnp.zeros(16)}

    first = eqshard.init_sharded(build, jax.random.key(0), specs=P("dp"), mesh=mesh)
    with Compiles() as compiles:
        again = eqshard.init_sharded(build, jax.random.key(1), specs=P("dp"), mesh=mesh)
    assert traces["init"] == 1 and compiles.count == 0
    expected = jax.random.normal(jax.random.key(1), (8, 16))
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(expected))
    assert not np.array_equal(np.asarray(first["w"]), np.asarray(again["w"]))
    # Other specs are another build.
    eqshard.init_sharded(build, jax.random.key(1), specs=P(), mesh=mesh)
    assert traces["init"] == 2


def test_a_changed_closed_over_int_is_traced_again(mesh, traces):
    width = 8

    def build(key):
        return jnp.full((8, width), 3.0)

    assert eqshard.init_sharded(
        build, jax.random.key(0), specs=P(), mesh=mesh
    ).shape == (8, 8)
    width = 16
    out = eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    assert out.shape == (8, 16) and traces["init"] == 2


@dataclasses.dataclass
class Config:
    scale: float


def test_a_changed_config_field_is_traced_again(mesh, traces):
    config = Config(2.0)

    def build(key):
        return jnp.ones((8,)) * config.scale

    one = eqshard.init_sharded(build, jax.random.key(0), specs=P("dp"), mesh=mesh)
    config.scale = 5.0
    two = eqshard.init_sharded(build, jax.random.key(0), specs=P("dp"), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(one), np.full(8, 2.0, np.float32))
    np.testing.assert_array_equal(np.asarray(two), np.full(8, 5.0, np.float32))
    assert traces["init"] == 2


def test_numpy_data_changed_in_place_is_read_again(mesh, traces):
    table = np.arange(8, dtype=np.float32)

    def build(key):
        return jnp.asarray(table) * 2

    eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    table[0] = 100.0
    out = eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    assert float(out[0]) == 200.0


class Opaque:
    """An object with slots and no value of its own: it cannot be keyed."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def test_what_cannot_be_keyed_is_traced_every_call(mesh, traces):
    box = Opaque(1.0)

    def build(key):
        return jnp.ones((8,)) * box.value

    eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    box.value = 4.0
    out = eqshard.init_sharded(build, jax.random.key(0), specs=P(), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out), np.full(8, 4.0, np.float32))
    assert traces["init"] == 2


@pytest.fixture
def map_traces(monkeypatch):
    """How many times eager `filter_shard_map` traced its function."""
    return _count_traces(monkeypatch, _shard_map, "map")


def test_a_warm_eager_map_traces_and_compiles_nothing(mesh, map_traces):
    x = eqshard.shard(np.arange(16, dtype=np.float32), P("dp"), mesh)
    double = eqshard.filter_shard_map(lambda x: x * 2, out_specs=P("dp"))
    double(x)
    y = x + 1
    with Compiles() as compiles:
        out = double(y)
    assert map_traces["map"] == 1 and compiles.count == 0
    np.testing.assert_array_equal(np.asarray(out), (np.arange(16) + 1) * 2.0)


def test_a_new_array_in_the_closure_recompiles_nothing(mesh, map_traces):
    x = eqshard.shard(np.ones(16, np.float32), P("dp"), mesh)
    bias = jnp.zeros(4)

    def add(x):
        return x + bias.sum()

    mapped = eqshard.filter_shard_map(add, out_specs=P("dp"))
    mapped(x)
    for step in range(1, 4):
        bias = jnp.full(4, step, jnp.float32)
        with Compiles() as compiles:
            out = mapped(x)
        assert compiles.count == 0
        np.testing.assert_array_equal(np.asarray(out), np.full(16, 1.0 + 4 * step))
    assert map_traces["map"] == 1


def test_a_changed_closed_over_int_is_mapped_again(mesh, map_traces):
    x = eqshard.shard(np.ones(16, np.float32), P("dp"), mesh)
    factor = 2
    mapped = eqshard.filter_shard_map(lambda x: x * factor, out_specs=P("dp"))
    np.testing.assert_array_equal(np.asarray(mapped(x)), np.full(16, 2.0))
    factor = 3
    np.testing.assert_array_equal(np.asarray(mapped(x)), np.full(16, 3.0))
    assert map_traces["map"] == 2


class Layer(eqx.Module):
    weight: jax.Array
    WIDTH = 8  # a class constant the constructor reads

    def __init__(self, key):
        self.weight = jax.random.normal(key, (8, self.WIDTH))


def test_a_module_class_is_kept_and_its_constant_read_again(mesh, traces, monkeypatch):
    eqshard.init_sharded(Layer, jax.random.key(0), specs=P("dp"), mesh=mesh)
    eqshard.init_sharded(Layer, jax.random.key(1), specs=P("dp"), mesh=mesh)
    assert traces["init"] == 1
    monkeypatch.setattr(Layer, "WIDTH", 16)
    out = eqshard.init_sharded(Layer, jax.random.key(1), specs=P("dp"), mesh=mesh)
    assert out.weight.shape == (8, 16) and traces["init"] == 2
