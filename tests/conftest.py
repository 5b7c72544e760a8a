# Every test runs with 8 virtual CPU devices. The config update must happen
# before any JAX computation; it raises if the backend is already initialised,
# so a wrong order fails loudly instead of silently giving one device.
#
# eqshard itself is not imported here: jaxtyping's import hook, where a run
# checks annotations at call time (`--jaxtyping-packages`, CONTRIBUTING.md),
# must see it first.

import os


# The suite runs on CPU. With the `tpu` and `gpu` extras installed, JAX would
# otherwise try libtpu and the CUDA plugin at the first backend use (seconds each,
# and warnings) before falling back to CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest
from hypothesis import HealthCheck, settings
from jax.sharding import AxisType


jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8, jax.devices()

# Property tests: no deadlines (the first example compiles) and no "too slow to
# generate" failures on a loaded 2-core machine. Under CI the examples are the same
# on every run and nothing is written to disk.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", parent=settings.get_profile("default"), derandomize=True, database=None
)
# A longer search, e.g. for the property suite (tests/test_properties.py):
# `HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_properties.py`.
settings.register_profile(
    "long", parent=settings.get_profile("default"), max_examples=5000
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE")
    or ("ci" if os.environ.get("CI") else "default")
)


@pytest.fixture(scope="session")
def mesh():
    """A (2, 4) mesh with Auto axes ('dp', 'tp'), as t5x/fjformer-style code expects."""
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="session")
def explicit_mesh():
    """The same mesh with Explicit axes, `jax.make_mesh`'s default."""
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
