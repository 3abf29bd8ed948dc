"""Prometheus metrics of kvstore-server, served over HTTP when ``metrics_port`` is set.

RPC counts and latency histograms are recorded as calls finish; store and tier
figures (hits, misses, evictions, corrupt records, bytes, usage) are read from
``TieredStore.stats()`` at scrape time, so they cost nothing between scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.engine.store import TieredStore
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.server.metrics")

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_TIER_COUNTERS = (
    "hits",
    "misses",
    "puts",
    "evictions",
    "corrupt",
    "errors",
    "rejected",
    "bytes_in",
    "bytes_out",
)
_STORE_COUNTERS = (
    "lookups",
    "lookup_tokens",
    "matched_tokens",
    "gets",
    "hits",
    "puts",
    "rejected_puts",
    "dropped",
    "drops_deferred",
    "write_failures",
)


class _StoreCollector(Collector):
    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._store.stats()
        except Exception:  # a scrape must never fail the endpoint
            log.exception("reading store stats for metrics failed")
            return
        for name in _TIER_COUNTERS:
            c = CounterMetricFamily(
                f"kvstore_tier_{name}", f"Tier {name.replace('_', ' ')}", labels=["tier"]
            )
            for t in s.tiers:
                c.add_metric([t.name], getattr(t, name))
            yield c
        gauges: dict[str, tuple[str, Any]] = {
            "used_bytes": ("Stored record bytes", lambda t: t.used_bytes),
            "capacity_bytes": ("Capacity in bytes", lambda t: t.capacity_bytes),
            "chunks": ("Chunks held", lambda t: t.chunks),
            "healthy": ("1 when the tier is healthy", lambda t: int(t.healthy)),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(f"kvstore_tier_{name}", doc, labels=["tier"])
            for t in s.tiers:
                g.add_metric([t.name], get(t))
            yield g
        for name in _STORE_COUNTERS:
            yield CounterMetricFamily(
                f"kvstore_store_{name}", f"Store {name.replace('_', ' ')}", value=getattr(s, name)
            )
        yield GaugeMetricFamily("kvstore_store_chunks", "Chunks in the index", value=s.chunks)
        yield GaugeMetricFamily("kvstore_store_namespaces", "Namespaces", value=s.namespaces)
        yield GaugeMetricFamily(
            "kvstore_store_pending_writes", "Queued write-downs", value=s.pending_writes
        )
        yield GaugeMetricFamily(
            "kvstore_store_pending_bytes", "Bytes of queued write-downs", value=s.pending_bytes
        )
        # Every figure of each tier's detail (refusals, forged records, the retry backlog,
        # internal reads, ...): a new counter in a tier reaches the metrics without a change here.
        g = GaugeMetricFamily(
            "kvstore_tier_detail", "A figure of the tier's Stats detail", labels=["tier", "name"]
        )
        for t in s.tiers:
            for key, value in sorted(t.detail.items()):
                if isinstance(value, int | float):  # bools too: degraded, verify_reads
                    g.add_metric([t.name, key], float(value))
        yield g
        detail = s.tiers[0].detail if s.tiers else {}
        for key in ("active_leases", "reservations", "pages_used", "pages_total"):
            value = detail.get(key)
            if isinstance(value, int):
                yield GaugeMetricFamily(f"kvstore_memory_{key}", f"L1 arena {key}", value=value)


class _FiguresCollector(Collector):
    """``kvstore_server_table{name=...}``: the server's own tables and limits (namespace
    descriptions kept, too large or forgotten; tenants' forgotten proofs; streams refused,
    cancelled as idle or too slow), read from ``figures()`` at each scrape, so a client
    filling a table or a flood of streams shows before anyone complains."""

    def __init__(self, figures: Callable[[], dict[str, float]]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvstore_server_table",
            "A figure of the server's tables and stream limits",
            labels=["name"],
        )
        for key, value in sorted(self._figures().items()):
            g.add_metric([key], float(value))
        yield g


class Metrics:
    """The server's metrics registry; ``start`` serves it at http://host:port/metrics."""

    def __init__(self, store: TieredStore) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counter(
            "kvstore_rpcs",
            "Finished RPCs by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvstore_rpc_latency_seconds",
            "RPC latency by method",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.payload = Counter(
            "kvstore_payload_bytes",
            "Chunk payload bytes moved, by plane",
            ["direction", "plane"],
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(store))
        self._http: Any = None

    def watch(self, figures: Callable[[], dict[str, float]]) -> None:
        """Export ``figures()`` (read at each scrape) as ``kvstore_server_table``."""
        self.registry.register(_FiguresCollector(figures))

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)

    def moved(self, direction: str, plane: str, nbytes: int) -> None:
        self.payload.labels(direction, plane).inc(nbytes)

    def start(self, host: str, port: int) -> None:
        try:
            self._http = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"metrics: cannot listen on {host}:{port}: {e}") from e
        log.info("metrics on http://%s:%d/metrics", host, port)

    def stop(self) -> None:
        if isinstance(self._http, tuple):  # prometheus_client >= 0.20: (server, thread)
            self._http[0].shutdown()
            self._http[0].server_close()
        self._http = None
