"""The XLA options a step is compiled with: on a TPU target, by default, the
options production runs set through `LIBTPU_INIT_ARGS` (MaxText's configs among
them), which let the TPU compiler run weight all-gathers and permutes
asynchronously, beside computation. Without them the schedule the report reads
(overlap, exposed collective time) is not the one users run.

The user's `compiler_options=` win over these defaults, key by key, and an
option named in the `LIBTPU_INIT_ARGS` environment variable is left to it.
"""

import os
import re
from collections.abc import Sequence
from typing import Any

from .._mesh._targets import is_compile_only


# MaxText's TPU configs (`LIBTPU_INIT_ARGS` in its benchmarks' and
# `maxtext/configs/*` launch scripts) set these, all true.
TPU_ASYNC_OPTIONS: dict[str, Any] = {
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_overlap_compute_collective_tc": True,
    "xla_enable_async_all_gather": True,
    "xla_enable_async_collective_permute": True,
}


def _in_environment() -> set[str]:
    """The options `LIBTPU_INIT_ARGS` names (`--name=value`)."""
    text = os.environ.get("LIBTPU_INIT_ARGS", "")
    return set(re.findall(r"--?([\w.]+)", text))


def step_options(
    devices: Sequence[Any], options: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The options to compile with for `devices`: on a TPU target's devices,
    `TPU_ASYNC_OPTIONS` under the user's `options` (those `LIBTPU_INIT_ARGS`
    names left out); elsewhere `options` as given."""
    if not devices or devices[0].platform != "tpu" or not is_compile_only(devices[0]):
        return options
    named = _in_environment()
    merged = {k: v for k, v in TPU_ASYNC_OPTIONS.items() if k not in named}
    merged.update(options or {})
    return merged or None
