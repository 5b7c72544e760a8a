"""Checkpoints of any pytree, read straight into the shardings asked for.

`save`/`restore` write and read orbax checkpoints; `save_safetensors` and
`load_safetensors` the format published weights come in. Both optional
dependencies are imported inside the functions that use them, so `import
eqshard` never imports them. The modules: `_targets.py` (what both formats
share: names, targets, the message for differences), `_disk.py` (a checkpoint's
directory, eqshard's own file, what it holds), `_save.py`, `_restore.py`,
`_restore_like.py` (what `restore` reads into), `_swap.py` (one writer per
path, the atomic swap, generations), `_blocks.py` (orbax's files read block by
block into CPU devices' memory), `_views.py` (stacked layers saved in another
view of their layer order, as a pipeline's `stage_view`), `_safetensors.py`
(reading and writing) and
`_safetensors_files.py` (which files, and their headers), `_safetensors_reads.py`
(each device's block read into a buffer that becomes the device's own).

How a checkpoint is written, in the order of `save`:

1. **Check first.** Before anything touches the disk, every leaf is checked
   (arrays without data, deleted ones, dtypes orbax cannot store), and all that
   cannot be saved are named together; so is a directory that exists (without
   `overwrite`), that holds something other than a checkpoint, or a checkpoint
   with other files beside it (a `config.yaml`, say), which the swap would
   delete.
2. **One writer.** Process 0 takes `<directory>.eqshard-lock` (created
   exclusively: a second save to the same path raises at once, naming the
   first; see `_swap.py`).
3. **Beside the old one.** orbax writes the arrays to a staging directory of
   this save's own, `<directory>.eqshard-new-<random>`, and eqshard adds its own
   file, `eqshard.json`, for what orbax cannot hold: zero-size arrays (orbax
   refuses them), kept by shape and dtype, and the dtypes tensorstore has no
   name for (uint4, uint2, float8_e4m3), whose bits orbax holds as an integer
   type of the same width; the arrays laid out as a circular pipeline's view
   of stacked layers (`_views.py`); and a random generation id. A tree without
   arrays is that file alone.
4. **Swap.** Only a complete checkpoint replaces an old one, in one atomic
   exchange of the two directories (`renameat2`; two renames where the file
   system has none), and the old one is removed. A failure before that leaves
   the old checkpoint as it was.

How a checkpoint is read, in the order of `restore`:

1. **Name.** Every array leaf of `like` is named by its path (`layers/3/w`);
   everything else (static fields, callables, Python scalars) is not saved and
   comes back from `like`. A skeleton from `eqx.filter_eval_shape` is enough.
2. **Target.** Each name gets a `jax.ShapeDtypeStruct` with its sharding: the
   spec's on `mesh`, or the sharding `like`'s leaf already has, and the dtype JAX
   places (its cast, or `like`'s).
3. **Compare first.** The checkpoint's metadata (orbax's and eqshard's: names,
   shapes, dtypes, of a nested orbax tree too) is compared with the targets, and
   every name missing, extra or different is reported together before any data
   is read. Every field of `eqshard.json` is checked to be what `save` writes
   and to agree with orbax's metadata (a file that is not a regular one is not
   opened).
4. **Read.** Each device's shard is read straight from the files onto that
   device (no full copy of an array on any device or on the host), converted to
   the target's dtype; in a multi-process run each process reads only the shards
   its devices hold. Into a CPU device's own memory tensorstore reads it, with
   the files' description orbax gives, into the buffer that becomes the device's
   (`_blocks.py`); onto accelerators, and host memories, orbax reads it.
   Zero-size arrays are made on their shardings, and bits are viewed as their
   dtype again.
5. **Nothing lost.** Where the dtype placed differs from the one saved (a cast
   asked for with `dtype=`, or 64-bit data while `jax_enable_x64` is off), the
   values are checked with `shard`'s policy (`_host.py`), shard by shard on host
   (no program to compile; the processes add up what their shards show): a
   narrowed integer array is compared with a float32 reading of the same data
   (which keeps every value's magnitude), and a floating array that holds inf or
   nan after the cast is read once more, whole on host, to tell values that
   overflowed from infinities that were saved.
6. **One generation.** The checkpoint's generation (`_swap.generation`) is taken
   before the metadata is read and again after the data: if a save finished in
   between, nothing is returned (the read may mix two checkpoints), and the
   error says to retry.

In a multi-process run every process makes the same call. eqshard drives orbax's
handlers itself, so that no process waits in orbax's barriers (collectives without
a timeout): the processes meet at eqshard's (`fail_together`), before anything is
written or read, after every process has written or read its shards, and after
the swap. If one of them failed, or did not come within `timeout`, all of them
raise, and none waits in a collective the others never join.
"""

from ._restore import restore as restore
from ._safetensors import (
    load_safetensors as load_safetensors,
    save_safetensors as save_safetensors,
)
from ._save import save as save
