# A model's whole sharded life, on models of the structures third-party Equinox
# models have (tests/models.py): init on a (2, 4) mesh with the optimizer state,
# three steps that keep their layout, the layout checked, saved, restored onto a
# (4, 2) mesh, and a plan for a large configuration, in at most 10 lines of
# sharding code, the same for every model but the rules.
#
# A sharding line is one statement, as `ruff format` prints it, that calls
# eqshard, builds a mesh or writes a rule or spec (imports, the model, the
# optimizer, the loss and the data do not count; helper functions count with
# their bodies). `_sharding_lines` counts them in the source of `_life`, and the
# rules are one more.

import ast
import functools as ft
import inspect
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P
from models import CASES, OPTIMIZER, trainable

import eqshard


def _life(case, rules, directory, key):
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
    state = eqshard.init_sharded(case.make, key, specs=rules, mesh=mesh)
    step = eqshard.filter_jit(
        case.train_step,
        in_specs=(P("dp"), rules),
        out_specs=(1, P()),
        donate="all-except-first",
        mesh=mesh,
    )
    losses = []
    for _ in range(3):
        state, loss = step(case.batch, state)
        losses.append(float(loss))
    eqshard.check_layout(state, rules, mesh)
    eqshard.save(directory, state)
    other = eqshard.create_mesh((4, 2), ("dp", "tp"))
    restored = eqshard.restore(directory, ft.partial(case.make, key), rules, other)
    shapes = eqx.filter_eval_shape(case.big, key)
    plan = eqshard.plan_training(
        shapes,
        rules,
        AbstractMesh((2, 8), ("dp", "tp")),
        optimizer=OPTIMIZER,
        trainable=trainable(shapes),
    )
    return state, losses, restored, other, plan


def _sharding_lines(fn):
    """The statements of `fn`'s body that call eqshard, build a mesh, or write a
    rule or spec (compound statements count by their own lines only)."""
    source = textwrap.dedent(inspect.getsource(fn))
    count = 0
    for node in ast.walk(ast.parse(source).body[0]):
        if isinstance(node, ast.stmt) and not hasattr(node, "body"):
            text = ast.get_source_segment(source, node) or ""
            if any(word in text for word in ("eqshard.", "Mesh(", "P(")):
                count += 1
    return count


RULES = {
    # Layers stacked by filter_vmap and scanned: rules written for one layer.
    "esm2": [
        ("(query|key|value)_proj/weight|fc1/weight", eqshard.stacked(P("tp", None))),
        ("output_proj/weight|fc2/weight", eqshard.stacked(P(None, "tp"))),
        ("fc1/bias", eqshard.stacked(P("tp"))),
        ("embed/weight", P(None, "tp")),
        ("head/weight", P("tp")),
        (".*", P()),
    ],
    # The classifier's 10 rows divide over 'dp' of size 2, not 4: restored onto
    # the (4, 2) mesh, its spec (and its moments') loses 'dp', with a warning.
    "vit": [
        ("patch/weight", P("tp")),
        ("qkv/weight|fc1/weight", P("tp", None)),
        ("proj/weight|fc2/weight", P(None, "tp")),
        ("head/weight", P("dp", "tp")),
        (".*", P()),
    ],
    # bf16 weights, fp32 norms, the head tied to the embedding (eqx.nn.Shared).
    "mixed_lm": [
        ("tied/pytree/0/weight", P("tp")),
        ("w[zvr]/weight|fc[13]/weight", P("tp")),
        ("wh2/weight|fc2/weight", P(None, "tp")),
        (".*", P()),
    ],
    # BatchNorm's running statistics in eqx.nn.State, next to the model.
    "resnet": [("(stem|conv\\d)/weight", P("tp")), (".*", P())],
    # Layers stacked twice, each with a KV cache held by an eqx.nn.StateIndex.
    "flows": [
        ("(query|key|value)_proj/weight", eqshard.stacked(P("tp", None))),
        ("output_proj/weight", eqshard.stacked(P(None, "tp"))),
        ("cache", eqshard.stacked(P(None, None, "tp"))),
        (".*", P()),
    ],
    # Per-head weights split on their heads, SwiGLU's gate and up on their output.
    "decoder": [
        ("W_[QKVO]", P("tp")),
        ("w[13]/weight", P("tp")),
        ("w2/weight", P(None, "tp")),
        ("embed/weight", P(None, "tp")),
        (".*", P()),
    ],
    # Each block's convolutions split on their channels, as a pair.
    "unet": [
        ("conv1/weight|conv1/bias", P("tp")),
        ("conv2/weight", P(None, "tp")),
        (".*", P()),
    ],
}
TOLERANCE = {"mixed_lm": 2e-2}  # bf16: sums in another order round otherwise


def test_the_life_is_at_most_ten_sharding_lines():
    # mesh, init, step, check, save, the other mesh, restore, plan; and the rules.
    assert _sharding_lines(_life) + 1 == 9


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_whole_life(name, tmp_path):
    # RNG keys of XLA's own generator: constructors compile in half the time.
    case, rules, key = CASES[name], RULES[name], jax.random.key(0, impl="unsafe_rbg")
    # The values the life starts from, for the steps on one device below: built
    # as the life builds them (init_sharded keeps the program: no compile).
    mesh = eqshard.create_mesh((2, 4), ("dp", "tp"))
    initial = eqshard.init_sharded(case.make, key, specs=rules, mesh=mesh)
    reference = jax.tree.map(
        lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x,
        eqshard.gather(initial),
    )
    if name == "vit":
        with pytest.warns(UserWarning, match=r"(?s)3 specs changed.*'0/head/weight'"):
            state, losses, restored, other, plan = _life(
                case, rules, tmp_path / "ckpt", key
            )
    else:
        state, losses, restored, other, plan = _life(
            case, rules, tmp_path / "ckpt", key
        )
    # The same steps on one device, from the same values.
    step = eqx.filter_jit(case.train_step)
    expected = []
    for _ in range(3):
        reference, loss = step(case.batch, reference)
        expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=TOLERANCE.get(name, 1e-5))
    assert losses[-1] < losses[0]
    # Restored onto the other mesh: every array bit for bit, as the rules place
    # it there (where an axis no longer divides, without it).
    saved = jax.tree.leaves_with_path(eqshard.gather(state))
    back = jax.tree.leaves_with_path(eqshard.gather(restored))
    assert [path for path, _ in saved] == [path for path, _ in back]
    for (_, a), (_, b) in zip(saved, back, strict=True):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(_bits(a), _bits(b))
    specs = eqshard.restrict_specs(
        eqshard.match_partition_rules(rules, restored),
        other,
        like=restored,
        on_invalid="ignore",
    )
    eqshard.check_layout(restored, specs, other)
    # The plan: every array of the large model, gradients and Adam's two moments
    # for the trained ones (not the caches' initial values).
    shapes = eqx.filter_eval_shape(case.big, key)
    sizes = [x.size for x in jax.tree.leaves(shapes) if eqshard.is_array(x)]
    trained = [
        x.size
        for x in jax.tree.leaves(eqx.filter(shapes, trainable(shapes)))
        if eqshard.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    assert plan.params.total_parameters == sum(sizes)
    assert plan.grads is not None and plan.opt_state is not None
    assert plan.grads.total_parameters == sum(trained)
    assert plan.opt_state.total_parameters == 2 * sum(trained) + 1
    if name == "flows":
        assert sum(trained) < sum(sizes)
