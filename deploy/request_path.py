"""Ray Serve's request-path options, as the environment a Ray cluster is started with.

Where an edge's verify round spends server CPU before it reaches the verifier
(``benchmarks/request_path.py`` measures each hop): Serve's HTTP proxy actor parses the
request and forwards it to the router replica over a Ray actor call, the router calls the
verifier over another. Ray Serve 2.60 can take hops out:

- ``proxy`` (Serve's default): clients -> proxy actor -> router replica -> verifier.
- ``direct``: the router replica (the ingress) serves HTTP/WebSocket itself on a port of
  its own (``RAY_SERVE_ENABLE_DIRECT_INGRESS``); clients skip the proxy. The proxy still
  runs on ``http_options.port`` for anything else.
- ``haproxy``: Serve runs HAProxy (Debian's ``haproxy``) on ``http_options.port`` in front of
  the ingress replicas' own ports, in place of the Python proxy (``RAY_SERVE_ENABLE_HA_PROXY``);
  it spreads clients over router replicas, as a Kubernetes Service would.

``throughput_optimized`` (``RAY_SERVE_THROUGHPUT_OPTIMIZED``) adds Serve's own bundle: gRPC
instead of Ray object transfers between replicas, user code on the replica's event loop,
buffered request logs, GC frozen after start-up, and direct ingress.

``control_loop_s`` (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``) is not on the request path but is
paid by the same server: Serve's controller reconciles every 0.1 s by default, which costs an
idle one-core server ~35 ms of CPU per second in the controller and GCS. At 0.5 s the idle
server (every Ray/Serve process of the benchmark app) fell from 121 to 92 ms of CPU per
second (measured with every process pinned to one core); the price is that a dead replica is
noticed and replaced up to 0.4 s later. ``metrics_export_ms``
(``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS``): each replica hands Serve's own request metrics to Ray
every 100 ms by default; at 1000 ms the idle benchmark app fell from 77 to 64 ms of CPU per second
(20 s each, same pinning), and Prometheus, scraping every few seconds, sees no difference. The
project's own metrics (:mod:`deploy.metrics`) are recorded as they happen either way.

``drain_s`` (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``): a stopping ingress replica
keeps serving for this long so that a balancer in front of it can deregister it, then finishes
its in-flight requests. Ray's 30 s fits ``haproxy``; with ``direct`` nothing is in front, and
the 30 s only delayed every stop (``serve run``'s Ctrl-C took 33 s instead of 7; an in-flight
request still completes), so the default there is 0.

These are read when Ray's processes import Serve, so they must be in the environment of
the process that starts Ray (``ray start`` / ``ray.init``) — the Helm chart puts them in the
Ray containers' env, the launchers here (:mod:`loadtests.server`, :mod:`deploy.demo`) pass
:func:`serve_env` to their child. Session affinity is unaffected: it is the router's handle
to the verifier that pins a session to its replica (:mod:`deploy.router.affinity`), whatever
carried the request to the router.
"""

from __future__ import annotations

import shutil
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Ingress(str, Enum):
    proxy = "proxy"
    direct = "direct"
    haproxy = "haproxy"


class RequestPathConfig(BaseModel):
    """How requests reach the router replicas (cluster-wide: applied when Ray starts)."""

    model_config = ConfigDict(extra="forbid")

    ingress: Ingress = Field(Ingress.direct, description="proxy | direct | haproxy (see deploy/request_path.py)")
    throughput_optimized: bool = Field(True, description="RAY_SERVE_THROUGHPUT_OPTIMIZED: gRPC between replicas, "
                                                         "user code on the event loop, buffered logs")
    control_loop_s: float = Field(0.5, gt=0, le=10,
                                  description="RAY_SERVE_CONTROL_LOOP_INTERVAL_S: Serve's controller loop period")
    metrics_export_ms: int = Field(1000, ge=0, le=60000,
                                   description="RAY_SERVE_METRICS_EXPORT_INTERVAL_MS: how often each replica exports "
                                               "Serve's own request metrics (Serve's default 100; 0 = unbatched)")
    direct_port: int = Field(30000, ge=1024, le=65000,
                             description="first port of the ingress replicas' own HTTP servers (one per replica)")
    drain_s: float | None = Field(None, ge=0, le=600,
                                  description="RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S: how long a stopping "
                                              "ingress replica keeps serving so that a balancer in front of it can "
                                              "deregister it; default: 0 with direct ingress (nothing in front), "
                                              "Ray's 30 s behind haproxy")

    @model_validator(mode="after")
    def _check(self):
        if self.ingress is Ingress.haproxy and shutil.which("haproxy") is None:
            raise ValueError("ingress: haproxy needs the haproxy binary on PATH (Debian: apt-get install haproxy)")
        return self

    def env(self) -> dict[str, str]:
        """The environment variables for the process that starts Ray."""
        env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1" if self.throughput_optimized else "0",
               "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0" if self.ingress is Ingress.proxy else "1",
               "RAY_SERVE_ENABLE_HA_PROXY": "1" if self.ingress is Ingress.haproxy else "0",
               "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": str(self.control_loop_s),
               "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": str(self.metrics_export_ms),
               "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(self.direct_port),
               "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(self.direct_port + 1000),
               "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(self.direct_port + 1000),
               "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(self.direct_port + 2000)}
        if self.ingress is not Ingress.proxy:
            env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(self.drain_period_s)
        return env

    @property
    def drain_period_s(self) -> float:
        """A stopping ingress replica's drain: with direct ingress clients connect to the replica
        itself and no balancer has to deregister it, so Ray's 30 s only delayed every stop
        (`serve run`'s Ctrl-C, the demo's) by 30 s."""
        if self.drain_s is not None:
            return self.drain_s
        return 0.0 if self.ingress is Ingress.direct else 30.0

    def override(self, ingress: str | None = None, throughput_optimized: bool | None = None) -> "RequestPathConfig":
        """This config with the options a command line gave (None: keep)."""
        given = {k: v for k, v in (("ingress", ingress), ("throughput_optimized", throughput_optimized))
                 if v is not None}
        return RequestPathConfig(**{**self.model_dump(), **given})

    def client_port(self, http_port: int) -> int:
        """Where clients connect: the first ingress replica's own port in ``direct`` mode
        (one router replica; more need a balancer, i.e. ``haproxy``), else Serve's HTTP port."""
        return self.direct_port if self.ingress is Ingress.direct else http_port


def add_cli_options(ap) -> None:
    """``--ingress`` and ``--throughput-optimized`` for a launcher's argparse parser (None = the
    config's own value; apply with :meth:`RequestPathConfig.override`)."""
    import argparse

    ap.add_argument("--ingress", choices=[m.value for m in Ingress], default=None,
                    help="how requests reach the router (deploy/request_path.py; default: the config's, direct)")
    ap.add_argument("--throughput-optimized", action=argparse.BooleanOptionalAction, default=None,
                    help="RAY_SERVE_THROUGHPUT_OPTIMIZED on/off (default: the config's, on)")


def main(argv=None) -> int:
    """``eval "$(python -m deploy.request_path [--ingress I] [--no-throughput-optimized])"`` before
    ``serve run`` / ``ray start``: prints the environment as ``export`` lines."""
    import argparse
    import shlex

    ap = argparse.ArgumentParser(description=main.__doc__)
    add_cli_options(ap)
    args = ap.parse_args(argv)
    for k, v in RequestPathConfig().override(args.ingress, args.throughput_optimized).env().items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
