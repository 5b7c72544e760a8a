import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import eqshard


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def llama(layers=4, dim=4096, hidden=11008, kv=1024, vocab=32000):
    block = lambda: {  # noqa: E731
        "attn": {
            "q": sds(dim, dim),
            "k": sds(dim, kv),
            "v": sds(dim, kv),
            "o": sds(dim, dim),
        },
        "mlp": {
            "gate": sds(dim, hidden),
            "up": sds(dim, hidden),
            "down": sds(hidden, dim),
        },
        "norm1": sds(dim),
        "norm2": sds(dim),
    }
    return {
        "embed": sds(vocab, dim),
        "layers": [block() for _ in range(layers)],
        "norm": sds(dim),
        "head": sds(dim, vocab),
    }


def moe(layers=2, dim=4096, hidden=14336, experts=8, vocab=32768):
    block = lambda: {  # noqa: E731
        "attn": {"qkv": sds(dim, 3 * dim), "o": sds(dim, dim)},
        "router": sds(dim, experts),
        "experts": {
            "up": sds(experts, dim, hidden),
            "down": sds(experts, hidden, dim),
        },
        "norm": sds(dim),
    }
    return {"embed": sds(vocab, dim), "layers": [block() for _ in range(layers)]}


MESHES = [
    ((8,), ("fsdp",), "fsdp"),
    ((2, 8), ("fsdp", "tp"), "fsdp"),
    ((64, 4), ("fsdp", "tp"), "fsdp"),
    ((16, 32), ("dp", "fsdp"), ("dp", "fsdp")),
    ((2048,), ("fsdp",), "fsdp"),
    ((8, 256), ("dp", "fsdp"), ("dp", "fsdp")),
]


def _expected(shape, n, min_size):
    """By hand: the largest dimension n divides (the first of ties), or None."""
    if math.prod(shape) < min_size:
        return None
    divisible = [d for d, size in enumerate(shape) if size % n == 0]
    if not divisible:
        return None
    return max(divisible, key=lambda d: (shape[d], -d))


@pytest.mark.parametrize("make", [llama, moe])
@pytest.mark.parametrize("sizes,names,axes", MESHES)
def test_no_large_leaf_stays_replicated_when_a_dimension_divides(
    make, sizes, names, axes
):
    mesh = AbstractMesh(sizes, names)
    tree = make()
    min_size = 2**20
    rules = [(".*", eqshard.auto_fsdp(axes, min_size=min_size, mesh=mesh))]
    specs = eqshard.match_partition_rules(rules, tree)
    n = math.prod(dict(zip(names, sizes))[a] for a in np.atleast_1d(axes))
    leaves = jax.tree.leaves_with_path(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    checked = 0
    for (path, leaf), spec in zip(leaves, spec_leaves, strict=True):
        dim = _expected(leaf.shape, n, min_size)
        if dim is None:
            assert spec == P(), (path, leaf.shape, spec)
            continue
        entry = axes if isinstance(axes, str) else tuple(axes)
        assert spec == P(*([None] * dim + [entry])), (path, leaf.shape, spec)
        assert leaf.shape[dim] % n == 0
        checked += 1
    assert checked >= len(leaves) // 2
    # The plan agrees: nothing of at least min_size that could split stays whole.
    report = eqshard.analyze_sharding_strategy(tree, specs, mesh, on_invalid="raise")
    for row in report.rows:
        if _expected(row.shape, n, min_size) is not None:
            assert row.sharded and row.bytes_per_device * n == row.nbytes


def test_explain_says_what_it_chose_and_why():
    mesh = AbstractMesh((16,), ("fsdp",))
    tree = {"w": sds(4096, 11008), "norm": sds(4096), "odd": sds(1001, 1003)}
    report = eqshard.explain_partition_rules(
        [(".*", eqshard.auto_fsdp("fsdp", min_size=10_000, mesh=mesh))], tree
    )
    rows = {row.path: row for row in report.rows}
    assert rows["w"].spec == P(None, "fsdp")
    assert "dimension 1 (size 11008) is the largest" in (rows["w"].note or "")
    assert rows["norm"].spec == P() and "4,096 elements < min_size" in (
        rows["norm"].note or ""
    )
    assert rows["odd"].spec == P() and "no free dimension" in (rows["odd"].note or "")
    assert "dimension 1 (size 11008)" in report.table()
    assert "auto_fsdp('fsdp', min_size=10000)" in report.table()


def test_stacked_layer_axes_are_never_sharded():
    mesh = AbstractMesh((32,), ("fsdp",))
    stacked = {"layers": {"w": sds(64, 4096, 1024)}, "embed": sds(64, 4096)}
    rules = [
        ("layers/", eqshard.auto_fsdp("fsdp", stacked=1, min_size=0, mesh=mesh)),
        (".*", eqshard.auto_fsdp("fsdp", min_size=0, mesh=mesh)),
    ]
    specs = eqshard.match_partition_rules(rules, stacked)
    # The 64-layer axis is skipped: a (64, 32, 32) stack, whose largest
    # dimension is the layer axis, gets FSDP on dimension 1 instead.
    assert specs["layers"]["w"] == P(None, "fsdp")
    assert specs["embed"] == P(None, "fsdp")
    small = {"layers": {"w": sds(64, 32, 32)}}
    got = eqshard.match_partition_rules(rules, small)
    assert got["layers"]["w"] == P(None, "fsdp")
    free = eqshard.match_partition_rules(rules[1:], small)
    assert free["layers"]["w"] == P("fsdp")


def test_base_spec_gets_fsdp_on_a_free_dimension():
    mesh = AbstractMesh((8, 4), ("fsdp", "tp"))
    fsdp = eqshard.auto_fsdp("fsdp", base=P(None, "tp"), min_size=0, mesh=mesh)
    assert fsdp((1024, 4096)) == P("fsdp", "tp")
    assert fsdp((1024,)) == P("fsdp")  # the base is cut to the rank
    already = eqshard.auto_fsdp("fsdp", base=P("fsdp"), min_size=0, mesh=mesh)
    assert already.choose((64, 64)) == (
        P("fsdp"),
        "auto_fsdp: the spec already uses ('fsdp',)",
    )


def test_the_mesh_set_by_set_mesh_is_used(mesh):
    fsdp = eqshard.auto_fsdp("tp", min_size=0)
    with jax.set_mesh(mesh):
        specs = eqshard.match_partition_rules([(".*", fsdp)], {"w": jnp.zeros((6, 8))})
    assert specs == {"w": P(None, "tp")}


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no mesh"):
        eqshard.match_partition_rules(
            [(".*", eqshard.auto_fsdp("fsdp"))], {"w": sds(4, 4)}
        )
    mesh = AbstractMesh((8,), ("dp",))
    with pytest.raises(ValueError, match="'fsdp' is not an axis"):
        eqshard.auto_fsdp("fsdp", mesh=mesh)((8, 8))
    with pytest.raises(ValueError, match="min_size"):
        eqshard.auto_fsdp("dp", min_size=-1)
    with pytest.raises(ValueError, match="axes"):
        eqshard.auto_fsdp(())
    with pytest.raises(TypeError, match="rule 0's function.*'w'.*PartitionSpec"):
        eqshard.match_partition_rules([(".*", lambda shape: "dp")], {"w": sds(4)})


def test_a_plain_function_of_the_shape_is_a_rule_value():
    def by_rank(shape):
        return P("dp") if len(shape) == 2 else P()

    tree = {"w": sds(8, 8), "b": sds(8)}
    assert eqshard.match_partition_rules([(".*", by_rank)], tree) == {
        "w": P("dp"),
        "b": P(),
    }
    row = eqshard.explain_partition_rules([(".*", by_rank)], tree).rows[0]
    assert row.note == "computed by by_rank"


def test_numpy_integer_sizes():
    mesh = AbstractMesh((4,), ("fsdp",))
    rule = eqshard.auto_fsdp(
        "fsdp", min_size=np.int64(8), stacked=np.int32(0), mesh=mesh
    )
    tree = {"small": np.ones(4), "big": np.ones((16, 3))}
    specs = eqshard.match_partition_rules([(".*", rule)], tree)
    assert specs == {"small": P(), "big": P("fsdp")}


def test_repeated_axes_are_refused():
    with pytest.raises(ValueError, match=r"eqshard.auto_fsdp: .*'dp'.*more than once"):
        eqshard.auto_fsdp(("dp", "dp"))
    with pytest.raises(
        ValueError, match=r"eqshard.auto_fsdp: .*'fsdp'.*more than once"
    ):
        eqshard.auto_fsdp(("dp", "fsdp", "fsdp"))


def test_the_mesh_given_to_the_matching_gives_the_sizes():
    mesh = AbstractMesh((4, 2), ("fsdp", "tp"))
    rules = [(".*", eqshard.auto_fsdp("fsdp", min_size=0))]
    tree = {"w": sds(6, 8)}  # only dimension 1 divides over 'fsdp' (4)
    specs = eqshard.match_partition_rules(rules, tree, mesh=mesh)
    assert specs == {"w": P(None, "fsdp")}
    row = eqshard.explain_partition_rules(rules, tree, mesh=mesh).rows[0]
    assert row.spec == P(None, "fsdp") and "dimension 1 (size 8)" in (row.note or "")
    # A mesh given to the value itself is its own: here 'fsdp' of size 3, which
    # shards dimension 0 (6), a spec that cannot apply on the matching's mesh.
    own = eqshard.auto_fsdp("fsdp", min_size=0, mesh=AbstractMesh((3,), ("fsdp",)))
    row = eqshard.explain_partition_rules([(".*", own)], tree, mesh=mesh).rows[0]
    assert row.spec == P("fsdp") and "not divisible" in (row.problem or "")


def test_init_sharded_gives_its_mesh_to_auto_fsdp(mesh):
    rules = [(".*", eqshard.auto_fsdp("tp", min_size=0))]
    linear = eqshard.init_sharded(
        eqx.nn.Linear, 8, 6, key=jax.random.key(0), specs=rules, mesh=mesh
    )
    assert linear.weight.sharding.spec == P(None, "tp")  # (6, 8): 8 divides by 4


def test_without_a_mesh_the_advice_works_for_an_abstract_mesh():
    with pytest.raises(ValueError, match="no mesh") as info:
        eqshard.match_partition_rules(
            [(".*", eqshard.auto_fsdp("fsdp"))], {"w": sds(4, 4)}
        )
    message = str(info.value)
    assert "match_partition_rules(rules, tree, mesh=mesh)" in message
    # `jax.set_mesh` refuses an AbstractMesh: the advice says it takes a concrete one.
    assert "concrete mesh set by `jax.set_mesh(mesh)` is used" in message
    mesh = AbstractMesh((8,), ("fsdp",))
    specs = eqshard.match_partition_rules(
        [(".*", eqshard.auto_fsdp("fsdp", min_size=0))], {"w": sds(16, 4)}, mesh=mesh
    )
    assert specs == {"w": P("fsdp")}
