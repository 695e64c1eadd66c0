"""Shared fixtures: tiny random models, the embedded SmolLM2, one Ray instance per session.

``make test`` runs the suite on two pytest-xdist workers, each its own pytest session. Every
module that uses the session's Ray instance (``ray_session``) runs on one of them
(:func:`pytest_xdist_make_scheduler`), so phase 1 starts one Ray instance, not one per worker;
the other tests are spread over both workers as they free up. Tests that start a cluster of
their own (``serve run`` in a subprocess, the Locust and benchmark smoke runs) run beside them."""

from __future__ import annotations

import os
import socket

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one thread: on a shared 2-core machine two threads per test process thrash (10-40x slower)
torch.set_num_threads(int(os.environ.get("SPECEDGE_TEST_THREADS", "1")))
# without a GPU the CUDA path's Triton kernels run under Triton's interpreter (tests/specdec/model/interpreted.py);
# Triton reads this when it is imported, so it is set before any test imports it
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_xdist_make_scheduler(config, log):
    """With ``-n`` (xdist's ``load``): the modules that use ``ray_session`` form one unit of work,
    run by one worker in collection order; every other test is its own unit. An idle Ray instance
    with one app costs ~12 % of a core here, and pytest 9 ignores xdist's own ``xdist_group``
    marker (xdist 3.8 renames ``item._nodeid``, which pytest 9 no longer reads)."""
    if config.getvalue("dist") != "load":
        return None
    from pathlib import Path

    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)
    ray_modules = {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")
                   if "ray_session" in p.read_text()}

    class OneRayWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray_session" if module in ray_modules else nodeid

    return OneRayWorker(config, log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model():
    from specdec.model.loading import tiny_random_model

    return tiny_random_model(seed=0)


@pytest.fixture(scope="session")
def embedded():
    """The real SmolLM2-135M-Instruct in fp32 (exact greedy comparisons need fp32)."""
    from specdec.model.loading import load_model

    return load_model("embedded", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (never attaches to `ray start`)."""
    import ray
    from ray import serve

    from deploy.request_path import RequestPathConfig

    # Serve's controller period and metrics export as a deployment has them (deploy/request_path.py), and Ray's
    # metrics report every 2 s: an idle Ray instance with one app took 12 % of a core here instead of 20 %, and
    # each xdist worker runs one all session. Requests still reach the apps through Serve's HTTP proxy
    env = RequestPathConfig().env()
    for k in ("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"):
        os.environ.setdefault(k, env[k])
    metrics_port = free_port()  # Ray's Prometheus export port (tests/test_prometheus_integration.py scrapes it)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             configure_logging=False, _metrics_export_port=metrics_port,
             # Workers at nice 0, not Ray's default 15: at 15 the Serve proxy, router and verifier replicas get
             # ~3 % of a core whenever a nice-0 process wants it (the test's own clients, the other xdist
             # worker's torch tests): a likely part of why a CI deploy missed Ray's 60 s. benchmarks/ and
             # loadtests/ run theirs at 0 for the same reason
             _system_config={"metrics_report_interval_ms": 2000, "worker_niceness": 0})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield {"http_port": port, "metrics_port": metrics_port}
    serve.shutdown()
    ray.shutdown()
