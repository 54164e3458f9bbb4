"""A process of several sources shows each per-outbox family per source, and a name
filter narrows the samples."""

from __future__ import annotations

from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.observability.sources_metrics import PER_SOURCE_FAMILIES, SourcesMetrics


def test_every_per_outbox_family_is_shown_per_source_and_name_filters_samples():
    metrics = SourcesMetrics()
    a, b = RelayMetrics(), RelayMetrics()
    metrics.add_source("a", a)
    metrics.add_source("b", b)
    a.published_total.labels(outcome="done").inc(3)
    b.queue_depth.labels(status="pending").set(7)

    families = {family.name: family for family in metrics.collect_all()}
    assert PER_SOURCE_FAMILIES <= set(families)  # read from each source's registry
    published = {
        (s.labels["source"], s.labels["outcome"]): s.value
        for s in families["outbox_relay_published"].samples
        if s.name == "outbox_relay_published_total"
    }
    assert published[("a", "done")] == 3 and published[("b", "done")] == 0

    narrow = metrics.render(["outbox_relay_published_total", "outbox_relay_queue_depth"]).decode()
    lines = [line for line in narrow.splitlines() if not line.startswith("#")]
    assert {line.split("{")[0] for line in lines} == {"outbox_relay_published_total", "outbox_relay_queue_depth"}
    assert 'outbox_relay_published_total{outcome="done",source="a"} 3.0' in lines
    assert 'outbox_relay_queue_depth{source="b",status="pending"} 7.0' in lines

    metrics.remove_source("a")
    assert 'source="a"' not in metrics.render().decode()
