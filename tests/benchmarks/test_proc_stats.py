"""/proc accounting: stat parsing, role names of Ray/vLLM processes, whole-tree CPU windows."""

import os
import subprocess
import sys
import time

import pytest

from benchmarks.proc_stats import (CLK, CpuSnapshot, classify, cmdline, descendants, group_members, parse_stat,
                                   read_stat, tree_cpu_s)

# a real line's shape (fields 3..52) with a comm that holds spaces and parentheses
STAT = ("4242 (ray::Serve (x) y) S 4100 4100 4100 0 -1 4194560 1000 0 0 0 150 25 7 3 20 0 12 0 999 "
        "100000 2000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 0 0 0 0 0 0 0 0")


def test_parse_stat_fields_after_a_comm_with_spaces_and_parens():
    st = parse_stat(STAT)
    assert (st.pid, st.comm, st.state, st.ppid, st.pgrp) == (4242, "ray::Serve (x) y", "S", 4100, 4100)
    assert (st.utime, st.stime, st.cutime, st.cstime) == (150, 25, 7, 3)
    assert st.own_ticks == 175 and st.reaped_ticks == 10 and st.processor == 0


def test_parse_stat_of_this_process():
    st = read_stat(os.getpid())
    assert st.pid == os.getpid() and st.ppid == os.getppid() and st.state in "RS"


@pytest.mark.parametrize("cmd,role", [
    ("ray::ProxyActor", "proxy"),
    ("ray::ServeReplica:specedge:Router", "router"),
    ("ray::ServeReplica:specedge:Verifier", "verifier"),
    ("ray::ServeReplica:specedge:Verifier.handle_request_streaming", "verifier"),
    ("ray::ServeController", "controller"),
    ("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/ray/s", "raylet"),
    ("/x/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp", "gcs"),
    ("ray::DashboardAgent", "ray_agents"),
    ("/v/bin/python -u /v/ray/_private/log_monitor.py --session-dir=x", "ray_agents"),
    ("ray::IDLE", "ray_idle_workers"),
    (".venv/bin/python -m benchmarks.serve_proc --config c.json --port 1", "driver"),
    (".venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model m", "api_server"),
    ("VLLM::EngineCore", "engine_core"),
    ("VLLM::Worker", "vllm_worker"),
    ("something else", "other"),
])
def test_classify_names_server_roles(cmd, role):
    assert classify(cmd) == role


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_tree_cpu_counts_live_descendants_and_reaped_children():
    # parent: spawns a child that burns 0.2 s and is waited for, then burns 0.1 s itself and sleeps
    code = ("import subprocess, sys, time\n"
            f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.2)!r}])\n"
            + BURN.format(s=0.1) + "print('done', flush=True)\ntime.sleep(30)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        before = CpuSnapshot.take(p.pid)
        assert p.stdout.readline().strip() == "done"
        after = CpuSnapshot.take(p.pid)
        assert p.pid in descendants(p.pid) and p.pid in group_members(p.pid)
        assert "time.sleep" in cmdline(p.pid)
        win = after.since(before)
        # the reaped child's 0.2 s is counted (in the parent's cutime) next to the parent's own 0.1 s
        assert win["cpu_s"] >= 0.28 - 2 / CLK
        assert tree_cpu_s(p.pid) - tree_cpu_s(p.pid, reaped=False) >= 0.18
        assert win["by_role"]["other"] >= 0.08 and win["by_role"].get("exited", 0.0) >= 0.15
        assert win["processes"] == 1 and win["cores"]
    finally:
        p.kill()
        p.wait()


def test_snapshot_keeps_the_first_role_of_a_process():
    snap = CpuSnapshot.take(os.getpid(), roles={os.getpid(): "verifier"})
    assert snap.roles[os.getpid()] == "verifier"
    time.sleep(0.01)
    win = CpuSnapshot.take(os.getpid(), roles=snap.roles).since(snap)
    # this process keeps the role it was given, which its command line alone would not give it; children
    # that earlier tests left to this process (multiprocessing's resource tracker) keep their own roles
    assert "verifier" in win["by_role"] and classify(cmdline(os.getpid())) != "verifier"


def test_the_hosts_cpu_by_state_counts_the_time_that_passes():
    """host_cpu_s: every CPU state of /proc/stat's first line; over a busy half second the states
    together grow by about the wall times the CPUs /proc/stat lists (one of them at least busy meanwhile)."""
    import time

    from benchmarks.proc_stats import HOST_STATES, host_cpu_s

    a, t0 = host_cpu_s(), time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        pass
    b, wall = host_cpu_s(), time.perf_counter() - t0
    assert tuple(a) == HOST_STATES and all(b[k] >= a[k] >= 0 for k in HOST_STATES)
    cpus = sum(1 for line in open("/proc/stat") if line.startswith("cpu") and line[3].isdigit())
    grown = sum(b.values()) - sum(a.values())
    assert 0.5 * wall * cpus <= grown <= 1.5 * wall * cpus + 0.05
    ran = ("user", "nice", "system")  # a niced run's CPU counts as "nice"
    assert sum(b[k] - a[k] for k in ran) >= 0.2 * wall  # this loop's own
