"""Compiles for hardware this machine does not have: the real TPU and GPU
compilers on a CPU machine (`eqshard.create_mesh(target=...)`; needs the `tpu`
and `gpu` extras).

- **analyze_step against the compile alone.** A 50 B-parameter, 80-layer
  scan-stacked decoder step (`benchmarks/models.py`'s `scan_step`, bf16, FSDP x
  TP by `scan_rules()`) on a 512-chip v5p pod (`v5p-1024`, mesh fsdp:64 x tp:8)
  and on 64 H100s (`h100:8x8`, fsdp:8 x tp:8): `eqshard.analyze_step` of a fresh
  `jax.jit` against `jax.jit(...).lower(...).compile()` of another, interleaved,
  `--runs` times. Target: at most 1.2x, and both targets' analyses within 60 s.
- **search_layout on 8 H100s**: the built-in candidates (at most 6) for a
  GPT-style step (`models.Block`s, batch 8): wall time. Target: 60 s.
- **import eqshard with the extras installed.** Median of 10 fresh processes of
  `python -S -c "import eqshard"` over this environment's site-packages, all of
  it against the same without libtpu and the CUDA plugin (a directory of links
  to every other entry). Target: within 10 %.

All figures are deviceless compiles on this machine's CPU cores. Run with
`python benchmarks/bench_targets.py` (a few minutes).
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the GPU route needs it first

import equinox as eqx
import jax
import jax.numpy as jnp
from _timing import add_json_option, as_table, interleaved, table, write_json
from jax.sharding import NamedSharding, PartitionSpec as P
from models import Block, scan_params, scan_rules, scan_step, scan_tokens, ScanConfig

import eqshard


ROOT = pathlib.Path(__file__).resolve().parents[1]
BIG = ScanConfig(vocab=32768, dim=8192, hidden=22016, layers=80, batch=64, seq=512)
TARGETS = {"v5p-1024": "fsdp:64,tp:8", "h100:8x8": "fsdp:8,tp:8"}


def _abstract_step(target: str, mesh_text: str) -> tuple[object, object]:
    mesh = eqshard.create_mesh(mesh_text, target=target)
    specs = eqshard.match_partition_rules(scan_rules(), scan_params(BIG))
    params = eqshard.abstract(scan_params(BIG), specs, mesh)
    sharding = NamedSharding(mesh, P("fsdp"))
    tokens = jax.ShapeDtypeStruct(scan_tokens(BIG).shape, jnp.int32, sharding=sharding)
    return params, tokens


def analysis_rows(runs: int) -> list:
    rows = []
    for target, mesh_text in TARGETS.items():
        params, tokens = _abstract_step(target, mesh_text)
        times = interleaved(
            {
                "eqshard": lambda: eqshard.analyze_step(
                    jax.jit(scan_step, donate_argnums=0), params, tokens
                ),
                "compile": lambda: (
                    jax.jit(scan_step, donate_argnums=0).lower(params, tokens).compile()
                ),
            },
            runs,
            # Cold every time: JAX and eqshard keep what they compiled.
            before=lambda: (jax.clear_caches(), eqshard.clear_caches()),
        )
        step = jax.jit(scan_step, donate_argnums=0)
        report = eqshard.analyze_step(step, params, tokens)
        print(f"{target}: {BIG.parameters / 1e9:.1f} B parameters")
        print(report.summary())
        rows.append((f"{target} analyze_step", times["eqshard"], times["compile"]))
    return rows


def search_seconds() -> float:
    mesh = eqshard.create_mesh("dp:2,tp:4", target="h100")
    dim, heads, seq = 1024, 16, 512
    blocks = [Block(dim, heads, key=k) for k in jax.random.split(jax.random.key(0), 4)]
    params = eqshard.abstract(blocks, P(), mesh)
    batch = jax.ShapeDtypeStruct(
        (8, seq, dim), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp"))
    )

    def loss(blocks, x):
        h = x.astype(jnp.float32)
        for block in blocks:
            h = jax.vmap(block)(h)
        return jnp.mean(h**2)

    def step(blocks, x):
        grads = eqx.filter_grad(loss)(blocks, x)
        return eqx.apply_updates(blocks, jax.tree.map(lambda g: -1e-3 * g, grads))

    start = time.perf_counter()
    result = eqshard.search_layout(
        step, params, batch, mesh=mesh, device_memory="60GiB", max_candidates=6,
        progress=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(result)
    return seconds


def _import_seconds(site: pathlib.Path) -> float:
    code = "import time; t = time.perf_counter(); import eqshard; "
    code += "print(time.perf_counter() - t)"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def import_rows(count: int) -> list:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    plugins = ("libtpu", "jax_plugins", "jax_cuda12")
    with tempfile.TemporaryDirectory() as bare, tempfile.TemporaryDirectory() as full:
        for entry in site.iterdir():
            os.symlink(entry, pathlib.Path(full) / entry.name)
            if not entry.name.startswith(plugins):
                os.symlink(entry, pathlib.Path(bare) / entry.name)
        times: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(count):  # interleaved, so load hits both alike
            times["with"].append(_import_seconds(pathlib.Path(full)))
            times["without"].append(_import_seconds(pathlib.Path(bare)))
    rows = []
    for name, values in times.items():
        rows.append((f"import eqshard, {name} the extras", min(values),
                     statistics.median(values)))  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    add_json_option(parser)
    args = parser.parse_args()
    tables = {"analysis": table(analysis_rows(args.runs))}
    seconds = search_seconds()
    print(f"search_layout, 8 H100s: {seconds:.1f} s")
    imports = import_rows(10)
    for name, low, median in imports:
        print(f"{name}: min {low * 1e3:.0f} ms, median {median * 1e3:.0f} ms")
    ratio = imports[0][2] / imports[1][2]
    print(f"import with / without the extras (medians): {ratio:.2f}")
    tables["other"] = as_table(
        ("case", "min", "median", "target"),
        [
            ("search_layout, 6 candidates, 8 H100s (s)", f"{seconds:.1f}", "-", "60"),
            *[
                (n, f"{lo * 1e3:.0f} ms", f"{md * 1e3:.0f} ms", "-")
                for n, lo, md in imports
            ],  # fmt: skip
            ("import with / without (medians)", "-", f"{ratio:.2f}", "1.10"),
        ],
    )
    write_json(__file__, tables, path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
