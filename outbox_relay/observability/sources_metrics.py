"""The metrics of a process serving many sources: the process's own families, and each
source's per-outbox families labelled ``source=NAME`` (``SourcesMetrics``)."""

from __future__ import annotations

import threading
from collections.abc import Collection
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase

from .metrics import RelayMetrics

# Metric families that describe one outbox: exposed once per source, labelled source=NAME.
PER_SOURCE_FAMILIES = frozenset(
    {
        "outbox_relay_oldest_pending_age_seconds",
        "outbox_relay_expired_leases",
        "outbox_relay_queue_depth",
        "outbox_relay_attempts",
        "outbox_relay_blocked_aggregates",
        "outbox_relay_operator_pauses",
        "outbox_relay_paused_rows",
        "outbox_relay_lost_leases",
        "outbox_relay_published",
        "outbox_relay_reaped",
        "outbox_relay_released",
        "outbox_relay_stats_refresh_errors",
        "outbox_relay_claim_batch_size",
        "outbox_relay_publish_latency_seconds",
        "outbox_relay_statements",
        # MVCC pressure of each source's table (what holds its vacuum back, how vacuum keeps up)
        "outbox_relay_xmin_horizon_age_seconds",
        "outbox_relay_dead_tuples",
        "outbox_relay_table_size_bytes",
        "outbox_relay_last_vacuum_age_seconds",
    }
)


class SourcesMetrics(RelayMetrics):
    """The process's metrics; per-outbox families come from each source's own registry,
    with a ``source`` label, so every source's series are counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[str, RelayMetrics] = {}
        #: Per source, the collectors of its per-outbox families (with the family's name).
        self._collectors: dict[str, list[tuple[str, MetricWrapperBase]]] = {}
        self._sources_lock = threading.Lock()
        self.source_up = Gauge(
            "outbox_relay_source_up",
            "1 while the source's database answers and its table is usable.",
            ["source"],
            registry=self.registry,
        )
        self.sources_due = Gauge(
            "outbox_relay_sources_due", "Sources with claimable rows waiting for a worker.", registry=self.registry
        )

    def add_source(self, name: str, metrics: RelayMetrics) -> None:
        # Only the per-outbox families are read from a source's registry: the rest of
        # it (process-wide families, registered by every RelayMetrics) is never shown,
        # and collecting it for every source made a scrape of 50 sources cost ~80 ms.
        collectors = [
            (family.name, collector)
            for collector in vars(metrics).values()
            if isinstance(collector, MetricWrapperBase)
            for family in collector.describe()
            if family.name in PER_SOURCE_FAMILIES
        ]
        with self._sources_lock:
            self.sources[name] = metrics
            self._collectors[name] = collectors
        self.source_up.labels(source=name).set(0)

    def remove_source(self, name: str) -> None:
        with self._sources_lock:
            self.sources.pop(name, None)
            self._collectors.pop(name, None)
        try:
            self.source_up.remove(name)
        except KeyError:
            pass

    def collect_all(self, names: Collection[str] | None = None) -> list[Metric]:
        """The process's families and every source's per-outbox ones (labelled
        source=NAME); with ``names`` only the samples of those names."""
        families: dict[str, Metric] = {}
        out: list[Metric] = []
        own = self.registry if names is None else self.registry.restricted_registry(names)
        for family in own.collect():
            if family.name not in PER_SOURCE_FAMILIES:
                out.append(family)
        wanted = None if names is None else set(names)
        with self._sources_lock:
            sources = sorted(self._collectors.items())
        for name, collectors in sources:
            for family_name, collector in collectors:
                if wanted is not None and not any(n.startswith(family_name) for n in wanted):
                    continue
                for family in collector.collect():
                    merged = families.get(family.name)
                    if merged is None:
                        merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                        merged.unit = family.unit
                    for sample in family.samples:
                        if wanted is None or sample.name in wanted:
                            merged.add_sample(
                                sample.name,
                                dict(sample.labels, source=name),
                                sample.value,
                                sample.timestamp,
                                sample.exemplar,
                            )
        out.extend(family for family in families.values() if family.samples or wanted is None)
        return out

    def render(self, names: Collection[str] | None = None) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected(partial(self.collect_all, names)))
        return generate_latest(registry)


class _Collected:
    def __init__(self, collect: Any) -> None:
        self.collect = collect
