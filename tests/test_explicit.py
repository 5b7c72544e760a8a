# A model's whole life on an Explicit (2, 4) mesh: built, placed, trained, checked,
# saved, restored, planned and mapped, each step against the same on an Auto mesh
# or raw JAX. One small model (an embedding, multi-head attention and a head,
# split Megatron-style over 'tp'), built once; few compiles.

import collections
import contextlib
import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqshard


VOCAB, D, HEADS, SEQ, BATCH = 32, 16, 4, 6, 4


class Tiny(eqx.Module):
    embed: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=k1)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k2)
        self.head = eqx.nn.Linear(D, VOCAB, key=k3)

    def __call__(self, tokens):  # (seq,) -> (seq, VOCAB)
        x = jax.vmap(self.embed)(tokens)
        x = x + self.attn(x, x, x)
        return jax.vmap(self.head)(x)


# Megatron-style: the attention's input projections split their outputs over
# 'tp' and its output projection its inputs, a contraction JAX cannot type on
# Explicit axes without being told the result's sharding.
RULES = [
    ("embed/weight", P(None, "tp")),
    ("attn/(query|key|value)_proj/weight", P("tp", None)),
    ("attn/output_proj/weight", P(None, "tp")),
    ("head/weight", P("tp", None)),
    (".*", P()),
]
KEY = jax.random.key(0)


def _placement(spec, ndim):
    """The mesh axes of each dimension: equal for `P('dp')` and `P('dp', None)`."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(
        () if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries
    )


def _assert_typed_as(tree, specs, mesh):
    """Every array's type (`jax.typeof`) says its spec, on Explicit axes of `mesh`."""
    arrays = jtu.tree_leaves(eqx.filter(tree, eqx.is_array))
    wanted = jtu.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(arrays) == len(wanted) > 0
    for x, spec in zip(arrays, wanted, strict=True):
        typed = jax.typeof(x).sharding
        assert typed.mesh.axis_types == (AxisType.Explicit,) * 2
        assert _placement(typed.spec, x.ndim) == _placement(spec, x.ndim), (x, spec)
        assert x.sharding.mesh == mesh


def _host(tree):
    """The arrays of `tree`, on the host."""
    return jtu.tree_leaves(eqx.filter(eqshard.gather(tree), eqx.is_array))


@pytest.fixture(scope="module")
def life(explicit_mesh):
    """The model made on the Explicit mesh, its specs, an optimizer and its state,
    and a batch of token ids split over 'dp'."""
    model = eqshard.init_sharded(Tiny, KEY, specs=RULES, mesh=explicit_mesh)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    specs = eqshard.match_partition_rules(RULES, params)
    optimizer = optax.adamw(1e-2)
    opt_specs = eqshard.derive_specs(
        jax.eval_shape(optimizer.init, params), params, specs
    )
    opt_state = eqshard.init_sharded(
        optimizer.init, params, specs=opt_specs, mesh=explicit_mesh
    )
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
    return dict(
        params=params,
        static=static,
        specs=specs,
        optimizer=optimizer,
        opt_specs=opt_specs,
        opt_state=opt_state,
        tokens=eqshard.shard(tokens, P("dp"), explicit_mesh),
    )


def test_mesh_builders_make_explicit_and_mixed_axes():
    names = ("dp", "tp")
    explicit, mixed = (AxisType.Explicit,) * 2, (AxisType.Explicit, AxisType.Auto)
    assert eqshard.create_mesh((2, 4), names).axis_types == (AxisType.Auto,) * 2
    meshes = [
        eqshard.create_mesh((2, 4), names, axis_types=AxisType.Explicit),
        eqshard.create_mesh("dp:2,tp:4", axis_types=AxisType.Explicit),
        eqshard.create_hybrid_mesh((2, 4), (1, 1), names, axis_types=AxisType.Explicit),
        eqshard.compat.get_jax_mesh("2,4", names, axis_types=AxisType.Explicit),
    ]
    for mesh in meshes:
        assert mesh.axis_types == explicit and mesh.axis_names == names
        assert mesh == jax.make_mesh((2, 4), names, axis_types=explicit)
    assert eqshard.create_mesh((2, 4), names, axis_types=mixed).axis_types == mixed
    with pytest.raises(ValueError, match=r"create_mesh: 1 axis_types for the 2"):
        eqshard.create_mesh((2, 4), names, axis_types=(AxisType.Explicit,))


def test_made_and_placed_on_explicit_axes(life, explicit_mesh):
    # `shard` places the eager constructor's arrays, and `gather` gives them back,
    # bit for bit; `init_sharded` builds the same (to a few ulp: a compiled
    # constructor), each array typed with its spec.
    eager = Tiny(KEY)
    specs = eqshard.match_partition_rules(RULES, eager)
    placed = eqshard.shard(eager, specs, explicit_mesh)
    _assert_typed_as(life["params"], life["specs"], explicit_mesh)
    _assert_typed_as(placed, specs, explicit_mesh)
    expected = _host(eager)
    assert len(_host(placed)) == len(_host(life["params"])) == len(expected)
    for a, b, c in zip(_host(placed), _host(life["params"]), expected, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_allclose(b, c, rtol=1e-6)
    # The optimizer state follows its parameters.
    _assert_typed_as(life["opt_state"], life["opt_specs"], explicit_mesh)
    eqshard.check_layout(
        (life["params"], life["opt_state"]),
        (life["specs"], life["opt_specs"]),
        explicit_mesh,
    )


def _forward(static):
    """The model's forward on a batch, under `eqshard.auto_axes`."""
    return eqshard.auto_axes(
        lambda params, tokens: jax.vmap(eqx.combine(params, static))(tokens),
        out_sharding=P("dp"),
    )


def _step(life):
    """One training step for both kinds of mesh (set with `jax.set_mesh`); inside
    it `check_layout` reads the types on Explicit axes."""
    specs, opt_specs, optimizer = life["specs"], life["opt_specs"], life["optimizer"]
    forward = _forward(life["static"])

    @eqx.filter_jit
    def step(params, opt_state, tokens):
        def loss_fn(params):
            logits = forward(params, tokens[:, :-1])
            labels = tokens[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, labels
            ).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = eqshard.with_sharding_constraint(grads, specs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqshard.with_sharding_constraint(
            optax.apply_updates(params, updates), specs
        )
        opt_state = eqshard.with_sharding_constraint(opt_state, opt_specs)
        eqshard.check_layout((grads, params, opt_state), (specs, specs, opt_specs))
        return params, opt_state, loss

    return step


def _train(life, mesh, steps):
    """`steps` training steps on `mesh` from the same start: the losses, and the
    parameters and optimizer state after."""
    specs, opt_specs, step = life["specs"], life["opt_specs"], _step(life)
    params = eqshard.shard(life["params"], specs, mesh)
    opt_state = eqshard.shard(life["opt_state"], opt_specs, mesh)
    tokens = eqshard.shard(life["tokens"], P("dp"), mesh)
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state, tokens)
            losses.append(float(loss))
    return losses, params, opt_state


def test_training_steps_equal_on_both_kinds_of_mesh(life, mesh, explicit_mesh):
    explicit = _train(life, explicit_mesh, 3)
    auto = _train(life, mesh, 3)
    np.testing.assert_allclose(explicit[0], auto[0], rtol=1e-5)
    assert explicit[0][-1] < explicit[0][0]
    for a, b in zip(_host(explicit[1:]), _host(auto[1:]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _assert_typed_as(explicit[1:], (life["specs"], life["opt_specs"]), explicit_mesh)
    eqshard.check_layout(auto[1:], (life["specs"], life["opt_specs"]), mesh)


def test_check_layout_inside_jit_reads_explicit_types_and_skips_auto(mesh):
    # Traced only: the checks run while tracing, nothing compiles.
    mixed = eqshard.create_mesh(
        (2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    explicit = eqshard.create_mesh((2, 4), ("dp", "tp"), axis_types=AxisType.Explicit)

    def trace(on, spec):
        def step(tree):
            eqshard.check_layout(tree, {"w": P("dp", "tp"), "b": spec}, on)
            return tree

        tree = {"w": jnp.ones((8, 4)), "b": jnp.ones(8)}
        tree = eqshard.shard(tree, {"w": P("dp", "tp"), "b": P("dp")}, on)
        jax.jit(step).trace(tree)

    trace(explicit, P("dp"))
    with pytest.raises(ValueError, match=r"'b' \(shape \(8,\)\): asked P\('tp',\)"):
        trace(explicit, P("tp"))
    # On a mixed mesh only the Explicit axis ('dp') is in the types.
    trace(mixed, P(("dp", "tp")))
    with pytest.raises(ValueError, match=r"'b'.*has spec P\('dp',"):
        trace(mixed, P(None))
    # Auto axes: a tracer's type reads P(None, None) whatever XLA will choose.
    trace(mesh, P("tp"))
    # Outside `jit` everything is checked, as before.
    placed = eqshard.shard(jnp.ones(8), P("dp"), mesh)
    with pytest.raises(ValueError, match=r"'<root>'.*has spec P\('dp',\)"):
        eqshard.check_layout(placed, P("tp"), mesh)


def test_analyze_step_on_explicit_axes(life, explicit_mesh):
    args = (life["params"], life["opt_state"], life["tokens"])
    with jax.set_mesh(explicit_mesh):
        report = eqshard.analyze_step(_step(life), *args)
    assert report.moved == ()  # every input where the program wants it
    arguments = {leaf.path: leaf.spec for leaf in report.arguments}
    outputs = {leaf.path: leaf.spec for leaf in report.outputs}
    assert arguments["params/embed/weight"] == outputs["out/0/embed/weight"]
    assert arguments["params/embed/weight"] == "P(None, 'tp')"
    assert arguments["tokens"] == "P('dp',)"


def test_partitioner_on_explicit_axes(life, explicit_mesh):
    partitioner = eqshard.t5x.Partitioner(mesh=explicit_mesh)
    double = partitioner.partition(
        lambda p: jax.tree.map(lambda x: 2 * x, p), (life["specs"],), life["specs"]
    )
    doubled = double(life["params"])
    _assert_typed_as(doubled, life["specs"], explicit_mesh)
    for a, b in zip(_host(doubled), _host(life["params"]), strict=True):
        np.testing.assert_array_equal(a, 2 * b)


def test_layers_jax_cannot_type_get_eqshards_error(life, explicit_mesh):
    # The model run as it is, traced only: JAX refuses the embedding's lookup of
    # token ids split over 'dp', and, with the ids replicated, the attention's
    # output projection (a contraction over 'tp' on both sides). eqshard's
    # message names the layer, its arrays and the fix.
    params, static, tokens = life["params"], life["static"], life["tokens"]

    def raw(params, tokens):
        return jax.vmap(eqx.combine(params, static))(tokens)

    with jax.set_mesh(explicit_mesh):
        with pytest.raises(Exception, match=r"out_sharding") as jax_error:
            jax.jit(raw).trace(params, tokens)
        assert not str(jax_error.value).startswith("eqshard")
        with pytest.raises(
            TypeError,
            match=r"^eqshard.analyze_step: .*`eqx.nn.Embedding` at 'embed' of "
            r"`params` in `raw` \(its arrays: 'embed/weight' float32\[32,16@tp\]; "
            r"at equinox/nn/_embedding.py:\d+\).*eqshard.auto_axes",
        ):
            eqshard.analyze_step(raw, params, tokens)
        replicated = eqshard.shard(tokens, P(), explicit_mesh)
        with pytest.raises(
            TypeError,
            match=r"`eqx.nn.Linear` at 'attn/output_proj' of `params` in `raw` "
            r"\(its arrays: 'attn/output_proj/weight' float32\[16,16@tp\]",
        ):
            eqshard.analyze_step(raw, params, replicated)
    partitioner = eqshard.t5x.Partitioner(mesh=explicit_mesh)
    forward = partitioner.partition(raw, (life["specs"], P("dp")), P("dp"))
    with pytest.raises(TypeError, match=r"^eqshard.t5x.PartitionedFn: .*'embed'"):
        forward.lower(params, tokens)


def test_auto_axes(mesh, explicit_mesh):
    # A contraction over 'tp' on both sides: JAX asks for the result's sharding
    # on Explicit axes; under `auto_axes` only 'tp' needs to be Auto. On an Auto
    # mesh the same call is the function and a constraint.
    x = eqshard.shard(jnp.arange(128.0).reshape(8, 16), P("dp", "tp"), explicit_mesh)
    w = eqshard.shard(jnp.ones((16, 4)), P("tp"), explicit_mesh)
    expected = np.arange(128.0).reshape(8, 16) @ np.ones((16, 4))

    def fn(x, w, label):  # a non-array in and out
        return x @ w, label

    def matmul(x, w):
        return x @ w

    with pytest.raises(Exception, match="out_sharding"):
        jax.jit(matmul).trace(x, w)
    # In no Equinox layer: eqshard's message names the line.
    with (
        jax.set_mesh(explicit_mesh),
        pytest.raises(TypeError, match=r"in an operation at .*test_explicit.py:\d+"),
    ):
        eqshard.analyze_step(matmul, x, w)
    # No `jax.set_mesh`: `mesh=` sets it (abstractly) for the call.
    for on, out_sharding in [
        (explicit_mesh, (P("dp"), None)),
        (mesh, [(".*", P("dp"))]),
    ]:
        mapped = eqshard.auto_axes(fn, out_sharding=out_sharding, axes="tp", mesh=on)
        args = eqshard.shard((x, w), (P("dp", "tp"), P("tp")), on)
        y, label = eqx.filter_jit(mapped)(*args, "label")
        assert label == "label"
        assert y.sharding.is_equivalent_to(NamedSharding(on, P("dp")), 2)
        np.testing.assert_array_equal(y, expected)
    assert jax.typeof(y).sharding.spec == P(None, None)  # Auto: not in the type
    with pytest.raises(ValueError, match=r"`out_sharding` has `None` at '0'"):
        jax.jit(
            eqshard.auto_axes(fn, out_sharding=None, mesh=explicit_mesh),
            static_argnums=2,
        ).trace(x, w, "label")
    with pytest.raises(ValueError, match=r"`axes` names 'sp'"):
        jax.jit(
            eqshard.auto_axes(fn, out_sharding=P(), axes="sp", mesh=explicit_mesh),
            static_argnums=2,
        ).trace(x, w, "label")
    with pytest.raises(ValueError, match=r"^eqshard.auto_axes: no mesh"):
        eqshard.auto_axes(fn, out_sharding=P())(x, w, "label")


def test_filter_shard_fails_on_explicit_axes_with_sharding_constraint_does_not(
    explicit_mesh,
):
    x = eqshard.shard(jnp.arange(32.0).reshape(8, 4), P("dp"), explicit_mesh)
    to = NamedSharding(explicit_mesh, P(None, "tp"))
    with jax.set_mesh(explicit_mesh):
        with pytest.raises((AssertionError, ValueError), match="reshard"):
            jax.jit(lambda x: eqx.filter_shard(x, to)).trace(x)
        y = jax.jit(lambda x: eqshard.with_sharding_constraint(x, P(None, "tp")))(x)
    assert jax.typeof(y).sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(y, np.arange(32.0).reshape(8, 4))


def test_checkpoints_round_trip_on_explicit_axes(life, mesh, explicit_mesh, tmp_path):
    tree = (life["params"], life["opt_state"])
    specs = (life["specs"], life["opt_specs"])
    eqshard.save(tmp_path / "ckpt", tree)
    back = eqshard.restore(tmp_path / "ckpt", tree, specs, explicit_mesh)
    _assert_typed_as(back, specs, explicit_mesh)
    onto_auto = eqshard.restore(tmp_path / "ckpt", tree, specs, mesh)
    eqshard.check_layout(onto_auto, specs, mesh)
    eqshard.save_safetensors(tmp_path / "model.safetensors", life["params"])
    loaded = eqshard.load_safetensors(
        tmp_path / "model.safetensors", life["params"], life["specs"], explicit_mesh
    )
    _assert_typed_as(loaded, life["specs"], explicit_mesh)
    expected = _host(tree)
    for got in (
        _host(back),
        _host(onto_auto),
        _host(loaded) + expected[len(_host(loaded)) :],
    ):
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)


def test_plan_training_on_explicit_axes(life, mesh, explicit_mesh):
    plans = [
        eqshard.plan_training(
            life["params"], life["specs"], m, optimizer=life["optimizer"]
        )
        for m in (explicit_mesh, mesh)
    ]
    assert plans[0].bytes_per_device == plans[1].bytes_per_device
    # The parameters' bytes are those `shard` placed on each device.
    placed = [0] * explicit_mesh.size
    order = {d: i for i, d in enumerate(explicit_mesh.devices.flat)}
    for x in jtu.tree_leaves(life["params"]):
        for s in x.addressable_shards:
            placed[order[s.device]] += s.data.nbytes
    assert list(plans[0].params.bytes_per_device) == placed


def test_shard_map_on_explicit_axes(life, explicit_mesh):
    # A per-device kernel over the model's blocks, its specs read from the arrays'
    # types (inside `eqx.filter_jit`), the output laid out as the parameters.
    mapped = eqshard.filter_shard_map(
        lambda params: jax.tree.map(jnp.square, params), out_specs=life["specs"]
    )
    with jax.set_mesh(explicit_mesh):
        squared = eqx.filter_jit(mapped)(life["params"])
    _assert_typed_as(squared, life["specs"], explicit_mesh)
    for a, b in zip(_host(squared), _host(life["params"]), strict=True):
        np.testing.assert_array_equal(a, np.square(b))


# The how-to "Train a sharded model end to end", run as it is on its Auto mesh and
# with its mesh made Explicit: the same losses over 5 steps, and every array laid
# out (typed, on Explicit axes) as planned after them.
PAGE = (
    pathlib.Path(__file__).resolve().parent.parent / "docs/how-to/train-end-to-end.md"
)
# On Explicit axes the page's model runs under `eqshard.auto_axes`; the page's
# forward, and what runs it there.
FORWARD = "jax.vmap(model)(tokens[:, :-1])"
UNDER_AUTO_AXES = (
    "eqshard.auto_axes(lambda m, t: jax.vmap(m)(t), out_sharding=P('dp'))"
    "(model, tokens[:, :-1])"
)


def _run_page(explicit, monkeypatch, tmp_path):
    text = PAGE.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    code = "\n".join(blocks).replace('jax.config.update("jax_num_cpu_devices", 8)', "")
    code = code.replace("range(3)", "range(5)")
    assert "range(5)" in code and FORWARD in code
    context = contextlib.nullcontext()
    if explicit:
        code = code.replace(FORWARD, UNDER_AUTO_AXES)
        # Every mesh the page makes (with `jax.make_mesh`, as `eqshard.create_mesh`
        # does) has Explicit axes, and the page's is the one set.
        make_mesh = jax.make_mesh

        def explicit_mesh(shape, names, **options):
            types = (AxisType.Explicit,) * len(names)
            return make_mesh(shape, names, **{**options, "axis_types": types})

        monkeypatch.setattr(jax, "make_mesh", explicit_mesh)
        context = jax.set_mesh(explicit_mesh((2, 4), ("dp", "tp")))
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    with context:
        exec(compile(code, str(PAGE), "exec"), namespace)
    return namespace


@pytest.mark.slow
def test_the_train_end_to_end_page_in_both_modes(monkeypatch, tmp_path):
    auto = _run_page(False, monkeypatch, tmp_path)
    explicit = _run_page(True, monkeypatch, tmp_path)
    assert len(auto["losses"]) == len(explicit["losses"]) == 5
    np.testing.assert_allclose(explicit["losses"], auto["losses"], rtol=1e-5)
    assert explicit["mesh"].axis_types == (AxisType.Explicit,) * 2
    # The model and its optimizer state, typed with the specs the rules give.
    state = explicit["state"]
    planned = eqshard.match_partition_rules(explicit["rules"], state)
    _assert_typed_as(state, planned, explicit["mesh"])
    eqshard.check_layout(auto["state"], auto["rules"], auto["mesh"])
    assert explicit["same"] == auto["same"] and all(explicit["same"])


_HEAD: Any = None  # a global that `_global_head` reads, set by the test


def _global_head(x):
    return jax.vmap(_HEAD)(x)


def test_auto_axes_with_a_model_read_from_outside(explicit_mesh):
    # Inside `fn` the axes are Auto, and only arguments are moved onto them: a
    # module given as `fn` is (its arrays too), a model `fn` closes over (or a
    # global) is not, and that is eqshard's error naming it, not JAX's.
    global _HEAD
    head = eqx.nn.Linear(16, 4, key=jax.random.key(1))
    x = np.arange(128.0, dtype=np.float32).reshape(8, 16)
    expected = x @ np.asarray(head.weight).T + np.asarray(head.bias)
    rules = [("weight", P(None, "tp")), ("bias", P())]
    head = eqshard.shard(head, rules, explicit_mesh)
    xs = eqshard.shard(x, P("dp", "tp"), explicit_mesh)
    forward = eqshard.auto_axes(
        eqx.filter_vmap(head), out_sharding=P("dp"), mesh=explicit_mesh
    )
    y = forward(xs)
    assert jax.typeof(y).sharding.spec == P("dp", None)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5)

    def closing_over(x):
        return jax.vmap(head)(x)

    with pytest.raises(
        ValueError,
        match=r"(?s)^eqshard.auto_axes: .*closing_over` reads arrays typed on them, "
        r"not as arguments: `head` \(its arrays at 'weight', 'bias'\).*"
        r"Pass those arrays as arguments",
    ):
        eqshard.auto_axes(closing_over, out_sharding=P("dp"), mesh=explicit_mesh)(xs)
    # Read beside it, dicts JAX cannot flatten (keys of several types) are passed
    # over: the model is still named.
    mixed = {1: "one", "two": 2}
    mixed_default = collections.defaultdict(int, {1: 1, "two": 2})

    def closing_over_dicts(x):
        return jax.vmap(head)(x) if mixed and mixed_default else x

    with pytest.raises(ValueError, match=r"(?s)closing_over_dicts` reads .*`head`"):
        eqshard.auto_axes(closing_over_dicts, out_sharding=P("dp"), mesh=explicit_mesh)(
            xs
        )
    _HEAD = head
    try:
        with pytest.raises(ValueError, match=r"(?s)`_global_head` reads .*`_HEAD`"):
            jax.jit(
                eqshard.auto_axes(
                    _global_head, out_sharding=P("dp"), mesh=explicit_mesh
                )
            )(xs)
    finally:
        _HEAD = None
