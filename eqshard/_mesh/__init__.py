"""Meshes: built, found and described.

`_build.py` makes meshes (`create_mesh` from sizes or a mesh string such as
`"dp:2,tp:-1"`, `create_hybrid_mesh` over ICI x DCN, fjformer's `get_jax_mesh`),
with Auto axes unless asked otherwise, of this machine's devices or of a
target's: `_targets.py` makes compile-only TPU and GPU devices (`"v5p-1024"`,
`"h100:8x8"`) for the real compilers, says which devices are such, and how much
memory one has; `_chips.py` what each chip computes and moves per second
(`Chip`, `chip_of`), for timing a step. `_current.py` answers, for every other
wing, which mesh a call runs on (`current_mesh`, `find_mesh`, `require_mesh`,
`concrete_mesh`: the `mesh=` given, else `jax.set_mesh`'s), prints one
(`mesh_repr`), compares two (`same_mesh`), and gives the axis queries
(`mesh_axis_size`, `axis_size`, `axis_index`). Nothing here moves data.
"""
