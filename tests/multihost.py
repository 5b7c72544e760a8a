"""Run a test function in several JAX processes on localhost.

`run_processes(fn, num_processes=2, devices_per_process=4)` starts one Python
process per JAX process. Each child sets its virtual CPU devices and the gloo CPU
collectives, calls `jax.distributed.initialize` against a coordinator on a free
localhost port, imports the module that defines `fn` (by file path), calls
`fn(*args)`, and pickles the return value into a file the parent reads back.

Children mirror the pytest session: warnings are errors, and where the session
checks eqshard's annotations at call time (`--jaxtyping-packages`, see
CONTRIBUTING.md), children import eqshard under jaxtyping's import hook too.

No process outlives a launch. Every child leads its own session and process group.
The parent kills every group and reaps every child in a `finally` block, whether
the launch succeeded, failed, timed out or was interrupted. A child whose parent
dies (even from SIGKILL) sees its stdin pipe close and exits at once.

This file is also the children's entry point (`python multihost.py SPEC ID RESULT`).
It imports only the standard library at module level, so the parent never
initialises JAX on its behalf.
"""

import faulthandler
import importlib.util
import math
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any


# What a pytest session that checks annotations at call time passes as
# `--jaxtyping-packages` (see CONTRIBUTING.md).
_JAXTYPING_PACKAGES = ("eqshard",)
_JAXTYPING_CHECKER = "beartype.beartype"

# The coordinator of a stolen port logs this line and fails; that launch is
# retried once on a new port.
_PORT_TAKEN = "Failed to add port to server"
# After a timeout each running child gets SIGUSR1: faulthandler prints its Python
# stacks and the default action then ends it. A child that does not end within
# this many seconds is killed without its stacks.
_STACK_DUMP_GRACE = 5.0
# How much of a child's output an error message shows.
_TAIL_LINES = 40
_TAIL_CHARS = 6000


class MultiProcessError(RuntimeError):
    """A [`run_processes`][] launch failed.

    The message holds, for each failed process, its id, its traceback (or how it
    ended) and the tail of its output.

    **Attributes:**

    - `pids`: the OS process id of each child, indexed by JAX process id.
    - `failed`: the JAX process ids that raised, crashed or timed out.
    - `outputs`: the full captured stdout and stderr of each child.
    """

    def __init__(
        self,
        message: str,
        *,
        pids: tuple[int, ...],
        failed: tuple[int, ...],
        outputs: tuple[str, ...],
    ):
        super().__init__(message)
        self.pids = pids
        self.failed = failed
        self.outputs = outputs


class MultiProcessTimeoutError(MultiProcessError):
    """A [`run_processes`][] launch did not finish within its timeout."""


def _hooked() -> bool:
    """Whether this process imports under jaxtyping's import hook (a pytest run
    with `--jaxtyping-packages`)."""
    return any(type(f).__module__.startswith("jaxtyping") for f in sys.meta_path)


def run_processes(
    fn: Callable[..., Any],
    *,
    num_processes: int = 2,
    devices_per_process: int = 4,
    timeout: float = 900.0,  # as `probes.RUN_TIMEOUT`: a working launch is never cut
    args: tuple[Any, ...] = (),
    typecheck: bool | None = None,
    distributed: bool = True,
) -> list[Any]:
    """Runs `fn(*args)` in `num_processes` JAX processes and returns their results.

    Each child process has `devices_per_process` virtual CPU devices, uses the gloo
    CPU collectives, and is initialised with `jax.distributed.initialize` before
    `fn`'s module is imported, so `jax.devices()` lists all
    `num_processes * devices_per_process` devices and `jax.process_index()` tells
    the children apart. `fn` must be a module-level function of a module file
    (a test module is fine): children load that file by path, after initialising
    JAX, so its module-level code may use JAX.

    A launch costs about 2 s, so one `fn` should check many things and return them
    all, e.g. as a dict of NumPy arrays and Python scalars; assert on them in the
    parent, where pytest shows helpful diffs.

    **Arguments:**

    - `fn`: a module-level function. It runs in every process.
    - `num_processes`: how many JAX processes to start.
    - `devices_per_process`: virtual CPU devices per process.
    - `timeout`: seconds for the whole launch. Children still running then have
      their Python stacks printed into the error, and are killed.
    - `args`: positional arguments for `fn`, pickled and sent to every child.
    - `typecheck`: whether the children import eqshard under jaxtyping's import
      hook; by default, as this process does (`_hooked`). The benchmarks turn it
      off, to time eqshard as users run it (with only its own `@typecheck` on
      public functions).
    - `distributed`: `False` starts plain, separate Python processes instead
      (no `jax.distributed`: each is process 0 of its own, with its own
      `devices_per_process` devices), as separate jobs on one machine are; each
      child finds its launch index in the environment variable
      `MULTIHOST_PROCESS_ID`.

    **Returns:**

    The list of `fn`'s return values, indexed by `jax.process_index()`. They must
    be picklable: return NumPy arrays (`np.asarray(x.addressable_data(0))`), not
    arrays that span other processes.

    **Raises:**

    - `MultiProcessError` if any process raised (its id and traceback are in the
      message), crashed, or returned something that cannot be pickled.
    - `MultiProcessTimeoutError` (a `MultiProcessError`) on timeout.
    - `ValueError`/`TypeError` for a bad `fn`, count, timeout or `args`.

    !!! Example

        ```python
        # tests/test_something.py
        import jax
        import numpy as np
        from jax.experimental import multihost_utils
        from multihost import run_processes

        def _child():
            ids = multihost_utils.process_allgather(np.array(jax.process_index()))
            return {"count": jax.device_count(), "ids": ids}

        def test_something():
            results = run_processes(_child, num_processes=2, devices_per_process=4)
            assert [r["count"] for r in results] == [8, 8]
            np.testing.assert_array_equal(results[1]["ids"], [0, 1])
        ```
    """
    target = _describe_target(fn)
    for name, value in (
        ("num_processes", num_processes),
        ("devices_per_process", devices_per_process),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"run_processes: {name} must be an int >= 1, got {value!r}."
            )
    if not timeout > 0:
        raise ValueError(
            f"run_processes: timeout must be > 0 seconds, got {timeout!r}."
        )
    try:
        pickled_args = pickle.dumps(tuple(args))
    except Exception as e:
        raise TypeError(
            f"run_processes: args for {target['name']} must be picklable, since they "
            f"are sent to the child processes: {e!r}."
        ) from e

    deadline = time.monotonic() + timeout
    spec = dict(
        target,
        args=pickled_args,
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        typecheck=_hooked() if typecheck is None else typecheck,
        distributed=distributed,
    )
    with tempfile.TemporaryDirectory(prefix="eqshard-multihost-") as tmp:
        spec["port"] = _free_port()
        outcome = _launch(spec, os.path.join(tmp, "first"), deadline)
        if _port_was_taken(outcome):
            # Someone took the port between `_free_port` and the coordinator's bind.
            spec["port"] = _free_port()
            outcome = _launch(spec, os.path.join(tmp, "retry"), deadline)
    return _results_or_raise(outcome, spec, timeout)


def _describe_target(fn: Callable[..., Any]) -> dict[str, str]:
    """Finds the module file and qualified name a child needs to load `fn`."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    path = getattr(module, "__file__", None)
    found = module
    for part in qualname.split(".") if isinstance(qualname, str) else ():
        found = getattr(found, part, None)
    if (
        found is not fn
        or path is None
        or not isinstance(module_name, str)
        or not isinstance(qualname, str)
        or module_name == "__main__"
    ):
        raise ValueError(
            f"run_processes: fn must be a module-level function of an importable "
            f"module file, since each child process imports it by path; got {fn!r} "
            f"(module {module_name!r}). Define it with `def` at the top level of "
            f"the test module."
        )
    return {
        "module_name": module_name,
        "module_path": os.path.abspath(path),
        "qualname": qualname,
        "name": f"{module_name}.{qualname}",
    }


def _free_port() -> int:
    """A localhost TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    # The device count comes from `jax_num_cpu_devices`; drop a competing flag.
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _launch(spec: dict[str, Any], workdir: str, deadline: float) -> dict[str, Any]:
    """Starts the children, waits for them, and always kills and reaps them all."""
    os.makedirs(workdir)
    spec_path = os.path.join(workdir, "spec.pkl")
    with open(spec_path, "wb") as f:
        pickle.dump(spec, f)
    n = spec["num_processes"]
    logs = [os.path.join(workdir, f"output-{i}.txt") for i in range(n)]
    results = [os.path.join(workdir, f"result-{i}.pkl") for i in range(n)]
    procs: list[subprocess.Popen] = []
    pidfds: list[int] = []
    timed_out = False
    env = _child_env()
    try:
        for i in range(n):
            with open(logs[i], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, spec_path, str(i), results[i]],
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
            pidfds.append(os.pidfd_open(procs[-1].pid))
        running = _wait_for_exits(
            procs, pidfds, set(range(n)), deadline, stop_on_failure=True
        )
        if running and not _any_failed(procs, set(range(n)) - running):
            # Nobody failed, so the deadline passed: ask for Python stacks first.
            timed_out = True
            for i in running:
                _signal_process(procs[i].pid, signal.SIGUSR1)
            grace = time.monotonic() + _STACK_DUMP_GRACE
            _wait_for_exits(procs, pidfds, running, grace, stop_on_failure=False)
        stopped = running  # Killed by us below (after their stacks, on timeout).
    finally:
        # Kill the group of every child while its leader is unreaped (an exited
        # leader stays a zombie until `wait`), so the group id cannot be reused.
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()
            if p.stdin is not None:
                p.stdin.close()
        for fd in pidfds:
            os.close(fd)
    outputs = []
    for log in logs:
        with open(log, encoding="utf-8", errors="replace") as f:
            outputs.append(f.read())
    records = []
    for path in results:
        if os.path.exists(path):
            with open(path, "rb") as f:
                records.append(f.read())
        else:
            records.append(None)
    return {
        "pids": tuple(p.pid for p in procs),
        "returncodes": tuple(p.returncode for p in procs),
        "outputs": tuple(outputs),
        "records": records,
        "stopped": stopped,
        "timed_out": timed_out,
    }


def _wait_for_exits(
    procs: list[subprocess.Popen],
    pidfds: list[int],
    running: set[int],
    deadline: float,
    *,
    stop_on_failure: bool,
) -> set[int]:
    """Waits until all of `running` exit, the deadline passes, or (if
    `stop_on_failure`) one of them fails; returns the ones still running.
    Children are not reaped here (see `_launch`)."""
    poller = select.poll()
    index = {}
    for i in running:
        poller.register(pidfds[i], select.POLLIN)
        index[pidfds[i]] = i
    running = set(running)
    while running:
        remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
        events = poller.poll(remaining_ms) if remaining_ms > 0 else []
        if not events:
            break
        for fd, _ in events:
            i = index[fd]
            poller.unregister(fd)
            running.discard(i)
            if stop_on_failure and _any_failed(procs, {i}):
                return running
    return running


def _any_failed(procs: list[subprocess.Popen], exited: set[int]) -> bool:
    """Whether any of the exited children ended with a nonzero status."""
    for i in exited:
        info = os.waitid(os.P_PID, procs[i].pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and not (
            info.si_code == os.CLD_EXITED and info.si_status == 0
        ):
            return True
    return False


def _signal_process(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _port_was_taken(outcome: dict[str, Any]) -> bool:
    # The coordinator (process 0) logs this, then raises or crashes.
    return _PORT_TAKEN in outcome["outputs"][0]


def _results_or_raise(
    outcome: dict[str, Any], spec: dict[str, Any], timeout: float
) -> list[Any]:
    n = spec["num_processes"]
    statuses = []
    for i in range(n):
        record = outcome["records"][i]
        if record is None:
            statuses.append(None)
            continue
        try:
            statuses.append(pickle.loads(record))
        except Exception:
            statuses.append(
                {
                    "ok": False,
                    "phase": "unpickling the result in the parent process",
                    "traceback": traceback.format_exc(),
                }
            )
    if all(s is not None and s["ok"] for s in statuses):
        return [s["value"] for s in statuses]
    raise _failure_error(outcome, spec, statuses, timeout)


def _tail(text: str) -> str:
    lines = text.rstrip("\n").splitlines()
    tail = "\n".join(lines[-_TAIL_LINES:])
    if len(tail) > _TAIL_CHARS:
        tail = "..." + tail[-_TAIL_CHARS:]
    elif len(lines) > _TAIL_LINES:
        tail = "...\n" + tail
    return tail or "(no output)"


def _describe_returncode(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _failure_error(
    outcome: dict[str, Any],
    spec: dict[str, Any],
    statuses: list[dict[str, Any] | None],
    timeout: float,
) -> MultiProcessError:
    """Builds the one error for a failed launch: a section per failed process."""
    n = spec["num_processes"]
    pids = outcome["pids"]
    timed_out = outcome["timed_out"]
    failed, sections, stopped = [], [], []
    for i, status in enumerate(statuses):
        who = f"process {i} (pid {pids[i]})"
        if status is not None and status["ok"]:
            continue
        if status is not None:
            text = f"{who} raised while {status['phase']}:\n{status['traceback']}"
        elif i in outcome["stopped"] and timed_out:
            text = f"{who} was still running at the timeout; its Python stacks:"
        elif i in outcome["stopped"]:
            stopped.append(i)
            continue
        else:
            code = _describe_returncode(outcome["returncodes"][i])
            text = f"{who} ended with {code} without reporting a result."
        failed.append(i)
        sections.append(
            f"{text.rstrip()}\n--- output of process {i}, last lines ---\n"
            f"{_tail(outcome['outputs'][i])}"
        )
    if timed_out:
        headline = (
            f"timed out after {timeout:g} s; process(es) {failed} of {n} did not "
            f"finish. Look for the blocked call in the stacks below, or raise "
            f"`timeout=`."
        )
    else:
        headline = f"process(es) {failed} of {n} failed."
    if stopped:
        headline += f" Process(es) {stopped} were killed after that failure."
    message = (
        f"run_processes({spec['name']}, num_processes={n}, "
        f"devices_per_process={spec['devices_per_process']}): {headline}\n\n"
        + "\n\n".join(sections)
    )
    error_type = MultiProcessTimeoutError if timed_out else MultiProcessError
    return error_type(
        message, pids=pids, failed=tuple(failed), outputs=outcome["outputs"]
    )


# ---------------------------------------------------------------------------
# Child side.


def _exit_when_parent_dies() -> None:
    """Blocks until the parent's end of our stdin closes, then exits."""
    try:
        sys.stdin.buffer.read()
    finally:
        os._exit(70)


def _write_record(path: str, data: bytes) -> None:
    # Write then rename, so the parent never reads half a record.
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _child_main(spec_path: str, process_id: int, result_path: str) -> None:
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    threading.Thread(target=_exit_when_parent_dies, daemon=True).start()
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    phase = "starting JAX (jax.distributed.initialize)"
    distributed = spec.get("distributed", True)
    os.environ["MULTIHOST_PROCESS_ID"] = str(process_id)
    try:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", spec["devices_per_process"])
        if distributed:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            address = f"127.0.0.1:{spec['port']}"
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=spec["num_processes"],
                process_id=process_id,
                coordinator_bind_address=address,
            )

        phase = f"importing {spec['module_path']}"
        warnings.simplefilter("error")
        import jaxtyping

        if spec["typecheck"]:
            jaxtyping.install_import_hook(_JAXTYPING_PACKAGES, _JAXTYPING_CHECKER)
        sys.path.insert(0, os.path.dirname(spec["module_path"]))
        module_spec = importlib.util.spec_from_file_location(
            spec["module_name"], spec["module_path"]
        )
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[spec["module_name"]] = module
        module_spec.loader.exec_module(module)
        fn: Any = module
        for part in spec["qualname"].split("."):
            fn = getattr(fn, part)

        phase = f"unpickling the args of {spec['name']}"
        args = pickle.loads(spec["args"])
        phase = f"calling {spec['name']}"
        value = fn(*args)
        phase = f"pickling the result of {spec['name']}"
        record = pickle.dumps({"ok": True, "value": value})
        phase = "shutting down JAX (jax.distributed.shutdown)"
        if distributed:
            jax.distributed.shutdown()
    except BaseException:
        failure = {"ok": False, "phase": phase, "traceback": traceback.format_exc()}
        _write_record(result_path, pickle.dumps(failure))
        exit_code = 1
    else:
        _write_record(result_path, record)
        exit_code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: after a failure other processes may be blocked
    # in collectives with us, and JAX's exit hooks would wait for them.
    os._exit(exit_code)


if __name__ == "__main__":
    _child_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
