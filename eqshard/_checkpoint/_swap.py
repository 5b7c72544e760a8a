"""One writer at a time per checkpoint path, and a complete checkpoint put in
the place of an old one in one step.

1. **Lock.** Before anything is staged, the writer (process 0 of a job: one
   `save` call, across the processes of one job, is one writer) creates
   `<path>.eqshard-lock` exclusively (`O_CREAT | O_EXCL`), holding its host,
   process id and staging directory, and keeps an `flock` on it until the save
   ends. A second writer raises at once, naming them. A lock whose process is
   gone, on this host (no such process, and no `flock` on the file), is taken
   over with a warning; its staging directory is removed.
2. **Stage.** Each writer writes into a directory of its own,
   `<path>.eqshard-new-<16 random hex digits>`, beside `path`: never a directory it did
   not make. orbax reads part of the name it writes to as a glob pattern (its
   merge of each process's files), so where the path holds glob characters
   (`runs/exp[lr=3e-4]`), orbax is given `/proc/self/fd/<n>` for the staging
   directory instead (`literal_name`), a name free of them.
3. **Swap.** `renameat2(RENAME_EXCHANGE)` (Linux) exchanges the staging
   directory and the old checkpoint in one atomic step, so `path` always holds
   a complete checkpoint; the old one, now at the staging name, is removed.
   Where the file system has no exchange, two renames (the old one to
   `<path>.eqshard-old-<random hex>` first), under the lock.
4. **Generations.** A reader takes `generation(path)` before and after reading:
   the directory's inode and the bytes of eqshard's file, which holds a random
   generation id written by each save. If they differ, a save finished during
   the read, and what was read may mix two checkpoints.
"""

import contextlib
import ctypes
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import stat
import uuid
from collections.abc import Iterator
from typing import Any

from .._typing import warn


NEW, OLD, LOCK = ".eqshard-new", ".eqshard-old", ".eqshard-lock"
OWN_FILE = "eqshard.json"
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def staging_name(path: str) -> str:
    """A directory name beside `path` that no other writer uses."""
    return f"{path}{NEW}-{uuid.uuid4().hex[:16]}"


@contextlib.contextmanager
def literal_name(directory: str, caller: str) -> Iterator[str]:
    """A name of the directory `directory` that holds no glob characters, for
    orbax (see the module docstring): `directory` itself where it holds none,
    else `/proc/self/fd/<n>` for a descriptor of it, open while in use."""
    if glob.escape(directory) == directory:
        yield directory
        return
    if not os.path.isdir("/proc/self/fd"):
        raise ValueError(
            f"eqshard.{caller}: cannot write a checkpoint under {directory!r}: orbax "
            "reads glob characters ('[', '*', '?') in its path as a pattern, and "
            "this system has no /proc/self/fd to name the directory otherwise. "
            "Save under a path without them."
        )
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _is_staging(path: str, name: Any) -> bool:
    """Whether `name` is one of `staging_name(path)`'s names."""
    return (
        isinstance(name, str)
        and re.fullmatch(re.escape(path + NEW) + "-[0-9a-f]{16}", name) is not None
    )


# ---------------------------------------------------------------------------------
# The lock.
# ---------------------------------------------------------------------------------


# The largest process id a C `pid_t` holds.
_PID_MAX = 2**31 - 1


def _holder(info: Any) -> str:
    if not isinstance(info, dict):
        return "a writer that did not say who it is (its lock is empty or unreadable)"
    pid = info.get("pid")
    odd = type(pid) is int and not 0 < pid <= _PID_MAX
    return (
        f"process {pid!r}{' (not a pid of this host)' * odd} on host "
        f"{info.get('host')!r} (staging in {info.get('staging')!r})"
    )


def _read_lock(lock: str) -> Any:
    """What the lock at `lock` says, or `None` if it cannot be read as a lock."""
    try:
        info = json.loads(read_regular(lock, 1 << 16, follow=False) or b"")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def lock_holder(path: str) -> str | None:
    """Who holds the lock of the checkpoint at `path`, or `None` if no one."""
    lock = path + LOCK
    return _holder(_read_lock(lock)) if os.path.lexists(lock) else None


def _gone(info: Any) -> bool:
    """Whether the lock `info` was left by a process of this host that is gone."""
    if not isinstance(info, dict) or info.get("host") != socket.gethostname():
        return False
    pid = info.get("pid")
    if type(pid) is not int or not 0 < pid <= _PID_MAX or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _flocked(fd: int) -> bool:
    """Takes an `flock` on `fd` without waiting: `False` if another holds one.
    (Where the file system has no `flock`, the lock's file alone serves.)"""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        return error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)
    return True


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _write_info(fd: int, staging: str) -> None:
    info = {"host": socket.gethostname(), "pid": os.getpid(), "staging": staging}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


def held_error(caller: str, path: str, info: Any) -> ValueError:
    lock = path + LOCK
    return ValueError(
        f"eqshard.{caller}: another save is writing {path!r}: {_holder(info)} "
        f"holds {lock!r}. Two saves to one path at once would mix their "
        "checkpoints, so this one wrote nothing. Save again when that one has "
        "finished, or to another path; if that process is gone (on another host, "
        f"or killed), remove {lock!r} first."
    )


def _take_over(
    path: str, info: dict[str, Any], staging: str, caller: str
) -> int | None:
    """The lock left by `info`'s process, which is gone, made this writer's: its
    descriptor, or `None` if the lock changed meanwhile (look again)."""
    lock = path + LOCK
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise _not_a_file(caller, path, "a symbolic link") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_a_file(caller, path, "not a regular file")
        if not _flocked(fd):  # another writer is taking it over
            raise held_error(caller, path, _read_lock(lock))
        if not _same_file(fd, lock) or _read_lock(lock) != info:
            os.close(fd)
            return None
        _write_info(fd, staging)
    except BaseException:
        os.close(fd)
        raise
    left = info.get("staging")
    removed = ""
    if isinstance(left, str) and _is_staging(path, left) and os.path.isdir(left):
        shutil.rmtree(left, ignore_errors=True)
        removed = f"; its staging directory {left!r} was removed"
    warn(
        f"eqshard.{caller}: the save to {path!r} by {_holder(info)} stopped "
        f"midway (that process is gone), so this save took over its lock "
        f"{lock!r}{removed}."
    )
    return fd


def _not_a_file(caller: str, path: str, kind: str) -> ValueError:
    lock = path + LOCK
    return ValueError(
        f"eqshard.{caller}: the lock of the checkpoint at {path!r}, {lock!r}, is "
        f"{kind}, where eqshard writes a regular file: this save wrote nothing, "
        "and writes through no link. Remove it (eqshard did not make it), and "
        "save again."
    )


def _check_kind(path: str, caller: str) -> None:
    """Raises unless the lock of `path` is a regular file (or is gone)."""
    try:
        mode = os.lstat(path + LOCK).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise _not_a_file(caller, path, kind)


def take_lock(path: str, staging: str, caller: str) -> int:
    """Makes this process the one writer of `path` (see the module docstring):
    the lock's descriptor, for `release_lock`."""
    lock = path + LOCK
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(lock, flags, 0o644)
        except FileExistsError:
            _check_kind(path, caller)
            info = _read_lock(lock)
            if not _gone(info):
                raise held_error(caller, path, info) from None
            taken = _take_over(path, info, staging, caller)
            if taken is not None:
                return taken
            continue
        try:
            _flocked(fd)  # no other writer knows this file yet
            _write_info(fd, staging)
        except BaseException:
            os.close(fd)
            os.remove(lock)
            raise
        return fd
    raise held_error(caller, path, _read_lock(lock))


def release_lock(path: str, fd: int) -> None:
    """Removes this writer's lock of `path` (and only its own)."""
    try:
        if _same_file(fd, path + LOCK):
            os.remove(path + LOCK)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------
# The swap.
# ---------------------------------------------------------------------------------


def _renameat2(source: str, target: str, flags: int) -> bool:
    """`renameat2(source, target, flags)`: `False` where this system or file
    system has no such call (or flag); raises `OSError` on other failures."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is None:
        return False
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    names = os.fsencode(source), os.fsencode(target)
    if function(_AT_FDCWD, names[0], _AT_FDCWD, names[1], flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), source, None, target)


def rename_no_replace(source: str, target: str) -> None:
    """Renames `source` to `target`, atomically unless the file system has
    neither `renameat2` nor hard links; raises `FileExistsError` if something is
    at `target`."""
    if _renameat2(source, target, _RENAME_NOREPLACE):
        return
    if os.path.isfile(source) and not os.path.islink(source):
        try:
            os.link(source, target)
        except FileExistsError:
            raise
        except OSError:
            pass
        else:
            os.remove(source)
            return
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target)
    os.rename(source, target)


def swap(new: str, path: str) -> None:
    """Puts the complete checkpoint at `new` in the place of `path` (see the
    module docstring): in one atomic step where the file system can exchange
    two names, else with two renames."""
    if not os.path.lexists(path):
        rename_no_replace(new, path)
        return
    if _renameat2(new, path, _RENAME_EXCHANGE):
        shutil.rmtree(new, ignore_errors=True)  # the old checkpoint
        return
    old = f"{path}{OLD}-{uuid.uuid4().hex[:16]}"
    os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_regular(file: str, limit: int, *, follow: bool = True) -> bytes | None:
    """The first `limit` bytes of `file`, or `None` if there is no such file;
    raises `ValueError` if it is not a regular file (a FIFO, say, whose read
    would wait for a writer), without waiting, and `OSError` if it is a link
    and not `follow`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(file, flags | (0 if follow else os.O_NOFOLLOW))
    except FileNotFoundError:
        return None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ValueError(f"it is {kind}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def generation(path: str) -> tuple[Any, ...] | None:
    """What tells the checkpoint at `path` from any other that a save puts there
    (see the module docstring); `None` if there is none."""
    try:
        status = os.stat(path)
        data = read_regular(os.path.join(path, OWN_FILE), 1 << 20)
    except (OSError, ValueError):
        return None
    return status.st_dev, status.st_ino, data
