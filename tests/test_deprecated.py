"""Tests for eqshard._deprecated: the root names that moved in 0.2 still work for
one release, each the very object of its new home, with a warning naming it."""

import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqshard


# Written out by hand: every root name of 0.1 that left the root, and its home.
T5X = [
    "Partitioner",
    "PartitionedFn",
    "DataLayout",
    "LocalChunker",
    "LocalChunkInfo",
    "standard_logical_axis_rules",
    "default_mesh",
    "get_mesh",
    "get_cpu_mesh",
    "get_gpu_mesh",
    "get_coords",
    "bounds_from_last_device",
    "HardwareMesh",
]
COMPAT = [
    "get_metrics",
    "wrap_function_with_rng",
    "RngFunction",
    "pad_to_multiple",
    "round_up_to_multiple",
    "get_weight_decay_mask",
    "get_jax_mesh",
    "create_pattern_based_partition_spec",
    "make_shard_and_gather_fns",
    "get_names_from_partition_spec",
    "names_in_current_mesh",
    "get_mesh_axis_names",
    "extract_sharding_structure",
]
MOVED = (
    [(name, "eqshard.t5x", name) for name in T5X]
    + [(name, "eqshard.compat", name) for name in COMPAT]
    + [("composite_rules", "eqshard", "composite_axis_rules")]
)


@pytest.mark.parametrize("name, home, new_name", MOVED)
def test_old_root_name_is_its_new_home_and_warns(name, home, new_name):
    new = rf"{home}.{new_name}".replace(".", r"\.")
    with pytest.warns(DeprecationWarning, match=rf"^eqshard\.{name} is now {new};"):
        old = getattr(eqshard, name)
    namespace = {"eqshard": eqshard, "eqshard.t5x": eqshard.t5x}.get(
        home, eqshard.compat
    )
    assert old is getattr(namespace, new_name)
    assert new_name in namespace.__all__
    assert name not in eqshard.__all__
    assert name not in dir(eqshard)


def test_from_import_of_an_old_name_warns_once_at_the_import():
    with pytest.warns(DeprecationWarning) as caught:
        from eqshard import Partitioner
    assert Partitioner is eqshard.t5x.Partitioner
    assert [w.filename for w in caught] == [__file__]


def test_old_name_warning_is_shown_to_a_script_by_default():
    # Python shows a DeprecationWarning by default when it is attributed to
    # __main__: the warning must point at the user's line, not inside eqshard.
    code = "import eqshard\neqshard.get_metrics\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert re.search(
        r"<string>:2: DeprecationWarning: eqshard.get_metrics is now "
        r"eqshard.compat.get_metrics",
        result.stderr,
    )


def test_unknown_root_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        eqshard.no_such_name  # noqa: B018
    assert not hasattr(eqshard, "shard_tree")


def test_root_names_are_the_everyday_path():
    # At most 62 at the root this release (issues 21 and 47): families live in
    # `eqshard.t5x` and `eqshard.compat`, return types need not be listed.
    assert len(eqshard.__all__) <= 62
    assert len(set(eqshard.__all__)) == len(eqshard.__all__)
    for name in eqshard.__all__:
        assert not isinstance(getattr(eqshard, name), types.ModuleType), name
    # No root name builds a mesh under a `get_` name (t5x's own are in eqshard.t5x).
    assert [n for n in eqshard.__all__ if n.startswith("get_") and "mesh" in n] == []
    for namespace in (eqshard.t5x, eqshard.compat):
        assert set(namespace.__all__) <= set(dir(namespace))
        assert set(namespace.__all__).isdisjoint(eqshard.__all__)


# Renamed keywords: logical axis rules are `axis_rules=` everywhere. The old
# keywords are not in the signatures, so pyright is told to let these calls be.

RULES = [("batch", "dp"), ("mlp", "tp")]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def _renamed(caller: str, old: str = "rules") -> str:
    return rf"^eqshard\.{caller}: the keyword `{old}` is now `axis_rules`; use"


def test_old_rules_keyword_of_the_logical_functions_warns_and_works(mesh):
    names = eqshard.AxisNames("batch", "mlp")
    with pytest.warns(DeprecationWarning, match=_renamed("logical_to_mesh_axes")):
        assert eqshard.logical_to_mesh_axes(names, rules=RULES) == P("dp", "tp")  # pyright: ignore[reportCallIssue]
    with pytest.warns(DeprecationWarning, match=_renamed("logical_to_mesh_specs")):
        specs = eqshard.logical_to_mesh_specs({"w": names}, rules=RULES)  # pyright: ignore[reportCallIssue]
    assert specs == {"w": P("dp", "tp")}
    with pytest.warns(DeprecationWarning, match=_renamed("logical_axis_rules")):
        with eqshard.logical_axis_rules(rules=RULES):  # pyright: ignore[reportCallIssue]
            assert eqshard.get_logical_axis_rules() == tuple(RULES)
    with pytest.warns(DeprecationWarning, match=_renamed("set_logical_axis_rules")):
        eqshard.set_logical_axis_rules(rules=RULES)  # pyright: ignore[reportCallIssue]
    assert eqshard.get_logical_axis_rules() == tuple(RULES)
    eqshard.set_logical_axis_rules(())
    x = jnp.arange(32.0).reshape(4, 8)
    with pytest.warns(DeprecationWarning, match=_renamed("with_sharding_constraint")):
        out = eqshard.with_sharding_constraint(x, names, mesh=mesh, rules=RULES)  # pyright: ignore[reportCallIssue]
    assert out.sharding.spec == P("dp", "tp")


def test_old_and_new_keyword_together_is_an_error():
    with pytest.raises(TypeError, match=r"got both `rules` and `axis_rules`"):
        eqshard.logical_to_mesh_axes(("batch",), rules=RULES, axis_rules=RULES)  # pyright: ignore[reportCallIssue]


def test_partitioner_logical_axis_rules_is_axis_rules(mesh):
    old = _renamed("t5x.Partitioner", "logical_axis_rules")
    with pytest.warns(DeprecationWarning, match=old):
        partitioner = eqshard.t5x.Partitioner(mesh=mesh, logical_axis_rules=RULES)  # pyright: ignore[reportCallIssue]
    assert partitioner.axis_rules == tuple(RULES)
    assert partitioner.data_partition_spec == P("dp")
    with pytest.warns(
        DeprecationWarning,
        match=r"^eqshard\.t5x\.Partitioner\.logical_axis_rules is now `axis_rules`",
    ):
        assert partitioner.logical_axis_rules == tuple(RULES)


# One vocabulary for "what to do when something does not fit": `on_invalid`. The
# old keywords are not in the signatures (pyright is told to let those calls be).


def _spelled(caller: str, old: str, new: str) -> str:
    return rf"^eqshard\.{caller}: {re.escape(old)} is now {re.escape(new)}; use that"


def test_old_keywords_and_literals_of_on_invalid_warn_and_work(mesh):
    tree = {"w": jnp.ones((8, 8)), "b": jnp.ones(3)}
    rules = [("w", P("dp", "tp"))]
    replicated = {"w": P("dp", "tp"), "b": P()}
    caller, old = "match_partition_rules", "`strict=False`"
    with pytest.warns(
        DeprecationWarning, match=_spelled(caller, old, '`on_invalid="ignore"`')
    ):
        assert eqshard.match_partition_rules(rules, tree, strict=False) == replicated  # pyright: ignore[reportCallIssue]
    old = "`strict=True`"
    with pytest.warns(
        DeprecationWarning, match=_spelled(caller, old, '`on_invalid="raise"`')
    ):
        with pytest.raises(ValueError, match="'b'"):
            eqshard.match_partition_rules(rules, tree, strict=True)  # pyright: ignore[reportCallIssue]
    old, new = '`on_invalid="report"`', '`on_invalid="ignore"`'
    caller = "analyze_sharding_strategy"
    with pytest.warns(DeprecationWarning, match=_spelled(caller, old, new)):
        report = eqshard.analyze_sharding_strategy(
            tree,
            P("sp"),
            mesh,
            on_invalid="report",  # pyright: ignore[reportArgumentType]
        )
    assert len(report.problems) == 2


def test_the_table_of_moved_names_is_the_released_names_that_left():
    # Derived from the namespaces' `__all__` and 0.1.0's root names: exactly the
    # names written out above, nothing released later.
    assert eqshard._MOVED == {name: f"{home}.{new}" for name, home, new in MOVED}


def test_spellings_never_released_have_no_shim(mesh):
    # Spellings of 0.2's own development, never in a release (0.1.0 had neither
    # `derive_specs`, `restrict_specs` nor `plan_training`), are plain mistakes.
    params = {"w": jnp.ones((8, 8))}
    state = {"mu": params}
    with pytest.raises(TypeError, match="on_unmatched"):
        eqshard.derive_specs(state, params, P("tp"), on_unmatched="replicate")  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match="on_change"):
        eqshard.restrict_specs(P("sp"), mesh, on_change="ignore")  # pyright: ignore[reportCallIssue]
    with pytest.raises(ValueError, match="'report'"):
        eqshard.plan_training(params, P(), mesh, on_invalid="report")  # pyright: ignore[reportArgumentType]
    with pytest.raises(AttributeError):
        eqshard.clear_init_cache  # noqa: B018
