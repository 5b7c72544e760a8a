# Every test runs with 8 virtual CPU devices. The config update must happen
# before any JAX computation; it raises if the backend is already initialised,
# so a wrong order fails loudly instead of silently giving one device.
#
# eqshard itself is not imported here: jaxtyping's import hook
# (`--jaxtyping-packages=eqshard,...` in pyproject.toml) must see it first.

import jax


jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8, jax.devices()
