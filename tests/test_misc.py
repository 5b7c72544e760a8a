import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqshard


# ---------------------------------------------------------------------------------
# get_metrics
# ---------------------------------------------------------------------------------


def test_get_metrics_to_floats():
    metrics = {
        "loss": jnp.array(0.5),
        "acc": {"top1": jnp.array([0.25], jnp.bfloat16), "top5": np.float32(0.75)},
        "step": 3,
        "tag": "train",
    }
    got = eqshard.compat.get_metrics(metrics)
    assert got == {
        "loss": 0.5,
        "acc": {"top1": 0.25, "top5": 0.75},
        "step": 3.0,
        "tag": "train",
    }
    assert type(got["loss"]) is float and type(got["acc"]["top1"]) is float
    assert type(got["step"]) is float


def test_get_metrics_unreplicate(mesh):
    # one copy per device along the leading axis, as jax.pmap returns metrics
    loss = jax.device_put(jnp.full(8, 0.5), NamedSharding(mesh, P(("dp", "tp"))))
    metrics = {"loss": loss, "lr": 1e-3}
    assert eqshard.compat.get_metrics(metrics, unreplicate=True) == {
        "loss": 0.5,
        "lr": 1e-3,
    }


def test_get_metrics_stack():
    history = [
        {"loss": jnp.array(0.5), "n": 1},
        {"loss": jnp.array(0.25), "n": 2},
        {"loss": jnp.array(0.125), "n": 3},
    ]
    got = eqshard.compat.get_metrics(history, stack=True)
    np.testing.assert_array_equal(got["loss"], np.array([0.5, 0.25, 0.125], np.float32))
    np.testing.assert_array_equal(got["n"], np.array([1, 2, 3]))
    assert isinstance(got["loss"], np.ndarray) and got["loss"].dtype == np.float32


def test_get_metrics_stack_and_unreplicate():
    history = (
        {"loss": jnp.array([0.5, 0.5]), "vec": jnp.array([[1.0, 2.0], [1.0, 2.0]])},
        {"loss": jnp.array([0.25, 0.25]), "vec": jnp.array([[3.0, 4.0], [3.0, 4.0]])},
    )
    got = eqshard.compat.get_metrics(history, unreplicate=True, stack=True)
    np.testing.assert_array_equal(got["loss"], np.array([0.5, 0.25], np.float32))
    np.testing.assert_array_equal(got["vec"], np.array([[1.0, 2.0], [3.0, 4.0]]))


def test_get_metrics_errors():
    with pytest.raises(ValueError, match=r"'acc/top5' has shape \(5,\).*stack=True"):
        eqshard.compat.get_metrics({"acc": {"top5": jnp.zeros(5)}})
    with pytest.raises(ValueError, match="'loss' is a scalar.*unreplicate=False"):
        eqshard.compat.get_metrics({"loss": jnp.array(0.5)}, unreplicate=True)
    with pytest.raises(ValueError, match=r"metrics\[1\] at 'loss' is a scalar"):
        eqshard.compat.get_metrics(
            [{"loss": jnp.zeros(2)}, {"loss": jnp.array(0.5)}],
            unreplicate=True,
            stack=True,
        )
    with pytest.raises(TypeError, match="list or tuple of metric trees.*got dict"):
        eqshard.compat.get_metrics({"loss": jnp.array(0.5)}, stack=True)
    with pytest.raises(ValueError, match="at least one metric tree"):
        eqshard.compat.get_metrics([], stack=True)


@pytest.mark.parametrize(
    "second, where",
    [
        ({"loss": 1.0, "acc": 1.0}, "at '<root>'"),  # an extra key
        ({"loss": {"a": 1.0}}, "at 'loss'"),  # a subtree where a leaf was
        ({"loss": [1.0, 2.0]}, "at 'loss'"),
        ("first", "at 'loss'"),  # a leaf where the first tree has a subtree
    ],
)
def test_get_metrics_stack_structure_mismatch(second, where):
    first = {"loss": 0.5}
    if second == "first":
        first, second = {"loss": {"a": 1.0}}, first
    with pytest.raises(ValueError, match=rf"metrics\[1\].*{where}.*same structure"):
        eqshard.compat.get_metrics([first, second], stack=True)


def test_get_metrics_stack_mismatch_names_the_path():
    first = {"layers": [{"loss": 0.5}, {"loss": 0.5}]}
    second = {"layers": [{"loss": 0.5}, {"loss": 0.5, "aux": 0.1}]}
    with pytest.raises(ValueError, match="'layers/1'"):
        eqshard.compat.get_metrics([first, second], stack=True)


# ---------------------------------------------------------------------------------
# wrap_function_with_rng
# ---------------------------------------------------------------------------------


def _noise(key, shape, *, scale=1.0):
    return scale * jax.random.normal(key, shape)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_wrap_function_with_rng_threads_keys(make_key):
    key = make_key(0)
    f = eqshard.compat.wrap_function_with_rng(key)(_noise)
    assert isinstance(f, eqshard.compat.RngFunction)
    a, f1 = f((3,))
    b, f2 = f1((3,), scale=2.0)
    # the same keys by hand
    k1, s1 = jax.random.split(key)
    k2, s2 = jax.random.split(k1)
    np.testing.assert_array_equal(a, jax.random.normal(s1, (3,)))
    np.testing.assert_array_equal(b, 2.0 * jax.random.normal(s2, (3,)))
    assert not np.array_equal(a, b / 2.0)
    np.testing.assert_array_equal(jax.random.key_data(f2.key), jax.random.key_data(k2))
    # pure: calling the same RngFunction again repeats its key
    again, _ = f((3,))
    np.testing.assert_array_equal(again, a)


def test_wrap_function_with_rng_as_decorator_under_jit():
    @eqshard.compat.wrap_function_with_rng(jax.random.key(1))
    def noisy(key, x):
        return x + jax.random.normal(key, x.shape)

    @jax.jit
    def two_steps(f, x):
        x, f = f(x)
        return f(x)

    x = jnp.zeros(2)
    out, f = two_steps(noisy, x)
    expected, g = noisy(x)
    expected, g = g(expected)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_array_equal(
        jax.random.key_data(f.key), jax.random.key_data(g.key)
    )
    assert f.fn is noisy.fn


def test_wrap_function_with_rng_in_a_scan():
    f = eqshard.compat.wrap_function_with_rng(jax.random.key(2))(
        lambda key: jax.random.uniform(key)
    )

    def body(f, _):
        out, f = f()
        return f, out

    _, outs = jax.lax.scan(body, f, length=4)
    assert len(set(np.asarray(outs).tolist())) == 4  # four different keys


@pytest.mark.parametrize(
    "key",
    [
        jax.random.split(jax.random.key(0), 3),  # a batch of keys
        jnp.zeros((2, 2), jnp.uint32),
        jnp.zeros(2, jnp.float32),
        jnp.zeros(3, jnp.uint32),  # uint32, but not the shape of a key
        np.zeros(3, np.uint32),
    ],
)
def test_wrap_function_with_rng_rejects_non_keys(key):
    with pytest.raises(
        TypeError, match=r"^eqshard.compat.wrap_function_with_rng: `key` must"
    ):
        eqshard.compat.wrap_function_with_rng(key)


def test_wrap_function_with_rng_takes_a_numpy_key():
    key = np.asarray(jax.random.PRNGKey(3))
    out, _ = eqshard.compat.wrap_function_with_rng(key)(_noise)((2,))
    _, sub = jax.random.split(jax.random.PRNGKey(3))
    np.testing.assert_array_equal(out, jax.random.normal(sub, (2,)))


def test_wrap_function_with_rng_rejects_a_seed():
    with pytest.raises(TypeError, match="key"):
        # A seed, on purpose:
        eqshard.compat.wrap_function_with_rng(0)  # pyright: ignore[reportArgumentType]


# ---------------------------------------------------------------------------------
# round_up_to_multiple, pad_to_multiple
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, multiple, expected",
    [(50257, 8, 50264), (64, 8, 64), (0, 8, 0), (1, 1, 1), (7, 3, 9), (9, 3, 9)],
)
def test_round_up_to_multiple(n, multiple, expected):
    assert eqshard.compat.round_up_to_multiple(n, multiple) == expected


def test_numpy_integers_are_integers():
    # Sizes often come from shapes or configs as NumPy integers.
    assert eqshard.compat.round_up_to_multiple(np.int64(7), np.int32(8)) == 8
    assert type(eqshard.compat.round_up_to_multiple(np.int64(7), 8)) is int
    padded = eqshard.compat.pad_to_multiple(
        np.ones((5, 2)), np.int64(4), axis=np.int8(0)
    )
    assert padded.shape == (8, 2)
    with pytest.raises(
        ValueError, match="^eqshard.compat.round_up_to_multiple: `multiple`"
    ):
        eqshard.compat.round_up_to_multiple(np.int64(7), np.int64(0))


def test_round_up_to_multiple_errors():
    with pytest.raises(
        ValueError, match="`multiple` must be a positive integer.*got 0"
    ):
        eqshard.compat.round_up_to_multiple(5, 0)
    with pytest.raises(ValueError, match="`n` must be a size.*got -1"):
        eqshard.compat.round_up_to_multiple(-1, 4)


def test_pad_to_multiple_jax():
    x = jnp.arange(10.0).reshape(5, 2)
    y = eqshard.compat.pad_to_multiple(x, 4)
    assert isinstance(y, jax.Array) and y.shape == (8, 2) and y.dtype == x.dtype
    np.testing.assert_array_equal(y[:5], x)
    np.testing.assert_array_equal(y[5:], np.zeros((3, 2)))
    z = eqshard.compat.pad_to_multiple(x, 3, axis=-1)
    np.testing.assert_array_equal(z, np.pad(np.asarray(x), [(0, 0), (0, 1)]))
    assert eqshard.compat.pad_to_multiple(x, 5) is x


def test_pad_to_multiple_numpy_stays_on_host():
    x = np.ones((3, 5), np.int8)
    y = eqshard.compat.pad_to_multiple(x, 4, axis=1)
    assert type(y) is np.ndarray and y.dtype == np.int8
    np.testing.assert_array_equal(y, np.pad(x, [(0, 0), (0, 3)]))


def test_pad_to_multiple_under_jit():
    y = jax.jit(lambda x: eqshard.compat.pad_to_multiple(x, 8))(jnp.ones(50257 % 64))
    assert y.shape == (24,) and float(y.sum()) == 50257 % 64


def test_pad_to_multiple_errors():
    x = jnp.ones((3, 5))
    with pytest.raises(ValueError, match=r"`axis` 2 is not a dimension.*\(3, 5\)"):
        eqshard.compat.pad_to_multiple(x, 4, axis=2)
    with pytest.raises(ValueError, match=r"`axis` -3"):
        eqshard.compat.pad_to_multiple(x, 4, axis=-3)
    with pytest.raises(
        ValueError, match="`multiple` must be a positive integer.*got -2"
    ):
        eqshard.compat.pad_to_multiple(x, -2)


@pytest.mark.parametrize("stack", [False, True])
def test_get_metrics_names_prng_keys(stack):
    metrics = {"loss": jnp.array(0.5), "aux": {"key": jax.random.key(0)}}
    with pytest.raises(TypeError, match="PRNG keys at '(0/)?aux/key'"):
        eqshard.compat.get_metrics([metrics] if stack else metrics, stack=stack)
