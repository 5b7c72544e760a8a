"""`eqshard.dot_product_attention` over a context axis, and the sequence's
balancing: outputs and gradients against `jax.nn.dot_product_attention` on whole
arrays, the collectives each strategy compiles to, and bad input."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


B, T, N, H = 2, 32, 4, 8


@pytest.fixture(scope="module")
def cp_mesh():
    return jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)


def _qkv(heads: int = N, kv_heads: int = N, t: int = T, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, t, heads, H))
    k = jax.random.normal(ks[1], (B, t, kv_heads, H))
    v = jax.random.normal(ks[2], (B, t, kv_heads, H))
    return q, k, v


def _loss(attend, q, k, v, *rest):
    out = attend(q, k, v, *rest)
    return (out * jnp.cos(out)).sum(), out  # a loss whose gradient is not `out`


def _compare(mesh, ours, theirs, *args):
    """Our attention's outputs and gradients (in `jit`, on `mesh`, sequence over
    'cp') against JAX's on whole arrays (in `jit` too: one compile, not one per
    operation)."""
    grad = jax.grad(_loss, argnums=tuple(range(1, len(args) + 1)), has_aux=True)
    with jax.set_mesh(mesh):
        sharded = [
            jax.device_put(a, P("dp", "cp")) if jnp.ndim(a) == 4 else a for a in args
        ]
        got_grads, got = jax.jit(ft.partial(grad, ours))(*sharded)
    want_grads, want = jax.jit(ft.partial(grad, theirs))(*args)  # one device
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _segments():
    """Two packed sequences in row 0 (lengths 13 and 19), one in row 1."""
    row0 = (jnp.arange(T) >= 13).astype(jnp.int32)
    return jnp.stack([row0, jnp.zeros(T, jnp.int32)])


def _segment_mask(seg):
    return seg[:, None, :, None] == seg[:, None, None, :]


@pytest.mark.parametrize(
    "strategy, causal, kv_heads",
    [
        ("ring", False, N),
        ("ring", True, 2),
        ("all_gather", True, 2),
        ("ulysses", True, N),
    ],
)
def test_strategies_equal_jax(cp_mesh, strategy, causal, kv_heads):
    import eqshard

    q, k, v = _qkv(kv_heads=kv_heads)
    ours = ft.partial(
        eqshard.dot_product_attention,
        is_causal=causal,
        axis="cp",
        strategy=strategy,
        batch_axes=None if strategy == "ring" else "dp",
    )
    theirs = ft.partial(jax.nn.dot_product_attention, is_causal=causal)
    _compare(cp_mesh, ours, theirs, q, k, v)


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_packed_segments_causal(cp_mesh, strategy):
    import eqshard

    q, k, v = _qkv()
    seg = _segments()
    ours = ft.partial(
        eqshard.dot_product_attention,
        is_causal=True,
        segment_ids=seg,
        axis="cp",
        strategy=strategy,
    )
    theirs = ft.partial(
        jax.nn.dot_product_attention, mask=_segment_mask(seg), is_causal=True
    )
    _compare(cp_mesh, ours, theirs, q, k, v)


@pytest.mark.parametrize("strategy, kv_heads", [("ulysses", N)])
def test_bias_and_mask(cp_mesh, strategy, kv_heads):
    """A full `[B, N, T, S]` bias (its gradient too) and a key-padding mask
    `[B, 1, 1, S]` that leaves some rows with no key at all (the ring's case
    is in `test_ring_tiles_of_query_rows`)."""
    import eqshard

    q, k, v = _qkv(kv_heads=kv_heads)
    bias = jax.random.normal(jax.random.key(5), (B, N, T, T))
    mask = jnp.stack([jnp.arange(T) < 20, jnp.arange(T) >= 40])[:, None, None, :]

    def ours(q, k, v, bias):
        return eqshard.dot_product_attention(
            q, k, v, bias, mask, axis="cp", strategy=strategy
        )

    def theirs(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias, mask)

    _compare(cp_mesh, ours, theirs, q, k, v, bias)


def test_ring_tiles_of_query_rows(cp_mesh):
    """`block_size=2` of the 8 queries each device holds: four tiles per ring
    step, with causality, packed segments, GQA, a full bias (its gradient too)
    and a key mask that leaves rows 0 and 1 of batch 1 no key at all."""
    import eqshard

    q, k, v = _qkv(kv_heads=2)
    seg = _segments()
    bias = jax.random.normal(jax.random.key(5), (B, N, T, T))
    mask = jnp.stack([jnp.arange(T) < 28, jnp.arange(T) >= 2])[:, None, None, :]

    def ours(q, k, v, bias):
        return eqshard.dot_product_attention(
            q, k, v, bias, mask, is_causal=True, segment_ids=seg, axis="cp",
            block_size=2,
        )  # fmt: skip

    def theirs(q, k, v, bias):
        both = mask & _segment_mask(seg)
        return jax.nn.dot_product_attention(q, k, v, bias, both, is_causal=True)

    _compare(cp_mesh, ours, theirs, q, k, v, bias)


def test_balanced_positions_give_causal_result(cp_mesh):
    """Balanced inputs with their positions, unbalanced after: the causal result;
    and each device's causal work equal within 5 %."""
    import eqshard

    q, k, v = _qkv(kv_heads=2)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    with jax.set_mesh(cp_mesh):
        qb, kb, vb, pb = eqshard.balance_sequence((q, k, v, pos), axis="cp")

        @jax.jit
        def run(q, k, v, p):
            out = eqshard.dot_product_attention(
                q, k, v, is_causal=True, positions=p, axis="cp"
            )
            return eqshard.unbalance_sequence(out, axis="cp")

        got = run(qb, kb, vb, pb)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Causal work per device: pairs (query, key) with key position <= query's.
    shards = np.asarray(pb[0]).reshape(4, T // 4)
    work = [(p[:, None] >= np.arange(T)[None]).sum() for p in shards]
    assert max(work) <= 1.05 * min(work), work
    unbalanced = np.arange(T).reshape(4, T // 4)
    plain = [(p[:, None] >= np.arange(T)[None]).sum() for p in unbalanced]
    assert max(plain) > 2 * min(plain)  # what balancing fixes


def test_balance_order_by_hand():
    import eqshard

    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Explicit,) * 2)
    x = np.arange(16)[None, :, None]
    got = eqshard.balance_sequence(x, axis="cp", mesh=mesh)
    assert got[0, :, 0].tolist() == [
        0,
        1,
        14,
        15,
        2,
        3,
        12,
        13,
        4,
        5,
        10,
        11,
        6,
        7,
        8,
        9,
    ]
    back = eqshard.unbalance_sequence({"x": got, "n": None}, axis="cp", mesh=mesh)
    assert back["n"] is None and back["x"].tolist() == x.tolist()
    with pytest.raises(ValueError, match="'x'.*12.*not divisible by 2·4 = 8"):
        eqshard.balance_sequence({"x": np.zeros((1, 12))}, axis="cp", mesh=mesh)
    with pytest.raises(ValueError, match="axis='sp' is not in the mesh"):
        eqshard.unbalance_sequence(x, axis="sp", mesh=mesh)


class _Heads(eqx.Module):
    """A module calling the attention on one sequence `[T, N, H]`, vmapped."""

    def __call__(self, q, k, v):
        import eqshard

        return eqshard.dot_product_attention(q, k, v, is_causal=True, axis="cp")


def test_unbatched_under_vmap_and_explicit_axes():
    import eqshard

    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v = _qkv(kv_heads=2)
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, P("dp", "cp")) for a in (q, k, v)]
        got = jax.jit(jax.vmap(_Heads()))(*args)
    assert jax.typeof(got).sharding.spec == P("dp", "cp", None, None)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Batched on Explicit axes: the batch's axis read from the query's type.
    with jax.set_mesh(mesh):
        fn = ft.partial(
            eqshard.dot_product_attention,
            is_causal=True,
            axis="cp",
            strategy="all_gather",
        )
        compiled = jax.jit(fn).lower(*args).compile()
        got = compiled(*args)
    assert jax.typeof(got).sharding.spec == P("dp", "cp", None, None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    text = compiled.as_text()
    assert text is not None
    gathers = [x for x in text.splitlines() if " all-gather(" in x]
    assert gathers and all(
        "replica_groups={{0,1,2,3},{4,5,6,7}}" in x for x in gathers
    ), gathers


def _collectives(strategy: str, mesh) -> str:
    import eqshard

    fn = ft.partial(
        eqshard.dot_product_attention, axis="cp", strategy=strategy, batch_axes="dp"
    )
    with jax.set_mesh(mesh):
        q, k, v = jax.device_put(_qkv(), P("dp", "cp"))
        text = jax.jit(fn).lower(q, k, v).compile().as_text()
    assert text is not None
    return text


def test_collectives_per_strategy(cp_mesh):
    """Each strategy's collectives, and none over 'dp' (the batch stays split:
    every collective's groups are the four devices of a 'cp' row)."""
    cp_rows = "replica_groups={{0,1,2,3},{4,5,6,7}}"
    ring = _collectives("ring", cp_mesh)
    assert "collective-permute(" in ring
    assert "all-gather(" not in ring and "all-to-all(" not in ring
    gathered = _collectives("all_gather", cp_mesh)
    lines = [x for x in gathered.splitlines() if " all-gather(" in x]
    assert len(lines) == 2 and all(cp_rows in x for x in lines)  # keys, values
    assert "collective-permute(" not in gathered
    ulysses = _collectives("ulysses", cp_mesh)
    lines = [x for x in ulysses.splitlines() if " all-to-all(" in x]
    assert len(lines) == 4 and all(cp_rows in x for x in lines)  # q, k, v, out
    assert "all-gather(" not in ulysses and "collective-permute(" not in ulysses


def test_axis_none_is_jax_with_tokens():
    import eqshard

    q, k, v = _qkv()
    seg = _segments()
    got = eqshard.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        segment_ids=seg,
        key_value_seq_lengths=jnp.array([30, 20]),
    )
    want = jax.nn.dot_product_attention(
        q, k, v, mask=_segment_mask(seg), is_causal=True,
        key_value_seq_lengths=jnp.array([30, 20]),
    )  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"axis": "sp"}, "axis='sp' is not in the mesh"),
        ({"axis": "cp", "strategy": "ulysses", "kv": 2}, "size 4.*key has 2 heads"),
        ({"axis": "cp", "t": 30}, "length 30 is not divisible by axis 'cp' .size 4"),
        ({"axis": "cp", "positions": True}, "`positions` is given without"),
        ({"axis": "cp", "segment_ids": (2, 16)}, "`segment_ids` has shape .2, 16."),
        ({"axis": "cp", "local_window_size": 4}, "`local_window_size` with axis='cp'"),
        ({"axis": "cp", "strategy": "tree"}, "unknown strategy='tree'"),
        ({"axis": "cp", "block_size": 3}, "block_size=3 does not divide the 8"),
        (
            {"axis": "cp", "block_size": 2, "strategy": "ulysses"},
            "block_size=2 tiles the ring's scores, but strategy='ulysses'",
        ),
        ({"axis": "cp", "batch_axes": "cp"}, "batch_axes names 'cp', not an axis"),
        ({"axis": "cp", "batch_axes": ("dp", "x")}, "batch_axes names 'x'"),
        ({"mask": jnp.ones((B, N, T, T))}, "`mask` has dtype float32"),
        ({"bias": jnp.ones((N, 5, T))}, "`bias` has shape .4, 5, 32., not broad"),
    ],
)
def test_bad_input(cp_mesh, kwargs, match):
    import eqshard

    kwargs = dict(kwargs)
    q, k, v = _qkv(kv_heads=kwargs.pop("kv", N), t=kwargs.pop("t", T))
    if kwargs.pop("positions", None):
        kwargs["positions"] = jnp.zeros((B, T), jnp.int32)
    if "segment_ids" in kwargs:
        kwargs["segment_ids"] = jnp.zeros(kwargs["segment_ids"], jnp.int32)
    with pytest.raises(ValueError, match=match):
        eqshard.dot_product_attention(q, k, v, mesh=cp_mesh, **kwargs)


def test_no_mesh_inside_jit():
    import eqshard

    q, _, _ = _qkv()
    with pytest.raises(ValueError, match="dot_product_attention"):
        jax.jit(lambda q: eqshard.dot_product_attention(q, q, q, axis="cp"))(q)


def _temporaries(fn, q, mesh) -> tuple[int, int]:
    """XLA's temporaries per device of `fn` forward and of its gradient."""
    loss = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))
    found = []
    for f in (fn, loss):
        with jax.set_mesh(mesh):
            analysis = jax.jit(f).lower(q, q, q).compile().memory_analysis()
        assert analysis is not None
        found.append(analysis.temp_size_in_bytes)
    return found[0], found[1]


@pytest.mark.slow
def test_ring_temporaries_at_most_half_of_whole_scores(cp_mesh):
    """The ring's temporaries, forward and gradient, against JAX's function on
    the same sequence-split inputs (which holds `T/4 x T` scores per head)."""
    import eqshard

    q = jax.ShapeDtypeStruct(
        (2, 256, 4, 16), jnp.float32, sharding=NamedSharding(cp_mesh, P("dp", "cp"))
    )
    whole = _temporaries(
        ft.partial(jax.nn.dot_product_attention, is_causal=True), q, cp_mesh
    )
    ring = _temporaries(
        ft.partial(eqshard.dot_product_attention, is_causal=True, axis="cp"), q, cp_mesh
    )
    assert ring[0] <= whole[0] / 2 and ring[1] <= whole[1] / 2, (ring, whole)


@pytest.mark.slow
def test_ring_tiles_cut_temporaries(cp_mesh):
    """Tiles of 8 of the 256 queries each device holds: the ring's temporaries,
    forward and gradient, at most a third of one whole block's."""
    import eqshard

    q = jax.ShapeDtypeStruct(
        (2, 1024, 4, 16), jnp.float32, sharding=NamedSharding(cp_mesh, P("dp", "cp"))
    )
    ring = ft.partial(eqshard.dot_product_attention, is_causal=True, axis="cp")
    block = _temporaries(ring, q, cp_mesh)
    tiled = _temporaries(ft.partial(ring, block_size=8), q, cp_mesh)
    assert tiled[0] <= block[0] / 3 and tiled[1] <= block[1] / 3, (tiled, block)


@pytest.mark.slow
def test_ring_tiles_stay_tiled_in_a_scan_over_layers(cp_mesh):
    """The gradient of two layers scanned: JAX's partial evaluation must not
    hoist the causal mask (it depends on positions only) out of the tiles and
    stack every tile's (that was 2.3x one layer's temporaries)."""
    import eqshard

    q = jax.ShapeDtypeStruct(
        (2, 1024, 4, 16), jnp.float32, sharding=NamedSharding(cp_mesh, P("dp", "cp"))
    )
    attend = ft.partial(
        eqshard.dot_product_attention, is_causal=True, axis="cp", block_size=8
    )

    def layers(x):
        x, _ = jax.lax.scan(lambda h, _: (attend(h, h, h), None), x, None, length=2)
        return jnp.sum(x**2)

    found = []
    for loss in (layers, lambda x: jnp.sum(attend(x, x, x) ** 2)):
        with jax.set_mesh(cp_mesh):
            compiled = jax.jit(jax.grad(loss)).lower(q).compile()
        analysis = compiled.memory_analysis()
        assert analysis is not None
        found.append(analysis.temp_size_in_bytes)
    assert found[0] <= 1.5 * found[1], found


@pytest.mark.slow
def test_all_gather_keeps_no_mask_per_layer_in_a_scan(cp_mesh):
    """All-gather attention in a differentiated scan over layers, with and
    without remat: the causal mask (depending on positions only) is not stacked
    per layer as the ring's tiles once stacked theirs. Per device: one row of
    the batch, 512 of T=2048 queries, one head of 16, so the mask is
    512·2048 bools (1 MiB) and a layer's input 512·16 float32 (32 KiB). Each
    layer beyond the second adds, by hand: with remat its input only; without,
    the softmax's two float32 score arrays (2·512·2048·4 bytes), the gathered
    keys and values (2·2048·16·4), the queries (512·16·4) and the rows' max and
    sum (2·512·4). A mask per layer would add 1 MiB more each. (From 2 layers
    on, not 1: a scan of one layer is inlined, and the loop holds the mask
    once.)"""
    import eqshard

    q = jax.ShapeDtypeStruct(
        (2, 2048, 1, 16), jnp.float32, sharding=NamedSharding(cp_mesh, P("dp", "cp"))
    )
    attend = ft.partial(
        eqshard.dot_product_attention, is_causal=True, axis="cp", strategy="all_gather"
    )

    def temporaries(layers, remat):
        def layer(h, _):
            return attend(h, h, h), None

        def loss(x):
            body = jax.checkpoint(layer) if remat else layer
            return jnp.sum(jax.lax.scan(body, x, None, length=layers)[0] ** 2)

        with jax.set_mesh(cp_mesh):
            analysis = jax.jit(jax.grad(loss)).lower(q).compile().memory_analysis()
        assert analysis is not None
        return analysis.temp_size_in_bytes

    mask, inputs = 512 * 2048, 512 * 16 * 4
    kept = 2 * 512 * 2048 * 4 + 2 * 2048 * 16 * 4 + inputs + 2 * 512 * 4
    for remat, per_layer in ((True, inputs), (False, kept)):
        grown = (temporaries(4, remat) - temporaries(2, remat)) / 2
        assert grown <= per_layer + mask / 4, (remat, grown, per_layer)


def test_eager_cross_attention(cp_mesh):
    """Outside `jit`, queries shorter than the keys (causal as JAX's: top-left)."""
    import eqshard

    q = _qkv(t=16)[0]
    _, k, v = _qkv(kv_heads=2, seed=1)
    with jax.set_mesh(cp_mesh):
        got = eqshard.dot_product_attention(q, k, v, is_causal=True, axis="cp")
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_all_gather_bfloat16_gradient_on_cpu(cp_mesh):
    """bfloat16 keys gathered with the batch not manual: the gradient's
    reduce-scatter in 16 bits aborted XLA:CPU at T=2048 (`AllReducePromotion`);
    on the CPU backend the keys and values are gathered in float32."""
    import eqshard

    q = jax.ShapeDtypeStruct(
        (2, 2048, 8, 64), jnp.bfloat16, sharding=NamedSharding(cp_mesh, P("dp", "cp"))
    )
    k = jax.ShapeDtypeStruct((2, 2048, 4, 64), jnp.bfloat16, sharding=q.sharding)

    def loss(q, k, v):
        out = eqshard.dot_product_attention(
            q, k, v, is_causal=True, axis="cp", strategy="all_gather"
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(cp_mesh):
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        text = step.lower(q, k, k).compile().as_text()
    assert text is not None
    gathers = [line for line in text.splitlines() if "all-gather(" in line]
    assert gathers and all("bf16[" not in line.split("=")[1] for line in gathers)
