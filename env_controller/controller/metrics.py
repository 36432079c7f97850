"""Prometheus metrics of the controller, served at ``/metrics`` (one registry per controller).

Counters and histograms are updated on the request path, the busy ones in batches
(:class:`BatchedHistogram`, :class:`BatchedCounter`: plain numbers on the request path, folded into
the Prometheus series at each scrape and each tick of the controller's monitor); gauges (open sessions,
workers by state) are read from the controller's tables at scrape time.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: fine buckets for the controller's own time (target p99 < 10 ms)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1,
                    0.25, 1.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 240.0)


class _TableCollector(Collector):
    """Gauges computed from the controller's tables when scraped."""

    def __init__(
        self,
        sessions: Callable[[], dict[str, int]],
        workers: Callable[[], dict[tuple[str, str], int]],
    ) -> None:
        self._sessions = sessions
        self._workers = workers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """Yield the open-session and worker-state gauges."""
        sessions = GaugeMetricFamily("agentrl_controller_sessions_open", "Open sessions per task", labels=["task"])
        for task, count in sorted(self._sessions().items()):
            sessions.add_metric([task], count)
        yield sessions
        workers = GaugeMetricFamily(
            "agentrl_controller_workers", "Registered workers per task and state", labels=["task", "state"]
        )
        for (task, state), count in sorted(self._workers().items()):
            workers.add_metric([task, state], count)
        yield workers


class BatchedHistogram:
    """Observations for one Prometheus histogram child, kept as bucket counts and a sum until :meth:`flush`
    adds them to it (what the child's own ``observe`` does per call, with a lock, in one step).

    Only for use from one thread (the controller's event loop)."""

    __slots__ = ("child", "bounds", "counts", "total", "pending")

    def __init__(self, child: Any) -> None:
        """``child``: a labelled ``prometheus_client.Histogram`` (its bucket bounds end with +Inf)."""
        self.child = child
        self.bounds = list(child._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.pending = False

    def observe(self, amount: float) -> None:
        """Record one observation (as ``Histogram.observe``: the first bucket whose bound is >= it)."""
        i = bisect_left(self.bounds, amount)
        self.counts[min(i, len(self.counts) - 1)] += 1
        self.total += amount
        self.pending = True

    def flush(self) -> None:
        """Add what was recorded to the Prometheus child."""
        if not self.pending:
            return
        buckets = self.child._buckets
        for i, n in enumerate(self.counts):
            if n:
                buckets[i].inc(n)
                self.counts[i] = 0
        self.child._sum.inc(self.total)
        self.total = 0.0
        self.pending = False


class BatchedCounter:
    """Increments of one Prometheus counter child, added to it at :meth:`flush` (one thread only)."""

    __slots__ = ("child", "n")

    def __init__(self, child: Any) -> None:
        """``child``: a labelled ``prometheus_client.Counter``."""
        self.child = child
        self.n = 0

    def inc(self) -> None:
        """Count one."""
        self.n += 1

    def flush(self) -> None:
        """Add what was counted to the Prometheus child."""
        if self.n:
            self.child.inc(self.n)
            self.n = 0


class ControllerMetrics:
    """The controller's metrics in their own :class:`CollectorRegistry`."""

    def __init__(
        self,
        sessions: Callable[[], dict[str, int]],
        workers: Callable[[], dict[tuple[str, str], int]],
    ) -> None:
        """``sessions()``: open sessions per task; ``workers()``: workers per (task, state)."""
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "agentrl_controller_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"],
            registry=registry,
        )
        self.request_seconds = Histogram(
            "agentrl_controller_request_seconds", "Handler wall time by endpoint", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.overhead_seconds = Histogram(
            "agentrl_controller_overhead_seconds",
            "Controller time per start/interact, excluding the worker's own time",
            ["endpoint"], buckets=OVERHEAD_BUCKETS, registry=registry,
        )
        self.worker_call_seconds = Histogram(
            "agentrl_controller_worker_call_seconds", "Round trip of controller -> worker calls", ["api"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.sessions_started = Counter(
            "agentrl_controller_sessions_started", "Sessions started per task", ["task"], registry=registry
        )
        self.sessions_ended = Counter(
            "agentrl_controller_sessions_ended",
            "Sessions ended per task and final status",
            ["task", "status"],
            registry=registry,
        )
        self.heartbeats = Counter("agentrl_controller_heartbeats", "Heartbeats received", registry=registry)
        self.worker_deaths = Counter(
            "agentrl_controller_worker_deaths", "Workers declared dead per task", ["task"], registry=registry
        )
        self.worker_errors = Counter(
            "agentrl_controller_worker_errors", "Failed controller -> worker calls by kind", ["api", "kind"],
            registry=registry,
        )
        registry.register(_TableCollector(sessions, workers))
        self._batched: dict[tuple[Any, tuple[str, ...]], BatchedHistogram | BatchedCounter] = {}
        # label children looked up once (the hot path skips the labels() dict lookup)
        self.overhead_interact = self.histogram(self.overhead_seconds, "interact")
        self.overhead_start = self.histogram(self.overhead_seconds, "start_sample")

    def histogram(self, metric: Histogram, *labels: str) -> BatchedHistogram:
        """The batched child of ``metric`` for ``labels`` (made once, then the same object)."""
        return self._batched_child(BatchedHistogram, metric, labels)  # type: ignore[return-value]

    def counter(self, metric: Counter, *labels: str) -> BatchedCounter:
        """The batched child of ``metric`` for ``labels`` (made once, then the same object)."""
        return self._batched_child(BatchedCounter, metric, labels)  # type: ignore[return-value]

    def _batched_child(self, kind: type[BatchedHistogram | BatchedCounter], metric: Histogram | Counter,
                       labels: tuple[str, ...]) -> BatchedHistogram | BatchedCounter:
        key = (metric, labels)
        child = self._batched.get(key)
        if child is None:
            child = self._batched[key] = kind(metric.labels(*labels))  # type: ignore[arg-type]
        return child

    def flush(self) -> None:
        """Fold every batched observation into the Prometheus series."""
        for child in self._batched.values():
            child.flush()

    def render(self) -> bytes:
        """The text exposition format (batched observations folded in first)."""
        self.flush()
        return generate_latest(self.registry)
