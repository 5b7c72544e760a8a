# The built-in candidates of eqshard.search_layout: tensor-parallel pairs found
# from the step's matmuls and data flow (eqshard/_search/_flow.py,
# eqshard/_search/_candidates.py), checked on the candidates' spec trees, which
# are built without compiling: on the seven models of tests/models.py the
# candidates split attention (q, k and v on their output, the output projection
# on its input) in every transformer, and pair convolutions on their channels;
# the matrices no pair holds are those a person would leave alone.

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from models import ATTENTION, CASES

import eqshard
from eqshard._search import _flow as flow
from eqshard._search._candidates import (
    parameters,
    strategies,
    strategy_rules,
    tensor_pairs,
    unpaired,
)
from eqshard._spectree._check_spec import entry_axes


def _uses(fn, params, *rest):
    """The uses of `params`' arrays in `fn(params, *rest)`, from one trace."""
    arrays, static = eqx.partition(params, eqshard.is_array)

    def step(arrays, *rest):
        return eqx.filter(fn(eqx.combine(arrays, static), *rest), eqx.is_array)

    count = len(jax.tree.leaves(arrays))
    return flow.parameter_uses(jax.make_jaxpr(step)(arrays, *rest), count)


def _pairs(fn, params, *rest):
    found = parameters(params, _uses(fn, params, *rest))
    pairs = tensor_pairs(found)
    named = [
        (
            [m.name for m in p.firsts],
            [m.name for m in p.seconds],
            [b.name for b in p.biases],
        )
        for p in pairs
    ]
    return named, unpaired(found, pairs)


# ---------------------------------------------------------------------------------
# Pairs from the data flow, on small steps.
# ---------------------------------------------------------------------------------

D, S = 16, 8


def _layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1)


def _loss(forward):
    def step(params, x):
        return jax.grad(lambda p: forward(p, x).sum())(params)

    return step


def test_pairs_follow_the_data_not_the_names():
    # Names that say nothing: the products of `a` and `b` meet elementwise (a
    # gate) and feed `c`; `c`'s joins the residual stream, which a norm reads
    # before `d`, whose product feeds `e`; `e`'s product is summed with `f`'s
    # (a residual of two matrices): neither `e` nor `f` is a first.
    def forward(p, x):
        h = jax.nn.silu(x @ p["a"]) * (x @ p["b"])
        x = x + h @ p["c"]
        x = x + jnp.tanh(_layer_norm(x) @ p["d"]) @ p["e"] + x @ p["f"]
        return _layer_norm(x) @ p["g"]

    params = {
        "a": jnp.ones((D, 2 * D)),
        "b": jnp.ones((D, 2 * D)),
        "c": jnp.ones((2 * D, D)),
        "d": jnp.ones((D, D)),
        "e": jnp.ones((D, D)),
        "f": jnp.ones((D, D)),
        "g": jnp.ones((D, 4)),
    }
    pairs, alone = _pairs(_loss(forward), params, jnp.ones((S, D)))
    assert pairs == [(["a", "b"], ["c"], []), (["d"], ["e"], [])]
    assert alone == ["f", "g"]


def test_single_head_attention_pairs_only_the_values():
    # With one head, the scores contract q's and k's split dimension: only v's
    # product reaches `o` split; with heads, the scores keep them split.
    def forward(p, x, heads):
        q, k, v = (x @ p[n] for n in "qkv")
        split = [a.reshape(S, heads, -1) for a in (q, k, v)]
        scores = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", split[0], split[1]))
        return jnp.einsum("hqk,khd->qhd", scores, split[2]).reshape(S, D) @ p["o"]

    params = {n: jnp.ones((D, D)) for n in "koqv"}
    x = jnp.ones((S, D))
    one = _pairs(_loss(lambda p, x: forward(p, x, 1)), params, x)
    assert one == ([(["v"], ["o"], [])], ["k", "q"])
    four = _pairs(_loss(lambda p, x: forward(p, x, 4)), params, x)
    assert four == ([(["k", "q", "v"], ["o"], [])], [])


def _rotary_interleaved(x):
    """Rotary embeddings on `(seq, heads, head_dim)` that rotate interleaved
    pairs: strided slices, then the halves stacked and merged back."""
    size = x.shape[-1]
    angles = jnp.arange(x.shape[0])[:, None, None] / 10000 ** (
        jnp.arange(0, size, 2) / size
    )
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(x.shape)


def _rotary_complex(x):
    """The same as complex numbers (Llama's reference code)."""
    size = x.shape[-1]
    angles = jnp.arange(x.shape[0])[:, None, None] / 10000 ** (
        jnp.arange(0, size, 2) / size
    )
    turned = jax.lax.complex(x[..., ::2], x[..., 1::2]) * jnp.exp(1j * angles)
    return jnp.stack([turned.real, turned.imag], axis=-1).reshape(x.shape)


@pytest.mark.parametrize("rotary", [_rotary_interleaved, _rotary_complex])
def test_rotary_embeddings_with_strided_slices_keep_q_and_k_paired(rotary):
    # q and k go through the rotary embedding before their product: their
    # heads stay split through the slices, the stack and the reshape.
    def forward(p, x):
        q, k, v = (x @ p[n] for n in "qkv")
        q, k, v = (a.reshape(S, 4, -1) for a in (q, k, v))
        scores = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", rotary(q), rotary(k)))
        return jnp.einsum("hqk,khd->qhd", scores, v).reshape(S, D) @ p["o"]

    params = {n: jnp.ones((D, D)) for n in "koqv"}
    pairs = _pairs(_loss(forward), params, jnp.ones((S, D)))
    assert pairs == ([(["k", "q", "v"], ["o"], [])], [])


def test_an_operation_the_reader_does_not_know_ends_the_flow():
    # A sort along the split dimension: nothing is paired, nothing guessed.
    def forward(p, x):
        return jnp.sort(x @ p["up"], axis=-1) @ p["down"]

    params = {"up": jnp.ones((D, 2 * D)), "down": jnp.ones((2 * D, D))}
    assert _pairs(_loss(forward), params, jnp.ones((S, D))) == ([], ["down", "up"])


# ---------------------------------------------------------------------------------
# The seven models: attention split in every transformer.
# ---------------------------------------------------------------------------------

# Convolutions a person splits on their channels: the first of a pair on its
# output, the second on its input.
CHANNELS = {
    "resnet": [(r"^blocks/\d+/conv1/weight$", 0), (r"^blocks/\d+/conv2/weight$", 1)],
    # The transposed convolution's product feeds the decoder's first one.
    "unet": [
        (r"^(down|bottom)/conv1/weight$|^up/weight$", 0),
        (r"^(down|bottom)/conv2/weight$|^decode/conv1/weight$", 1),
    ],
}
# Embeddings split on their vocabulary (the tied head with them), and an untied
# head on its output, in the candidates "with the vocabulary".
VOCABULARY = {
    "mixed_lm": [(r"^tied/pytree/0/weight$", 0)],
    "decoder": [(r"^embed/weight$", 0), (r"^head/weight$", 0)],
}
# The matrices no pair holds: heads, the patch and stem convolutions, Megalodon's
# `wh1` (summed with `wh2`), the flows' final projection.
UNPAIRED = {
    "esm2": ["head/weight"],
    "vit": ["patch/weight", "head/weight"],
    "mixed_lm": ["layers/0/wh1/weight"],
    "resnet": ["stem/weight", "head/weight"],
    "flows": ["proj/weight"],
    "decoder": ["head/weight"],
    "unet": [],
}


def _candidate_specs(name, mesh):
    """The built-in tensor-parallel candidates' spec trees for the model of
    `CASES[name]`, by strategy name, and the matrices no pair holds."""
    case = CASES[name]
    state = eqx.filter_eval_shape(case.make, jax.random.key(0))
    model = state[0]

    def fn(model, rest, batch):
        return case.train_step(batch, (model, *rest))

    found = parameters(model, _uses(fn, model, state[1:], case.batch))
    pairs = tensor_pairs(found)
    specs = {}
    for strategy in [s for s in strategies(mesh, ("dp",)) if s.tp]:
        rules = strategy_rules(strategy, found, pairs, model, mesh)
        tree = eqshard.match_partition_rules(rules, model, mesh=mesh)
        leaves = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, P)
        )[0]
        specs[strategy.name] = {
            "/".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path): spec
            for path, spec in leaves
            if isinstance(spec, P)
        }
    return specs, unpaired(found, pairs)


def _splits(spec, dim, axis):
    return len(spec) > dim and axis in entry_axes(spec[dim])


@pytest.mark.parametrize("name", list(CASES))
def test_builtin_candidates_split_attention_in_every_transformer(name, mesh):
    specs, alone = _candidate_specs(name, mesh)
    wanted = ATTENTION.get(name, []) + CHANNELS.get(name, [])
    wanted += VOCABULARY.get(name, [])
    assert wanted, name
    # Every block's weights named by the patterns: each pattern matches.
    paths = next(iter(specs.values()))
    for pattern, _ in wanted:
        assert any(re.search(pattern, path) for path in paths), pattern

    def splits_all(layout):
        return all(
            _splits(spec, dim, "tp")
            for pattern, dim in wanted
            for path, spec in layout.items()
            if re.search(pattern, path)
        )

    assert [n for n, layout in specs.items() if splits_all(layout)], specs
    assert alone == UNPAIRED[name]


def test_the_search_lists_the_matrices_it_cannot_pair(mesh):
    # An MLP's pair, and a head whose product only the loss reads.
    def step(params, x):
        def loss(params):
            h = jax.nn.gelu(x @ params["up"]) @ params["down"]
            return jnp.mean((h @ params["head"]) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {
        "down": jnp.ones((4 * D, D)),
        "head": jnp.ones((D, 4)),
        "up": jnp.ones((D, 4 * D)),
    }
    x = eqshard.abstract(jax.ShapeDtypeStruct((S, D), jnp.float32), P("dp"), mesh)
    result = eqshard.search_layout(
        step, params, x, mesh=mesh, device_memory="1GiB", max_candidates=1
    )
    assert result.unpaired == ("head",)
    assert "not paired for tensor parallelism (1): head" in str(result)
    assert json.loads(result.to_json())["unpaired"] == ["head"]
