"""eqshard: functional, typed, filtered pytree sharding for JAX and Equinox."""

import importlib.metadata


__version__ = importlib.metadata.version("eqshard")
