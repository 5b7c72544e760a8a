"""Times `eqshard.match_partition_rules` against the naive per-leaf, per-rule loop.

The tree has 10,000 `jax.ShapeDtypeStruct` leaves (no memory) and there are 30
rules. The naive loop is fjformer's: for each leaf, build its path string, then
`re.search(pattern_string, path)` for each rule until one matches. Python's `re`
keeps a cache of compiled patterns (512 entries), so after the first call the
naive loop does not recompile: what it pays per search is the cache lookup. The
"cold cache" row empties that cache before every repetition, to show what the
compiles themselves cost.

Also times the `@typecheck` wrapper on a trivial public function.

Run: `python benchmarks/bench_rules.py`.
"""

import argparse
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from _timing import add_json_option, as_table, interleaved, once, table, write_json
from jax.sharding import PartitionSpec as P

import eqshard


REPEATS = 5
N_LAYERS = 625  # x 16 leaves per layer = 10,000 leaves


def make_tree():
    def leaf(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    def layer():
        attn = {n: {"kernel": leaf(512, 512), "bias": leaf(512)} for n in "qkvo"}
        mlp = {
            n: {"kernel": leaf(512, 2048), "bias": leaf(2048)}
            for n in ("up", "gate", "down")
        }
        return {"attn": attn, "mlp": mlp, "norm1": leaf(512), "norm2": leaf(512)}

    return {"layers": [layer() for _ in range(N_LAYERS)]}


def make_rules():
    real = [(f"attn/{n}/kernel", P("dp", "tp")) for n in "qkvo"] + [
        (f"mlp/{n}/kernel", P("dp", "tp")) for n in ("up", "gate", "down")
    ]
    decoys = [(f"vision/block_{i}/(kernel|bias)", P("tp")) for i in range(8)] + [
        (f"lora_{c}/kernel", P(None, "tp")) for c in "abcdefghi"
    ]
    tail = [
        ("attn/.*/bias", P("tp")),
        ("mlp/.*/bias", P("tp")),
        ("norm[12]$", P()),
        ("embed/table", P("tp", None)),
        ("lm_head", P(None, "tp")),
        (".*", P()),
    ]
    # Decoys in the middle: most leaves try some rules that never match.
    rules = real[:4] + decoys[:7] + real[4:] + decoys[7:] + tail
    assert len(rules) == 30, len(rules)
    return rules


def _path_string(path, sep="/"):
    # fjformer's approach: stringify each key of the key path, join.
    parts = []
    for key in path:
        if isinstance(key, jtu.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jtu.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jtu.GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(key))
    return sep.join(parts)


def naive_match(rules, names):
    """The matching loop alone, on precomputed path strings."""
    out = []
    for name in names:
        for pattern, spec in rules:
            if re.search(pattern, name) is not None:
                out.append(spec)
                break
        else:
            raise ValueError(name)
    return out


def naive_full(rules, tree):
    """Flatten with paths, build each path string, match, unflatten."""
    path_leaves, treedef = jtu.tree_flatten_with_path(tree)
    names = [_path_string(path) for path, _ in path_leaves]
    return jtu.tree_unflatten(treedef, naive_match(rules, names))


def naive_full_cold(rules, tree):
    re.purge()
    return naive_full(rules, tree)


def typecheck_overhead():
    path = (jtu.DictKey("layers"), jtu.SequenceKey(3))
    decorated = eqshard.tree_path_to_string
    raw = getattr(decorated, "__wrapped__", None)
    n = 20_000
    rows = [("@typecheck (default)", once(lambda: decorated(path, "/"), calls=n)[0])]
    if raw is not None:
        rows.append(
            ("undecorated (__wrapped__)", once(lambda: raw(path, "/"), calls=n)[0])
        )
    code = (
        "import timeit, jax.tree_util as jtu, eqshard;"
        "p = (jtu.DictKey('layers'), jtu.SequenceKey(3));"
        f"print(timeit.timeit(lambda: eqshard.tree_path_to_string(p, '/'), number={n}))"
    )
    env = dict(os.environ, JAXTYPING_DISABLE="1")
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows.append(("JAXTYPING_DISABLE=1", float(result.stdout.strip()) / n))
    return [(name, seconds * 1e6) for name, seconds in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_option(parser)
    args = parser.parse_args()
    tree = make_tree()
    rules = make_rules()
    n_leaves = len(jax.tree.leaves(tree))
    names = [_path_string(path) for path, _ in jtu.tree_flatten_with_path(tree)[0]]

    # Same answer from every variant, or the timings mean nothing.
    specs = eqshard.match_partition_rules(rules, tree)
    assert jax.tree.leaves(specs) == jax.tree.leaves(naive_full(rules, tree))

    times = interleaved(
        {
            "eqshard.match_partition_rules": lambda: eqshard.match_partition_rules(
                rules, tree
            ),
            "naive re.search loop (paths given)": lambda: naive_match(rules, names),
            "naive + flatten_with_path + paths": lambda: naive_full(rules, tree),
            "naive + flatten, cold re cache": lambda: naive_full_cold(rules, tree),
        },
        REPEATS,
    )
    print(f"{n_leaves} leaves, {len(rules)} rules, {REPEATS} interleaved runs each")
    ours = times.pop("eqshard.match_partition_rules")
    main_table = table(
        [(f"vs {name}", ours, t) for name, t in times.items()],
        unit="ms",
        theirs="naive",
    )
    print()
    print("@typecheck overhead: eqshard.tree_path_to_string(2-key path, '/')")
    overhead = typecheck_overhead()
    width = max(len(name) for name, _ in overhead)
    for name, us in overhead:
        print(f"{name:<{width}}  {us:8.2f} us/call")
    typecheck_table = as_table(
        ("eqshard.tree_path_to_string(2-key path, '/')", "us per call"),
        [(name, f"{us:.2f}") for name, us in overhead],
    )
    tables = {"main": main_table, "typecheck": typecheck_table}
    write_json(__file__, tables, path=args.json)


if __name__ == "__main__":
    main()
