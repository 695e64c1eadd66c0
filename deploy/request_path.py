"""Ray Serve's request-path options, as the environment a Ray cluster is started with.

Each hop and option: docs/protocol.md, "The request path through Ray Serve"."""

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
        """A stopping ingress replica's drain: ``drain_s`` if set, else 0 with direct ingress, Ray's 30 s otherwise."""
        if self.drain_s is not None:
            return self.drain_s
        return 0.0 if self.ingress is Ingress.direct else 30.0

    def override(self, ingress: str | None = None, throughput_optimized: bool | None = None) -> "RequestPathConfig":
        """This config with the options a command line gave (None: keep)."""
        given = {k: v for k, v in (("ingress", ingress), ("throughput_optimized", throughput_optimized))
                 if v is not None}
        return RequestPathConfig(**{**self.model_dump(), **given})

    def client_port(self, http_port: int) -> int:
        """Where clients connect: the ingress replica's own port (``direct``: one router replica), else Serve's."""
        return self.direct_port if self.ingress is Ingress.direct else http_port


def add_cli_options(ap) -> None:
    """``--ingress`` and ``--throughput-optimized`` for a launcher's parser (None: the config's; see ``override``)."""
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
