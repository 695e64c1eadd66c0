"""CPU accounting of benchmark processes from /proc: per process, per thread, per server role.

Everything here reads ``/proc/<pid>/stat`` (``utime``/``stime``/``cutime``/``cstime``, in clock
ticks, see proc(5)) and ``/proc/<pid>/cmdline``; no psutil. A *server* is the process tree the
benchmark started for it (``serve_proc`` and every Ray process it spawns; vLLM's API server
and its engine-core and worker processes), all under one ``taskset`` core. Its whole cost over a
measurement window is :func:`tree_cpu_s` at the end minus at the start: the tree's own CPU plus
the CPU of children that exited and were reaped inside the tree (``cutime``/``cstime``), so a
helper process that ends during the window is not lost.

:func:`classify` names the role of a server process from its command line (Ray sets
``ray::ServeReplica:<app>:<Deployment>``, ``ray::ProxyActor``, ... as process titles; vLLM
``VLLM::EngineCore`` and ``VLLM::Worker``); :class:`CpuSnapshot` splits a window's CPU by role.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

CLK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` the benchmarks use (times in clock ticks)."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    utime: int
    stime: int
    cutime: int  # waited-for children, cumulative
    cstime: int
    processor: int  # the CPU it last ran on

    @property
    def own_ticks(self) -> int:
        return self.utime + self.stime

    @property
    def reaped_ticks(self) -> int:
        return self.cutime + self.cstime


def parse_stat(raw: str) -> Stat:
    """Parse one ``/proc/<pid>/stat`` line; ``comm`` may hold spaces and parentheses."""
    lpar, rpar = raw.index("("), raw.rindex(")")
    f = raw[rpar + 2:].split()  # f[0] is field 3 (state)
    return Stat(pid=int(raw[:lpar]), comm=raw[lpar + 1:rpar], state=f[0], ppid=int(f[1]), pgrp=int(f[2]),
                utime=int(f[11]),
                stime=int(f[12]), cutime=int(f[13]), cstime=int(f[14]), processor=int(f[36]))


def read_stat(pid: int, tid: int | None = None) -> Stat | None:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None  # gone, or a zombie without a complete line


def cmdline(pid: int) -> str:
    """The command line with NULs as spaces ('' when gone); shows Ray's and vLLM's process titles."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``/proc/<pid>/statm``'s second field, in pages); 0 when gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = read_stat(int(d))
            if st:
                children.setdefault(st.ppid, []).append(st.pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``: what is left of a group we started."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = read_stat(int(d))
            if st and st.pgrp == pgid and st.state != "Z":
                out.append(st.pid)
    return out


def tree_cpu_s(root: int, reaped: bool = True) -> float:
    """utime + stime of a process and its live descendants, plus (``reaped``) the CPU of their
    children that already exited and were waited for: differences over a window then count
    processes that ended inside it."""
    total = 0
    for p in descendants(root):
        st = read_stat(p)
        if st:
            total += st.own_ticks + (st.reaped_ticks if reaped else 0)
    return total / CLK


def process_cpu_s(root: int, cmdline_part: str) -> float:
    """CPU seconds of the processes in ``root``'s tree whose command line contains ``cmdline_part``."""
    total = 0
    for p in descendants(root):
        if cmdline_part not in cmdline(p):
            continue
        st = read_stat(p)
        if st:
            total += st.own_ticks
    return total / CLK


def thread_cpu_s(root: int, comm: str) -> float:
    """CPU seconds of every thread named ``comm`` in ``root``'s process tree."""
    total = 0
    for p in descendants(root):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            st = read_stat(p, int(t))
            if st and st.comm == comm:
                total += st.own_ticks
    return total / CLK


def cpu_busy() -> dict[str, float]:
    """Busy seconds per CPU since boot (/proc/stat), for the noise report."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                v = [int(x) for x in line.split()[1:]]
                out[line.split()[0]] = (sum(v) - v[3] - v[4]) / CLK  # minus idle and iowait
    return out


HOST_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_s() -> dict[str, float]:
    """The whole host's CPU seconds since boot by state (/proc/stat's first line, all CPUs)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:1 + len(HOST_STATES)]]
    return {k: x / CLK for k, x in zip(HOST_STATES, v)}


def affinity(pid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return []


# -- roles -------------------------------------------------------------------------------------
_REPLICA = re.compile(r"ServeReplica:[^:\s]+:([A-Za-z0-9_]+)")
ROLE_PATTERNS = (  # (substring of the command line, role); first match wins
    ("ray::ProxyActor", "proxy"),
    ("haproxy", "haproxy"),
    ("ray::ServeController", "controller"),
    ("raylet/raylet", "raylet"),
    ("gcs/gcs_server", "gcs"),
    ("ray::DashboardAgent", "ray_agents"),
    ("ray::RuntimeEnvAgent", "ray_agents"),
    ("dashboard/dashboard.py", "ray_agents"),
    ("dashboard/agent.py", "ray_agents"),
    ("log_monitor.py", "ray_agents"),
    ("autoscaler/_private/monitor.py", "ray_agents"),
    ("ray::IDLE", "ray_idle_workers"),
    ("VLLM::EngineCore", "engine_core"),
    ("VLLM::Worker", "vllm_worker"),
    ("vllm.entrypoints.openai.api_server", "api_server"),
    ("multiprocessing.resource_tracker", "mp_helpers"),
)


def classify(cmd: str) -> str:
    """The role of a server process from its command line (``other`` when unknown).

    Serve replicas become the deployment's name in lower case (``ray::ServeReplica:specedge:
    Verifier`` -> ``verifier``; ``...:Router`` -> ``router``), whatever method suffix Ray adds.
    """
    m = _REPLICA.search(cmd)
    if m:
        return m.group(1).lower()
    for part, role in ROLE_PATTERNS:
        if part in cmd:
            return role
    if "benchmarks.serve_proc" in cmd:
        return "driver"
    return "other"


@dataclass
class CpuSnapshot:
    """CPU ticks of a server's process tree at one instant, per process, with roles."""

    root: int
    ticks: dict[int, int] = field(default_factory=dict)  # pid -> own ticks
    roles: dict[int, str] = field(default_factory=dict)
    cores: dict[int, list[int]] = field(default_factory=dict)  # pid -> allowed CPUs
    total_ticks: int = 0  # own + reaped children, whole tree

    @classmethod
    def take(cls, root: int, roles: dict[int, str] | None = None) -> "CpuSnapshot":
        """``roles``: pid -> role already known (a process keeps the role it first had)."""
        snap = cls(root)
        for p in descendants(root):
            st = read_stat(p)
            if st is None:
                continue
            snap.ticks[p] = st.own_ticks
            snap.total_ticks += st.own_ticks + st.reaped_ticks
            snap.roles[p] = (roles or {}).get(p) or classify(cmdline(p))
            snap.cores[p] = affinity(p)
        return snap

    def since(self, before: "CpuSnapshot") -> dict:
        """The window from ``before`` to this snapshot: whole-tree CPU seconds, per role, and
        the cores the tree's processes may run on. CPU of processes that ended inside the window
        (reaped in the tree) has no role and goes to ``exited``."""
        by_role: dict[str, float] = {}
        for p, t in self.ticks.items():
            role = before.roles.get(p, self.roles[p])
            by_role[role] = by_role.get(role, 0.0) + (t - before.ticks.get(p, 0)) / CLK
        total = (self.total_ticks - before.total_ticks) / CLK
        rest = total - sum(by_role.values())
        if abs(rest) >= 1.0 / CLK:
            by_role["exited"] = rest
        return {"cpu_s": total, "by_role": dict(sorted(by_role.items())), "processes": len(self.ticks),
                "cores": sorted({c for cs in self.cores.values() for c in cs})}


def cpu_name() -> str:
    """The host CPU's model name (/proc/cpuinfo), for a benchmark's conditions."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
