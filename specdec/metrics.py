"""Metric declarations and the ``prometheus_client`` exporter, shared by the edge agent and the
cloud (:mod:`deploy.metrics` declares the cloud's metrics and adds Ray Serve's exporter)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: ``name`` without the exporter's prefix (Ray adds ``ray_``)."""

    name: str
    kind: str  # "counter" | "histogram" | "gauge"
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    component: str = "verifier"  # "verifier" | "router" | "edge": who exports it

    def exposed(self, prefix: str = "ray_") -> str:
        """The name Prometheus sees (counters get ``_total``; histograms add ``_bucket/_sum/_count``)."""
        return prefix + self.name + ("_total" if self.kind == "counter" else "")


def never_raises(fn):
    """Metrics must never break serving: log the first failure of each method, then stay quiet."""
    failed = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            if not failed:
                failed.append(True)
                log.exception("metrics: %s failed (further failures are not logged)", fn.__qualname__)
            return None

    return wrapper



class Exporter(Protocol):
    def inc(self, name: str, value: float, labels: dict[str, str]) -> None: ...

    def observe(self, name: str, value: float, labels: dict[str, str]) -> None: ...

    def set(self, name: str, value: float, labels: dict[str, str]) -> None: ...


class PrometheusClientExporter:
    """``prometheus_client`` metrics in ``registry`` (a fresh one by default)."""

    def __init__(self, specs: Iterable[MetricSpec], registry=None):
        import prometheus_client as pc

        self.registry = registry if registry is not None else pc.CollectorRegistry()
        self._m: dict[str, Any] = {}
        for s in specs:
            if s.kind == "counter":  # prometheus_client appends _total itself
                m = pc.Counter(s.name, s.description, s.labels, registry=self.registry)
            elif s.kind == "histogram":
                m = pc.Histogram(s.name, s.description, s.labels, buckets=s.buckets, registry=self.registry)
            else:
                m = pc.Gauge(s.name, s.description, s.labels, registry=self.registry)
            self._m[s.name] = m
        self._children: dict[tuple, Any] = {}  # (name, label items) -> child: labels() validates each call

    def _child(self, name, labels):
        if not labels:
            return self._m[name]
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._m[name].labels(**labels)
        return child

    def inc(self, name, value, labels):
        self._child(name, labels).inc(value)

    def observe(self, name, value, labels):
        self._child(name, labels).observe(value)

    def set(self, name, value, labels):
        self._child(name, labels).set(value)
