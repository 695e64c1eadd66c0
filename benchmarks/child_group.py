"""A harness's server child: in a process group of its own, started once more when Ray's node
timed out starting, stopped together with whatever it left behind.

The harnesses (:class:`benchmarks.run_harness.Server`, :func:`loadtests.run.start_server`, the ``serve
run`` test) start their server with ``start_new_session=True``: the child leads a new process
group, and every Ray process it starts, or a failed start leaves, belongs to that group. Stopping
signals only what we started: the child, then the group we created for it.

``ray.init(address="local")`` gives its node 30 s to register with the GCS, a constant in
``ray/_private/node.py``. On an idle core the whole start takes ~8 s; pinned to a core that
two busy processes share, ~17 s; on a loaded 2-core CI machine it exceeded the 30 s and the
run failed before serving anything. A harness that sees this message in its child's log
starts the child once more (a new group, the failed one's Ray processes stopped).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.proc_stats import group_members

RAY_START_TIMEOUT = "The current node timed out during startup"


def ray_start_timed_out(log: Path) -> bool:
    """Whether the child's log shows Ray's node missing its start-up limit."""
    return RAY_START_TIMEOUT in log.read_text(errors="replace")


def stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM, whole_group: bool = False,
               grace_s: float = 60.0, linger_s: float = 10.0) -> None:
    """Stop a child started with ``start_new_session=True`` and its process group.

    ``first`` goes to the child (or, ``whole_group``, to every process of its group), which gets
    ``grace_s`` to exit. A child that exited leaves the rest of its group ``linger_s`` to follow
    (helpers that outlive their parent: vLLM's engine processes, Ray's daemons shutting down);
    then whatever is left of the group, or the child that ignored ``first``, gets SIGKILL, and the
    call returns once the group is gone (at most 5 s later)."""
    if proc.poll() is None:
        try:
            if whole_group:
                os.killpg(proc.pid, first)
            else:
                os.kill(proc.pid, first)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is not None:
        _wait_group_gone(proc.pid, linger_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    _wait_group_gone(proc.pid, 5.0)  # SIGKILL is delivered asynchronously: gone when this returns


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def start_healthy(cmd: list[str], url: str, logs: tuple[Path, Path], timeout_s: float, env: dict,
                  cwd: Path, poll_s: float = 0.5) -> tuple[subprocess.Popen, Path]:
    """Start ``cmd`` in a group of its own (stdout and stderr to ``logs[0]``) and wait until
    ``url/v1/health`` answers 200; once more (to ``logs[1]``, within the same ``timeout_s``) when
    the child exited because Ray's node timed out starting. Returns the running child and its log.

    Raises RuntimeError with the log's tail, the child's group stopped, when the child exits for
    any other reason or is not healthy in time."""
    deadline = time.monotonic() + timeout_s
    for log_path in logs:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                    return proc, log_path
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        exited = proc.poll()
        stop_group(proc, linger_s=0.0)  # a failed start's Ray processes do not end by themselves
        if exited is None:
            raise RuntimeError(f"the app did not become healthy in {timeout_s:.0f} s; see {log_path}:\n"
                               + log_path.read_text(errors="replace")[-3000:])
        if not ray_start_timed_out(log_path):
            break
    raise RuntimeError(f"the app process exited (code {exited}); see {log_path}:\n"
                       + log_path.read_text(errors="replace")[-3000:])
