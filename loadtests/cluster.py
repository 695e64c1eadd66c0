"""A multi-node Ray cluster on one machine, optionally with GCS fault tolerance on a real Redis.

What the node-loss and GCS-restart tests (tests/loadtests/test_cluster_faults.py) and ``make chaos`` run
the app on (docs: loadtests/README.md, "Node loss and GCS restarts"):

- :class:`Redis`: Debian's ``redis-server`` on a free loopback port, a password, no persistence (the
  head's external store; KubeRay's ``gcsFaultToleranceOptions`` points the head at one the same way);
- :class:`LocalCluster`: a head and ``workers`` worker nodes from Ray's own ``ray.cluster_utils.Cluster``,
  each its own raylet with its own logical CPUs and a ``specedge_node_<i>`` resource, in a temp dir of its
  own (never ``/tmp/ray``: other Ray instances on the machine are left alone); with a Redis the head
  starts with ``RAY_REDIS_ADDRESS`` + its password, as ``ray start`` does under KubeRay's GCS FT. Serve
  runs a proxy on every node (``proxy_location=EveryNode``), each worker's on a port of its own
  (``RAY_SERVE_WORKER_PROXY_HTTP_PORT``, since they share one address here);
- :meth:`LocalCluster.kill_node`: SIGKILL to the node's raylet, its workers (the replicas) and its other
  processes at once, as when a machine dies; :meth:`LocalCluster.add_worker` brings a node back;
- :meth:`LocalCluster.restart_gcs`: SIGKILL to the head's ``gcs_server``, ``down_s`` seconds without
  it, then a new ``gcs_server`` on the same port that loads the cluster's tables from Redis.

Everything it starts is a child of this process and stopped by :meth:`LocalCluster.shutdown`, by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# The GCS's health checks of the raylets: a SIGKILLed raylet refuses the check at once, so it is declared dead
# after ~threshold x period: 5 s here instead of Ray's 15 s (3 s x 5), so that the scenarios see a node's replicas
# replaced within seconds; a live raylet slowed by a loaded machine still has 5 x (3 + 1) s to answer.
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 2000, "health_check_period_ms": 1000,
                   "health_check_timeout_ms": 3000, "health_check_failure_threshold": 5}
NODE_RESOURCE = "specedge_node_{}"  # one unit on node i (the head is 0): pins a test's actor to a node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_available() -> str | None:
    """The ``redis-server`` binary, or None (``scripts/install_redis.sh`` installs it)."""
    return shutil.which("redis-server")


class Redis:
    """``redis-server`` on a free loopback port with a password and no persistence, a child of this process."""

    def __init__(self, workdir: Path, password: str = "specedge-gcs-ft"):
        self.workdir, self.password = Path(workdir), password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "Redis":
        binary = redis_available()
        if binary is None:
            raise RuntimeError("redis-server is not installed (bash scripts/install_redis.sh)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--requirepass", self.password, "--dir", str(self.workdir),
             "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}); see {self.workdir / 'redis.log'}")
            try:
                if self.command("PING") == "+PONG":
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"redis-server did not answer on {self.address} within {timeout_s:g} s")

    def command(self, *args: str) -> str:
        """One command after AUTH (RESP), the first line of its reply."""
        def enc(parts):
            return b"".join([f"*{len(parts)}\r\n".encode()]
                            + [f"${len(p.encode())}\r\n{p}\r\n".encode() for p in parts])

        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(enc(["AUTH", self.password]) + enc(list(args)))
            data = b""
            while data.count(b"\r\n") < 2:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        lines = data.split(b"\r\n")
        if lines[0] != b"+OK":
            raise RuntimeError(f"redis AUTH failed: {lines[0]!r}")
        return lines[1].decode(errors="replace")

    def keys(self) -> int:
        """How many keys the GCS has stored (DBSIZE)."""
        return int(self.command("DBSIZE").lstrip(":"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class NodeInfo:
    index: int  # 0 = the head
    node: object  # ray._private.node.Node
    proxy_port: int
    killed_at: float | None = None
    pids: list[int] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        return self.node.node_id


class LocalCluster:
    """A head and ``workers`` worker nodes on this machine (see the module docstring). Use as a context manager
    or call :meth:`start` / :meth:`shutdown`; this process is the head's driver."""

    def __init__(self, workers: int = 2, cpus_per_node: float = 2, redis: bool = True, http_port: int | None = None,
                 env: dict[str, str] | None = None, system_config: dict | None = None,
                 object_store_mb: int = 80, temp_root: str | None = None):
        self.workers, self.cpus_per_node, self.use_redis = workers, cpus_per_node, redis
        self.http_port = http_port or free_port()
        self.env = dict(env or {})
        self.system_config = {**FAST_NODE_DEATH, "worker_niceness": 0, "metrics_report_interval_ms": 2000,
                              **(system_config or {})}
        self.object_store = object_store_mb * 1024 * 1024
        # short: Unix socket paths under it must stay below 108 bytes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="sec-", dir=temp_root or "/tmp"))
        self.redis: Redis | None = None
        self.head = None  # ray._private.node.Node of the head (this process's)
        self.nodes: list[NodeInfo] = []  # every node started, in order (killed ones stay, with killed_at)
        self.gcs_restarts: list[dict] = []
        self._next_index = 0
        self._saved_env: dict[str, str | None] = {}

    # -- life cycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _setenv(self, key: str, value: str | None) -> None:
        if key not in self._saved_env:
            self._saved_env[key] = os.environ.get(key)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

    def start(self) -> "LocalCluster":
        """Redis (if asked), the head with this process as its driver (``ray.init(address="local")``, as the
        tests' shared instance and loadtests/server.py start theirs), then the worker nodes."""
        import ray

        for k, v in {**self.env, "RAY_USAGE_STATS_ENABLED": "0"}.items():  # inherited by every node's processes
            self._setenv(k, v)
        extra = {}
        if self.use_redis:
            self.redis = Redis(self.temp_dir / "redis").start()
            # as `RAY_REDIS_ADDRESS=... ray start --head --redis-password ...` (KubeRay's GCS FT does the same)
            self._setenv("RAY_REDIS_ADDRESS", self.redis.address)
            self._setenv("RAY_external_storage_namespace", f"specedge-{os.getpid()}")
            extra["_redis_password"] = self.redis.password
        self._setenv("RAY_SERVE_WORKER_PROXY_HTTP_PORT", None)  # the head's proxy: http_port
        # the driver's own node: a driver cannot join a cluster bound to 127.0.0.1 from outside (ray.init turns
        # 127.0.0.1 into the machine's address), and traffic here stays on the loopback
        ray.init(address="local", num_cpus=self.cpus_per_node, resources={NODE_RESOURCE.format(0): 1},
                 include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _node_ip_address="127.0.0.1", _temp_dir=str(self.temp_dir), object_store_memory=self.object_store,
                 _system_config=dict(self.system_config), **extra)
        self.head = ray._private.worker._global_node
        self.nodes.append(NodeInfo(0, self.head, self.http_port))
        self._next_index = 1
        for _ in range(self.workers):
            self.add_worker()
        return self

    def add_worker(self, timeout_s: float = 120.0) -> NodeInfo:
        """A new worker node (its own raylet, CPUs, ``specedge_node_<i>`` and Serve proxy port), as
        ``ray.cluster_utils.Cluster.add_node`` starts one; returns once the GCS lists it alive."""
        import ray
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        i, port = self._next_index, free_port()
        self._next_index += 1
        params = RayParams(num_cpus=self.cpus_per_node, num_gpus=0, resources={NODE_RESOURCE.format(i): 1},
                           node_ip_address="127.0.0.1", object_store_memory=self.object_store,
                           min_worker_port=0, max_worker_port=0, redis_address=self.head.redis_address,
                           gcs_address=self.head.gcs_address, include_log_monitor=False, node_manager_port=0,
                           temp_dir=str(self.temp_dir),
                           redis_password=self.redis.password if self.redis else None)
        params.dashboard_agent_listen_port = None  # a free one (not the head agent's)
        self._setenv("RAY_SERVE_WORKER_PROXY_HTTP_PORT", str(port))  # read by the proxy this node starts
        try:
            node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
        finally:
            os.environ.pop("RAY_SERVE_WORKER_PROXY_HTTP_PORT", None)
        deadline = time.monotonic() + timeout_s
        while not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker node {i} did not register within {timeout_s:g} s")
            time.sleep(0.2)
        info = NodeInfo(i, node, port)
        self.nodes.append(info)
        return info

    def start_serve(self, **kw) -> None:
        from ray import serve

        serve.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": self.http_port}, **kw)

    def shutdown(self) -> None:
        """Stop every process this cluster started (by PID), Redis last; restore the environment."""
        try:
            import ray

            if ray.is_initialized():
                try:
                    from ray import serve

                    serve.shutdown()
                except Exception:  # noqa: BLE001 (a cluster torn down mid-test: stop the processes anyway)
                    pass
                ray.shutdown()
        finally:
            for n in self.nodes[1:]:  # the head's processes went with ray.shutdown()
                if n.killed_at is None:
                    for pid in _node_pids(n.node):
                        _kill_tree(pid)
                    try:
                        n.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
                    except Exception:  # noqa: BLE001
                        pass
            if self.redis is not None:
                self.redis.stop()
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    # -- faults ----------------------------------------------------------------------------------------------
    def alive_workers(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.index > 0 and n.killed_at is None]

    def kill_node(self, info: NodeInfo) -> dict:
        """SIGKILL a worker node: its raylet, every process under it (the replicas) and its other processes, at
        once. Returns what was killed."""
        if info.index == 0:
            raise ValueError("kill_node kills worker nodes; restart_gcs for the head's GCS")
        pids = []
        for pid in _node_pids(info.node):
            pids += _kill_tree(pid)
        info.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        info.killed_at, info.pids = time.time(), pids
        return {"node": info.index, "node_id": info.node_id, "killed_at": info.killed_at, "pids": len(pids)}

    def restart_gcs(self, down_s: float = 5.0) -> dict:
        """SIGKILL the head's ``gcs_server``, wait ``down_s``, start a new one on the same port (it loads the
        cluster's state from Redis). Needs the Redis (without it the cluster would not survive this)."""
        if self.redis is None:
            raise RuntimeError("restart_gcs needs GCS fault tolerance (LocalCluster(redis=True))")
        ev = self.kill_gcs()
        time.sleep(down_s)
        ev.update(self.start_gcs(), down_s=down_s)
        return ev

    def kill_gcs(self) -> dict:
        """SIGKILL the head's ``gcs_server`` (:meth:`start_gcs` brings it back)."""
        if self.redis is None:
            raise RuntimeError("kill_gcs needs GCS fault tolerance (LocalCluster(redis=True))")
        keys_before = self.redis.keys()
        t0 = time.time()
        self.head.kill_gcs_server()
        ev = {"killed_at": time.time(), "kill_s": time.time() - t0, "redis_keys_before": keys_before}
        self.gcs_restarts.append(ev)
        return ev

    def start_gcs(self) -> dict:
        """A new ``gcs_server`` on the killed one's port; it loads the cluster's tables from Redis."""
        self.head.start_gcs_server()
        ev = {"started_at": time.time(), "redis_keys_after": self.redis.keys()}
        self.gcs_restarts[-1].update(ev)
        return ev

    def gcs_pid(self) -> int | None:
        procs = self.head.all_processes.get("gcs_server") or []
        return procs[0].process.pid if procs else None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (Linux ``PR_SET_PDEATHSIG``), as
    Ray starts its own node processes: nothing outlives a driver that was killed."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _node_pids(node) -> list[int]:
    """PIDs of a node's own processes (raylet first, then agents, log monitor, ...)."""
    out = []
    for kind in sorted(node.all_processes, key=lambda k: k != "raylet"):
        for info in node.all_processes[kind]:
            if info.process is not None and info.process.poll() is None:
                out.append(info.process.pid)
    return out


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and its descendants together (children first collected, so none is re-parented away)."""
    pids = _descendants(pid) + [pid]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids
