"""benchmarks/child_group.py: a harness's server child, started once more only when Ray's node
timed out starting, and stopped together with what it left behind in its process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from benchmarks.child_group import start_healthy, stop_group
from benchmarks.proc_stats import group_members
from tests.conftest import free_port

# a server whose first start fails as Ray's does when its node misses the 30 s (argv: a tries file, the port)
FAKE_SERVE = """
import http.server, pathlib, sys, threading
tries = pathlib.Path(sys.argv[1])
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
if len(tries.read_text()) == 1:  # the first start: Ray's node did not register in time
    sys.exit("Exception: The current node timed out during startup. This could happen because ...")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health)
print("READY fake", flush=True)
srv.serve_forever()
"""

# a child that leaves a helper in its group (vLLM's engine processes, a failed Ray start's daemons)
WITH_HELPER = """
import os, signal, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), helper.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("fails", ["startup timeout", "other error"])
def test_start_healthy_starts_once_more_only_when_rays_node_timed_out(tmp_path, fails):
    script = FAKE_SERVE if fails == "startup timeout" else FAKE_SERVE.replace("The current node", "Another node")
    port = free_port()
    url, logs = f"http://127.0.0.1:{port}", (tmp_path / "first.log", tmp_path / "second.log")
    cmd = [sys.executable, "-c", script, str(tmp_path / "tries"), str(port)]
    if fails == "other error":
        with pytest.raises(RuntimeError, match=r"exited \(code 1\)(.|\n)*Another node timed out"):
            start_healthy(cmd, url, logs, 30, dict(os.environ), cwd=tmp_path, poll_s=0.1)
        assert (tmp_path / "tries").read_text() == "x" and not logs[1].exists()
        return
    proc, log = start_healthy(cmd, url, logs, 30, dict(os.environ), cwd=tmp_path, poll_s=0.1)
    try:
        assert log == logs[1] and (tmp_path / "tries").read_text() == "xx"
        assert "timed out during startup" in logs[0].read_text()
        assert httpx.get(f"{url}/v1/health", timeout=5).status_code == 200
    finally:
        stop_group(proc)
    assert proc.returncode == -signal.SIGTERM and not group_members(proc.pid)


def test_a_child_never_healthy_is_reported_and_its_group_stopped(tmp_path):
    logs = (tmp_path / "first.log", tmp_path / "second.log")
    cmd = [sys.executable, "-c", WITH_HELPER, "stay"]
    with pytest.raises(RuntimeError, match="did not become healthy in 2 s"):
        start_healthy(cmd, f"http://127.0.0.1:{free_port()}", logs, 2, dict(os.environ), cwd=tmp_path, poll_s=0.1)
    child = int(logs[0].read_text().split()[0])
    assert not group_members(child) and not logs[1].exists()


@pytest.mark.parametrize("child", ["exits on SIGTERM", "ignores SIGTERM"])
def test_stop_group_ends_the_child_and_the_helpers_it_leaves(child):
    ignore = child == "ignores SIGTERM"
    proc = subprocess.Popen([sys.executable, "-c", WITH_HELPER, "ignore" if ignore else "stay"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid, helper = map(int, proc.stdout.readline().split())
    assert sorted(group_members(pid)) == sorted([pid, helper])
    stop_group(proc, grace_s=1.0, linger_s=0.5)
    assert proc.returncode == (-signal.SIGKILL if ignore else -signal.SIGTERM)
    assert not group_members(pid)  # the helper outlived its parent until the group's SIGKILL
    proc.stdout.close()
