"""Checkpoints at odd paths, beside what is not theirs, and odd locks (issue 42:
glob characters in a path, `overwrite=True` checking kinds, symlinked locks)."""

import gc
import json
import os
import socket
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import eqshard


def _tree(value):
    return {"a": np.full((8,), value, np.float32), "b": np.arange(4, dtype=np.int32)}


def _like():
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",), axis_types=(AxisType.Auto,))
    whole = NamedSharding(mesh, P())
    return {
        "a": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=whole),
        "b": jax.ShapeDtypeStruct((4,), jnp.int32, sharding=whole),
    }


def _values(path):
    out = eqshard.restore(path, _like())
    assert np.asarray(out["b"]).tolist() == [0, 1, 2, 3]
    return {float(v) for v in np.asarray(out["a"])}


@pytest.mark.parametrize(
    "name",
    [
        "exp[lr=3e-4]",
        "a*b",
        "what?",
        "c{1,2}",
        "with space",
        "ünïcode",
        "p%20c",
        "it's",
    ],
)
def test_every_directory_name_saves_and_restores(tmp_path, name):
    path = str(tmp_path / name / "step_100")
    eqshard.save(path, _tree(1))
    assert _values(path) == {1}
    eqshard.save(path, _tree(2), overwrite=True)  # the good one replaced by a good one
    assert _values(path) == {2}
    assert sorted(os.listdir(tmp_path / name)) == ["step_100"]


# Forcing orbax's old failure leaves a tensorstore callback aimed at orbax's
# closed event loop, raised later where nothing can catch it: orbax's, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_staged_checkpoint_that_does_not_read_back_is_not_swapped_in(
    tmp_path, monkeypatch
):
    import contextlib

    from eqshard._checkpoint import _save

    path = str(tmp_path / "exp[1]" / "c")
    eqshard.save(path, _tree(1))
    # orbax given the path itself, glob characters and all (as before the fix):
    # its files are not merged, and the old checkpoint must stay.
    monkeypatch.setattr(
        _save, "literal_name", lambda name, caller: contextlib.nullcontext(name)
    )
    with pytest.raises(
        ValueError,
        match="nothing there was replaced.*(cannot be read|does not read back)",
    ):
        eqshard.save(path, _tree(2), overwrite=True)
    monkeypatch.undo()
    assert _values(path) == {1}
    assert sorted(os.listdir(tmp_path / "exp[1]")) == ["c"]
    gc.collect()  # the callback above is raised here, inside this test's filter


def test_overwrite_checks_the_kind_of_every_entry(tmp_path):
    path = str(tmp_path / "c")
    eqshard.save(path, _tree(1))
    # A user's directory named as orbax's file, and a file inside orbax's `d/`,
    # its `ocdbt.process_0/` and a link: refused, each named, nothing deleted.
    (tmp_path / "c" / "_sharding").mkdir()
    (tmp_path / "c" / "_sharding" / "mine.txt").write_text("keep")
    (tmp_path / "c" / "d" / "notes.txt").write_text("keep")
    (tmp_path / "c" / "ocdbt.process_0" / "extra").mkdir()
    (tmp_path / "outside").write_text("keep")
    (tmp_path / "c" / "manifest.ocdbt").rename(tmp_path / "c" / "manifest.real")
    (tmp_path / "c" / "manifest.ocdbt").symlink_to(tmp_path / "c" / "manifest.real")
    with pytest.raises(ValueError) as error:
        eqshard.save(path, _tree(2), overwrite=True)
    said = str(error.value)
    for name in (
        "'_sharding/'",
        "'d/notes.txt'",
        "'manifest.ocdbt'",
        "'manifest.real'",
    ):
        assert name in said, said
    assert "Move it out of the directory" in said
    assert (tmp_path / "c" / "_sharding" / "mine.txt").read_text() == "keep"
    assert (tmp_path / "c" / "d" / "notes.txt").read_text() == "keep"
    assert _values(path) == {1}
    # Once they are moved out, the checkpoint is replaced.
    os.remove(tmp_path / "c" / "manifest.ocdbt")
    (tmp_path / "c" / "manifest.real").rename(tmp_path / "c" / "manifest.ocdbt")
    (tmp_path / "c" / "_sharding" / "mine.txt").unlink()
    (tmp_path / "c" / "_sharding").rmdir()
    (tmp_path / "c" / "d" / "notes.txt").unlink()
    with pytest.raises(ValueError, match=r"'ocdbt\.process_0/extra/'"):
        eqshard.save(path, _tree(2), overwrite=True)
    (tmp_path / "c" / "ocdbt.process_0" / "extra").rmdir()
    eqshard.save(path, _tree(2), overwrite=True)
    assert _values(path) == {2}
    assert (tmp_path / "outside").read_text() == "keep"


def _reaped_pid():
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_lock_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    path = str(tmp_path / "c")
    eqshard.save(path, _tree(1))
    target = tmp_path / "precious.json"
    info = {"host": socket.gethostname(), "pid": _reaped_pid(), "staging": "s"}
    target.write_text(json.dumps(info))  # reads as a dead writer's lock
    os.symlink(target, path + ".eqshard-lock")
    with pytest.raises(ValueError, match="is a symbolic link") as error:
        eqshard.save(path, _tree(2), overwrite=True)
    assert repr(path + ".eqshard-lock") in str(error.value)
    assert "Remove it" in str(error.value)
    assert json.loads(target.read_text()) == info  # not truncated
    assert _values(path) == {1}
    os.remove(path + ".eqshard-lock")
    os.mkfifo(path + ".eqshard-lock")
    with pytest.raises(ValueError, match="is not a regular file"):
        eqshard.save(path, _tree(2), overwrite=True)


@pytest.mark.parametrize("pid", [2**31, 2**64, -1])
def test_a_lock_whose_pid_no_process_can_have_is_not_this_hosts(tmp_path, pid):
    path = str(tmp_path / "c")
    with open(path + ".eqshard-lock", "x") as f:
        json.dump({"host": socket.gethostname(), "pid": pid, "staging": "s"}, f)
    with pytest.raises(ValueError, match=r"not a pid of this host") as error:
        eqshard.save(path, _tree(1))
    assert "another save is writing" in str(error.value)
    assert not os.path.exists(path)
