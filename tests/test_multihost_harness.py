# Tests of the multi-process harness in multihost.py. The functions starting with
# `_child_` run inside the child processes, which import this file by path.

import inspect
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import multihost
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from multihost import MultiProcessError, MultiProcessTimeoutError, run_processes
from probes import RUN_TIMEOUT


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _sessions_alive(session_ids: set[int]) -> list[int]:
    """Pids of live or zombie processes in any of the given sessions."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # It exited while we looked.
            continue
        session = int(stat[stat.rindex(")") + 2 :].split()[3])
        if session in session_ids:
            found.append(int(entry))
    return found


def _exits_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` (not necessarily our child) exits within `seconds`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], seconds)[0])
    finally:
        os.close(fd)


def _eqshard_functions_checked() -> dict[str, bool]:
    """Whether each function of the loaded eqshard modules is wrapped by a type
    checker (jaxtyping's hook wraps them all; `@typecheck` only public ones)."""
    out = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "eqshard":
            continue
        for attr, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ == name:
                out[f"{name}.{attr}"] = hasattr(value, "__wrapped__")
    return out


def _child_topology_and_collectives(scale):
    import eqshard  # noqa: F401  (under jaxtyping's hook if the session is)

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))
    data = np.arange(2 * n, dtype=np.int32).reshape(n, 2)
    x = jax.make_array_from_callback(
        data.shape, NamedSharding(mesh, P("x")), lambda index: data[index]
    )
    total = jax.jit(lambda a: scale * jnp.sum(a))(x)
    try:
        warnings.warn("probe", DeprecationWarning)
        warning_raised = False
    except DeprecationWarning:
        warning_raised = True
    return {
        "os_pid": os.getpid(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": n,
        "local_device_count": jax.local_device_count(),
        "local_device_ids": sorted(d.id for d in jax.local_devices()),
        "global_device_ids": sorted(d.id for d in jax.devices()),
        "device_owners": sorted(d.process_index for d in jax.devices()),
        "gathered": multihost_utils.process_allgather(
            np.array([10 * jax.process_index() + 1])
        ),
        "total_is_replicated": total.is_fully_replicated,
        "total": np.asarray(total.addressable_data(0)).item(),
        "warning_raised": warning_raised,
        "checked": _eqshard_functions_checked(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("num_processes, devices_per_process", [(2, 4), (4, 2)])
def test_processes_see_one_global_system(num_processes, devices_per_process):
    import eqshard  # noqa: F401  (here, so only this test needs eqshard to import)

    results = run_processes(
        _child_topology_and_collectives,
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        args=(3,),
    )
    assert len(results) == num_processes
    assert [r["process_index"] for r in results] == list(range(num_processes))
    global_ids = results[0]["global_device_ids"]
    checked_here = _eqshard_functions_checked()
    assert len(global_ids) == 8
    local_ids = []
    for r in results:
        assert r["process_count"] == num_processes
        assert r["device_count"] == 8
        assert r["local_device_count"] == devices_per_process
        assert r["global_device_ids"] == global_ids
        assert r["device_owners"] == sorted(
            list(range(num_processes)) * devices_per_process
        )
        # process_allgather stacks each process's [10 * index + 1].
        expected = np.array([[10 * p + 1] for p in range(num_processes)])
        np.testing.assert_array_equal(r["gathered"], expected)
        # 3 * (0 + 1 + ... + 15), summed across all processes' shards.
        assert r["total_is_replicated"]
        assert r["total"] == 360
        # Children mirror pytest's `filterwarnings = ["error"]`...
        assert r["warning_raised"]
        # ...and its jaxtyping hook, if any: the same eqshard functions are checked.
        # (Only names known to both: others may edit eqshard during the run.)
        common = r["checked"].keys() & checked_here.keys()
        assert len(common) > 10
        assert {k: r["checked"][k] for k in common} == {
            k: checked_here[k] for k in common
        }
        local_ids += r["local_device_ids"]
    assert sorted(local_ids) == global_ids
    assert _sessions_alive({r["os_pid"] for r in results}) == []


def _child_fail_in_process_1(mode):
    if jax.process_index() == 0:
        threading.Event().wait()  # Blocks until the harness kills it.
    if mode == "raise":
        raise ValueError(f"boom from process {jax.process_index()}")
    return lambda: "functions defined with lambda cannot be pickled"


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("raise", "ValueError: boom from process 1"),
        ("unpicklable", "while pickling the result of"),
    ],
)
def test_a_failing_process_fails_the_launch_with_its_traceback(mode, expected):
    with pytest.raises(MultiProcessError) as excinfo:
        run_processes(
            _child_fail_in_process_1,
            devices_per_process=1,
            args=(mode,),
            timeout=RUN_TIMEOUT,
        )
    error = excinfo.value
    message = str(error)
    assert type(error) is MultiProcessError
    assert error.failed == (1,)
    assert f"process 1 (pid {error.pids[1]}) raised" in message
    assert "Traceback (most recent call last)" in message
    assert "_child_fail_in_process_1" in message
    assert expected in message
    assert "Process(es) [0] were killed after that failure" in message
    assert _sessions_alive(set(error.pids)) == []


def _child_block_in_process_1():
    if jax.process_index() == 1:
        threading.Event().wait()
    return "process 0 then waits for process 1 in jax.distributed.shutdown"


@pytest.mark.slow
def test_a_hanging_launch_times_out_with_stacks_and_leaves_no_process():
    with pytest.raises(MultiProcessTimeoutError) as excinfo:
        run_processes(_child_block_in_process_1, devices_per_process=1, timeout=15)
    error = excinfo.value
    message = str(error)
    assert "timed out after 15 s" in message
    assert error.failed == (0, 1)
    # The Python stacks that faulthandler printed at the timeout show where each
    # process was blocked.
    stack_1 = message.split("process 1 (pid")[1]
    assert "in _child_block_in_process_1" in stack_1
    stack_0 = message.split("process 1 (pid")[0]
    assert "in shutdown" in stack_0
    assert _sessions_alive(set(error.pids)) == []


def _child_process_index():
    return jax.process_index()


def test_a_taken_port_is_retried_once(monkeypatch):
    ports = []
    real_free_port = multihost._free_port

    def first_port_taken():
        ports.append(taken_port if not ports else real_free_port())
        return ports[-1]

    with socket.create_server(("127.0.0.1", 0)) as taken:
        taken_port = taken.getsockname()[1]
        monkeypatch.setattr(multihost, "_free_port", first_port_taken)
        results = run_processes(_child_process_index, devices_per_process=1)
    assert results == [0, 1]
    assert len(ports) == 2 and ports[0] == taken_port != ports[1]


def _child_report_pid_then_block(port):
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(f"{os.getpid()}\n".encode())
    threading.Event().wait()


def test_children_exit_when_the_parent_is_killed():
    # A parent python process runs a launch whose children report their pids to
    # us and block; we SIGKILL that parent, so no `finally` of it runs.
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(RUN_TIMEOUT)
        port = server.getsockname()[1]
        code = (
            f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import multihost, "
            f"test_multihost_harness as t; multihost.run_processes("
            f"t._child_report_pid_then_block, devices_per_process=1, "
            f"args=({port},), timeout={RUN_TIMEOUT})"
        )
        parent = subprocess.Popen([sys.executable, "-c", code])
        pids = []
        try:
            for _ in range(2):
                connection, _ = server.accept()
                with connection, connection.makefile() as lines:
                    pids.append(int(lines.readline()))
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            assert all(_exits_within(pid, 30) for pid in pids)
        finally:
            parent.kill()
            parent.wait()
            for pid in pids:  # Only if the test failed: leave no process behind.
                if not _exits_within(pid, 0):
                    os.killpg(pid, signal.SIGKILL)


def _child_unused():
    return None


@pytest.mark.parametrize(
    "fn, kwargs, error, match",
    [
        (lambda: 0, {}, ValueError, "fn must be a module-level function"),
        (_child_unused, {"num_processes": 0}, ValueError, "num_processes must be"),
        (_child_unused, {"devices_per_process": 1.5}, ValueError, "devices_per"),
        (_child_unused, {"timeout": 0}, ValueError, "timeout must be > 0"),
        (_child_unused, {"args": (threading.Lock(),)}, TypeError, "picklable"),
    ],
)
def test_bad_arguments_are_rejected_before_launching(fn, kwargs, error, match):
    with pytest.raises(error, match=match):
        run_processes(fn, **kwargs)


def test_a_nested_function_is_rejected():
    def nested():
        return 0

    with pytest.raises(ValueError, match="test_a_nested_function_is_rejected"):
        run_processes(nested)
