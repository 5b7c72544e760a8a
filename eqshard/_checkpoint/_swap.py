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
   not make.
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

import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import uuid
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


def _is_staging(path: str, name: Any) -> bool:
    """Whether `name` is one of `staging_name(path)`'s names."""
    return (
        isinstance(name, str)
        and re.fullmatch(re.escape(path + NEW) + "-[0-9a-f]{16}", name) is not None
    )


# ---------------------------------------------------------------------------------
# The lock.
# ---------------------------------------------------------------------------------


def _holder(info: Any) -> str:
    if not isinstance(info, dict):
        return "a writer that did not say who it is (its lock is empty or unreadable)"
    return (
        f"process {info.get('pid')!r} on host {info.get('host')!r} (staging in "
        f"{info.get('staging')!r})"
    )


def _read_lock(lock: str) -> Any:
    """What the lock at `lock` says, or `None` if it cannot be read as a lock."""
    try:
        info = json.loads(read_regular(lock, 1 << 16) or b"")
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
    if type(pid) is not int or pid <= 0 or pid == os.getpid():
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
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
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


def take_lock(path: str, staging: str, caller: str) -> int:
    """Makes this process the one writer of `path` (see the module docstring):
    the lock's descriptor, for `release_lock`."""
    lock = path + LOCK
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(lock, flags, 0o644)
        except FileExistsError:
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


def read_regular(file: str, limit: int) -> bytes | None:
    """The first `limit` bytes of `file`, or `None` if there is no such file;
    raises `ValueError` if it is not a regular file (a FIFO, say, whose read
    would wait for a writer), without waiting."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
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
