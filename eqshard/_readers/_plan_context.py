"""What context-parallel attention holds on each device, for
`plan_training(context=)`.

With the sequence split over a mesh axis of `n` devices (each holding `t = T/n`
queries and `s = S/n` keys of a batch block `b`, `N` query heads and `K`
key/value heads of size `H`), [`eqshard.dot_product_attention`][]'s buffers are
float32 scores, whose shape depends on the strategy, and the keys and values it
gathers or passes on:

| strategy | one score array | keys and values | count |
|---|---|---|---|
| `ring` | `[b, N, r, s]`, a tile of `r` rows | two K and V blocks in flight | 4 / 2 |
| `all_gather` | `[b, N, t, S]` | the whole K and V | 4 / 3 |
| `ulysses` | `[b, N/n, T, S]` | all tokens of `N/n` and `K/n` heads (Q, K, V) | 4 / 2 |

The counts are for training / forward only. The ring takes its `t` queries `r`
rows at a time (`r` from `block_size`, else the most rows, a divisor of `t`,
whose scores fit in 256 MiB); when `r = t` (the whole block fits) it holds 5 / 2.
The counts are those of the compiled programs: XLA:CPU on 8 devices holds that
many score-sized arrays at its peak (training: the backward pass's score
gradients beside the recomputed probabilities), within 10 % at `T >= 2048`
(tests/test_attention_tools.py). XLA:GPU's programs for 8 H100s (deviceless, a
Llama-3-8B-shaped step: benchmarks/bench_context.py) hold fewer for all-gather
(the plan is 30 % over). Training adds the query's float32 gradient
accumulators and tiles (query-sized arrays: 8 for the untiled ring, 6 tiled,
one for the others). Only one layer's attention is live at a time, so this
counts once; the activations the layers keep for the backward pass
(`activation`, one per layer with rematerialisation) have their sequence split
over the axis as well.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._mesh._current import mesh_repr
from .._report import format_bytes, memory_row
from .._transforms._attention_checks import STRATEGIES
from .._transforms._attention_ring import tile_rows


_KEYS = (
    "axis",
    "strategy",
    "query",
    "kv_heads",
    "batch_axes",
    "activation",
    "layers",
    "block_size",
)
_DATA_AXES = ("dp", "fsdp", "data")
# Score-sized float32 arrays at the compiled peak: (training, forward only).
_SCORES = {"ring": (5, 2), "all_gather": (4, 3), "ulysses": (4, 2)}


def _context_error(what: str, fix: str) -> ValueError:
    return ValueError(f"eqshard.plan_training: `context` {what}; {fix}")


@dataclasses.dataclass(frozen=True)
class ContextBuffers:
    """What context-parallel attention holds on each device (see
    [`eqshard.plan_training`][]'s `context=`).

    **Fields:** `axis`, `size` (its devices), `strategy`; `scores`, the float32
    score arrays at the attention's peak; `keys_values`, the keys and values it
    gathers or has in flight; `accumulators`, the query's float32 gradient
    accumulators (0 without gradients); `activations`, the layers' kept
    activations, their sequence split over `axis`.
    """

    axis: str
    size: int
    strategy: str
    scores: int
    keys_values: int
    accumulators: int
    activations: int

    @property
    def total(self) -> int:
        """The bytes on each device."""
        return self.scores + self.keys_values + self.accumulators + self.activations

    def line(self) -> str:
        """The plan's summary line."""
        return memory_row(
            "context",
            self.total,
            f"({self.strategy} over {self.axis!r} of {self.size}: scores "
            f"{format_bytes(self.scores)}, keys/values "
            f"{format_bytes(self.keys_values)}, accumulators "
            f"{format_bytes(self.accumulators)}, activations "
            f"{format_bytes(self.activations)})",
        )


def _shape_of(value: Any, name: str, dims: int) -> tuple[tuple[int, ...], Any]:
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "dtype") or len(shape) != dims:
        raise _context_error(
            f"has {name}={value!r}, not a {dims}-d array",
            f"give {name} as a jax.ShapeDtypeStruct of its global shape"
            + (" [B, T, N, H]." if dims == 4 else " [B, T, D]."),
        )
    return tuple(int(n) for n in shape), value.dtype


def _sizes(context: Mapping[str, Any], mesh: Any) -> tuple[str, int, int]:
    """The context axis, its size and the batch axes' product."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    axis = context.get("axis", "cp")
    given = context.get("batch_axes")
    if given is None:
        batch = tuple(a for a in _DATA_AXES if a in sizes and a != axis)
    else:
        batch = (given,) if isinstance(given, str) else tuple(given)
    for name in (axis, *batch):
        if name not in sizes:
            raise _context_error(
                f"names the axis {name!r}, not in mesh {mesh_repr(mesh)}",
                "give `axis` and `batch_axes` axes of the mesh.",
            )
    return axis, sizes[axis], math.prod(sizes[a] for a in batch)


def _query(context: Mapping[str, Any], n: int) -> tuple[tuple[int, ...], int, int]:
    """`(B, T, N, H)`, `K` and the itemsize, checked against the axis size."""
    shape, dtype = _shape_of(context["query"], "query", 4)
    heads = shape[2]
    kv_heads = int(context.get("kv_heads", heads))
    strategy = context.get("strategy", "ring")
    if kv_heads < 1 or heads % kv_heads:
        raise _context_error(
            f"has kv_heads={kv_heads} for {heads} query heads",
            "give a number of key/value heads that divides the query heads.",
        )
    if shape[1] % n or (strategy == "ulysses" and (heads % n or kv_heads % n)):
        raise _context_error(
            f"has a query {shape} (kv_heads={kv_heads}) that the axis of {n} "
            f"devices does not split (the sequence, and for Ulysses the heads)",
            "give lengths (and heads) divisible by the axis's size.",
        )
    return shape, kv_heads, np.dtype(dtype).itemsize


def context_buffers(
    context: Mapping[str, Any], mesh: Any, *, gradients: bool
) -> ContextBuffers:
    """The buffers `context`'s attention holds on each device of `mesh`."""
    unknown = sorted(set(context) - set(_KEYS))
    if unknown or "query" not in context:
        raise _context_error(
            f"has unknown keys {unknown} or lacks 'query'",
            f"give {', '.join(map(repr, _KEYS))} ('query' required), e.g. "
            "{'axis': 'cp', 'strategy': 'ring', 'query': jax.ShapeDtypeStruct("
            "(8, 131072, 32, 128), jnp.bfloat16), 'kv_heads': 8}.",
        )
    strategy = context.get("strategy", "ring")
    if strategy not in STRATEGIES:
        raise _context_error(f"has strategy={strategy!r}", f"use one of {STRATEGIES}.")
    axis, n, batch = _sizes(context, mesh)
    (b, t, heads, h), kv_heads, item = _query(context, n)
    b = -(-b // batch)
    count = _SCORES[strategy][0 if gradients else 1]
    q_local, kv_local = b * (t // n) * heads * h, b * (t // n) * kv_heads * h
    queries = 8 if strategy == "ring" else 1  # float32, query-sized
    if strategy == "ring":
        local = t // n
        rows = tile_rows(local, b * heads * local * 4, context.get("block_size"))
        if rows < local:  # tiled
            count, queries = (4 if gradients else 2), 6
        scores = b * heads * rows * local
        keys_values = 2 * 2 * kv_local * item
    elif strategy == "all_gather":
        scores = b * heads * (t // n) * t
        keys_values = 2 * kv_local * n * item
    else:
        scores = b * (heads // n) * t * t
        keys_values = (q_local + 2 * kv_local) * item
    accumulators = queries * q_local * 4 if gradients else 0
    activations = 0
    if context.get("activation") is not None:
        (ab, at, d), dtype = _shape_of(context["activation"], "activation", 3)
        per = -(-ab // batch) * -(-at // n) * d * np.dtype(dtype).itemsize
        activations = int(context.get("layers", 1)) * per
    return ContextBuffers(
        axis, n, strategy, count * scores * 4, keys_values, accumulators, activations
    )


def context_from_text(text: str, dtypes: Mapping[str, Any]) -> dict[str, Any]:
    """`axis=cp,strategy=ring,query=8x131072x32x128,kv_heads=8,dtype=bfloat16`
    (the command's `--context`) as `plan_training`'s `context=`; `dtypes` by
    name. Raises `ValueError` saying how to write it."""
    fields: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        fields[key] = value
    usage = ValueError(
        f"--context {text!r}: write query=BxTxNxH (the attention's global query) "
        "and optionally axis= (cp), strategy= (ring, all_gather, ulysses), "
        "kv_heads=, dtype=, batch=AXIS (joined by +), activation=BxTxD, layers=; "
        "e.g. axis=cp,query=8x131072x32x128,kv_heads=8,dtype=bfloat16"
    )
    known = {"axis", "strategy", "query", "kv_heads", "dtype", "batch", "activation"}
    if set(fields) - known - {"layers"} or "query" not in fields:
        raise usage
    try:
        dtype = dtypes[fields.get("dtype", "float32").lower()]
        plan: dict[str, Any] = {
            name: jax.ShapeDtypeStruct(
                tuple(int(n) for n in fields[name].split("x")), dtype
            )
            for name in ("query", "activation")
            if name in fields
        }
        plan.update({k: int(fields[k]) for k in ("kv_heads", "layers") if k in fields})
    except (ValueError, KeyError):
        raise usage from None
    if "batch" in fields:
        plan["batch_axes"] = tuple(filter(None, fields["batch"].split("+")))
    plan.update({k: fields[k] for k in ("axis", "strategy") if k in fields})
    return plan
