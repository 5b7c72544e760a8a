"""Tests for eqshard._caches: `clear_caches` empties every cache eqshard keeps."""

import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard
from eqshard import _caches
from eqshard._build import _init
from eqshard._spectree import _check_spec
from eqshard._step import _step
from eqshard._transforms import _shard_map
from eqshard._transforms._programs import Programs


def _modules():
    """Every module of eqshard but the command (which the root does not import)."""
    for info in pkgutil.walk_packages(eqshard.__path__, "eqshard."):
        if not info.name.startswith(("eqshard._cli", "eqshard.__main__")):
            yield importlib.import_module(info.name)


def test_every_cache_is_registered():
    """Each `functools` cache and `Programs` store at a module's top level is
    emptied by `clear_caches`: a new cache must register itself."""
    owners = {id(getattr(clear, "__self__", clear)) for clear in _caches._CLEARERS}
    missing = []
    for module in _modules():
        for name, value in vars(module).items():
            if isinstance(value, Programs) or (
                hasattr(value, "cache_clear")
                and getattr(value, "__module__", None) == module.__name__
                # The copy threads' pool is the process's threads, not a cache.
                and name != "_pool"
            ):
                if id(value) not in owners:
                    missing.append(f"{module.__name__}.{name}")
    assert not missing, missing


def _double(x):
    return 2 * x


def _step_fn(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)


def test_clear_caches_empties_each_kind_and_results_stay_right(mesh):
    x = jax.device_put(np.arange(16.0, dtype=np.float32), NamedSharding(mesh, P()))
    w = np.ones((4, 4), np.float32)
    batch = np.arange(8.0, dtype=np.float32).reshape(2, 4)

    def fill():
        doubled = eqshard.filter_shard_map(
            _double, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")
        )(x)
        built = eqshard.init_sharded(
            lambda key: {"w": jnp.full(8, 3.0)}, jax.random.key(0), specs=P(), mesh=mesh
        )
        report = eqshard.analyze_step(_step_fn, w, batch)
        eqshard.shard({"a": np.zeros((8, 4), np.float32)}, P("dp", "tp"), mesh=mesh)
        return doubled, built, report

    doubled, built, report = fill()
    assert len(_shard_map._PROGRAMS) > 0
    assert len(_init._PROGRAMS) > 0
    assert len(_step._REPORTS) > 0
    assert _check_spec._fits.cache_info().currsize > 0

    eqshard.clear_caches()

    assert len(_shard_map._PROGRAMS) == 0
    assert len(_init._PROGRAMS) == 0
    assert len(_step._REPORTS) == 0
    assert _check_spec._fits.cache_info().currsize == 0

    again, rebuilt, report_again = fill()
    np.testing.assert_array_equal(again, 2 * np.arange(16.0, dtype=np.float32))
    np.testing.assert_array_equal(rebuilt["w"], np.full(8, 3.0, np.float32))
    assert report_again is not report  # analysed again, not the forgotten one
    assert report_again.memory == report.memory
