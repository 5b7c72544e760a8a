"""Which blocks of a sharded dimension each process's devices hold, on meshes of
stand-in devices; every expected block worked out by hand from the owners."""

import pytest
from fakes import host_mesh

from eqshard._move._process_blocks import (
    blocks_by_process,
    not_one_slice,
    one_slice_each,
    slice_order,
    spanning_axes,
    why_no_order,
)


# Process 2k + m holds column m of rows 2k and 2k + 1 of a ('data', 'model') = (4, 2)
# mesh: both axes span processes.
COLUMNS = host_mesh([[0, 1], [0, 1], [2, 3], [2, 3]], ("data", "model"))
# Process p holds both 'model' devices at replica p // 2, data p % 2.
SLICES = host_mesh([[[0, 0], [1, 1]], [[2, 2], [3, 3]]], ("replica", "data", "model"))
# Each process holds a 2x2 block of a 4x4 mesh: part of both axes.
SQUARES = host_mesh(
    [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]], ("data", "model")
)
# Process 0 holds the diagonal: no block of the mesh.
SCATTERED = host_mesh([[0, 1], [1, 0]], ("data", "model"))


@pytest.mark.parametrize(
    "mesh, axes, expected, one_slice",
    [
        (
            COLUMNS,
            ("data",),
            ((0, (0, 1)), (1, (0, 1)), (2, (2, 3)), (3, (2, 3))),
            True,
        ),
        # Block m * 4 + d of device (d, m).
        (
            COLUMNS,
            ("model", "data"),
            ((0, (0, 1)), (1, (4, 5)), (2, (2, 3)), (3, (6, 7))),
            True,
        ),
        # Block d * 2 + m: two separate blocks per process.
        (
            COLUMNS,
            ("data", "model"),
            ((0, (0, 2)), (1, (1, 3)), (2, (4, 6)), (3, (5, 7))),
            False,
        ),
        # Block 2r + d of device (r, d, m): one block per process.
        (
            SLICES,
            ("replica", "data"),
            ((0, (0,)), (1, (1,)), (2, (2,)), (3, (3,))),
            True,
        ),
        # Block 2m + d of 4: 'data' splits processes 0|1, 'model' holds both.
        (
            SLICES,
            ("model", "data"),
            ((0, (0, 2)), (1, (1, 3)), (2, (0, 2)), (3, (1, 3))),
            False,
        ),
        (SCATTERED, ("data", "model"), ((0, (0, 3)), (1, (1, 2))), False),
    ],
)
def test_blocks_by_process(mesh, axes, expected, one_slice):
    assert blocks_by_process(mesh, axes) == expected
    assert one_slice_each(expected) == one_slice
    assert (not_one_slice(mesh, axes) is None) == one_slice


def test_one_slice_each_needs_one_length():
    assert not one_slice_each(((0, (0, 1)), (1, (2,))))
    assert one_slice_each(((0, (2, 3)), (1, (0, 1))))
    assert not one_slice_each(((0, (1, 2)), (1, (3, 4))))  # not aligned


@pytest.mark.parametrize(
    "mesh, expected",
    [
        (COLUMNS, ("data", "model")),
        (SLICES, ("replica", "data")),
        (SQUARES, ("data", "model")),
        (host_mesh([[0, 0], [0, 0]], ("data", "model")), ()),
    ],
)
def test_spanning_axes(mesh, expected):
    assert spanning_axes(mesh) == expected


def test_what_a_process_holds_instead():
    assert not_one_slice(COLUMNS, ("data", "model")) == (
        "process 0's devices hold blocks [0, 2] of 8 (it holds 2 devices along "
        "'data' but only 1 of the 2 along 'model'), not one contiguous slice"
    )
    # Only process 1's blocks, [1, 3].
    assert not_one_slice(COLUMNS, ("data", "model"), 1) == (
        "process 1's devices hold blocks [1, 3] of 8 (it holds 2 devices along "
        "'data' but only 1 of the 2 along 'model'), not one contiguous slice"
    )
    assert not_one_slice(COLUMNS, ("model", "data"), 1) is None
    # Blocks [0, 3]: no axis explains it.
    assert not_one_slice(SCATTERED, ("data", "model")) == (
        "process 0's devices hold blocks [0, 3] of 4, not one contiguous slice"
    )


@pytest.mark.parametrize(
    "mesh, axes, expected",
    [
        # Each process holds one device along 'model', two of four along 'data'.
        (COLUMNS, ("data", "model"), ("model", "data")),
        (COLUMNS, ("model", "data"), ("model", "data")),
        # One device along 'data', every device along 'model'.
        (SLICES, ("model", "data"), ("data", "model")),
        (SLICES, ("model", "replica", "data"), ("replica", "data", "model")),
        (SQUARES, ("data", "model"), None),
        (SCATTERED, ("data", "model"), None),
    ],
)
def test_slice_order(mesh, axes, expected):
    assert slice_order(mesh, axes) == expected
    if expected is not None:
        assert not_one_slice(mesh, expected) is None


def test_why_no_order():
    assert why_no_order(SQUARES, ("model", "data")).startswith(
        "the processes hold some but not all of the devices along each of "
        "('model', 'data'). Shard this dimension over only one of them"
    )
    assert why_no_order(SQUARES, ("data", "model"), 3).startswith(
        "process 3 holds some but not all of the devices along each of "
        "('data', 'model')."
    )
    assert why_no_order(SCATTERED, ("data", "model")).startswith(
        "the devices of each process do not form a block of the mesh."
    )
