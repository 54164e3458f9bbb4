"""[sources.<name>] and [discovery]: loading, per-source overrides, name resolution for
--source, secrets; the scheduler's round-robin, idle and failure rules; and which
families a process of several sources shows per source."""

from __future__ import annotations

import pytest

from outbox_relay.config import load_settings
from outbox_relay.errors import ConfigError
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.observability.sources_metrics import PER_SOURCE_FAMILIES, SourcesMetrics
from outbox_relay.runtime.scheduler import SourceScheduler
from outbox_relay.sources import settings_for, source_settings, static_sources, uses_sources


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("OUTBOX_RELAY_"):
            monkeypatch.delenv(key)


def test_sources_from_environment_with_overrides(monkeypatch):
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_A__DSN", "postgresql://u:sekret@db-a/app")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_A__TOPIC_TEMPLATE", "a.{aggregate_type}")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__DSN", "postgresql://u@db-b/app")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__TABLE", "events.outbox")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__ON_DONE", "delete")
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__TENANT_B__ORDERED_EVENT_TYPES", '["*"]')
    monkeypatch.setenv("OUTBOX_RELAY_RELAY__MAX_ATTEMPTS", "7")
    settings = load_settings()
    assert uses_sources(settings)
    sources = static_sources(settings)
    assert sorted(sources) == ["tenant_a", "tenant_b"]
    a, b = sources["tenant_a"], sources["tenant_b"]
    assert a.database.dsn.get_secret_value() == "postgresql://u:sekret@db-a/app"
    assert a.kafka.topic_template == "a.{aggregate_type}" and a.relay.on_done == "keep"
    assert b.database.table == "events.outbox" and b.relay.on_done == "delete"
    assert b.relay.ordered_event_types == ["*"] and b.kafka.topic_template == "outbox.{aggregate_type}"
    assert a.relay.max_attempts == b.relay.max_attempts == 7  # process-wide value inherited
    assert "sekret" in settings.secret_values
    assert "sekret" not in repr(settings)


def test_without_sources_the_database_section_is_the_default_source():
    settings = load_settings(None, database={"dsn": "postgresql://u@h/db", "table": "app.outbox"})
    assert not uses_sources(settings)
    assert list(static_sources(settings)) == ["default"]
    assert source_settings(settings, None) is settings
    assert source_settings(settings, "default").database.table == "app.outbox"
    with pytest.raises(ConfigError, match="--source other: no such source"):
        source_settings(settings, "other")


def test_several_sources_need_a_name_on_the_command_line():
    settings = load_settings(None, sources={"a": {"dsn": "postgresql://h/a"}, "b": {"dsn": "postgresql://h/b"}})
    with pytest.raises(ConfigError, match="name one with --source NAME"):
        source_settings(settings, None)
    assert source_settings(settings, "b").database.dsn.get_secret_value() == "postgresql://h/b"
    one = load_settings(None, sources={"only": {"dsn": "postgresql://h/a", "max_attempts": 3}})
    assert source_settings(one, None).relay.max_attempts == 3


def test_unknown_source_setting_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("OUTBOX_RELAY_SOURCES__A__DNS", "postgresql://h/a")
    with pytest.raises(ConfigError, match=r"OUTBOX_RELAY_SOURCES__A__DNS.*did you mean OUTBOX_RELAY_SOURCES__A__DSN"):
        load_settings()


def test_bad_source_values_name_the_setting_and_hide_the_dsn():
    with pytest.raises(ConfigError, match=r"sources\.a\.table"):
        load_settings(None, sources={"a": {"dsn": "postgresql://h/a", "table": "bad;name"}})
    with pytest.raises(ConfigError, match=r"sources\.a\.dsn") as info:
        load_settings(None, sources={"a": {"dsn": "host=h password='unterminated"}})
    assert "unterminated" not in str(info.value)
    with pytest.raises(ConfigError, match=r"sources\.a\.dsn.*(missing|required)"):
        load_settings(None, sources={"a": {"table": "outbox"}})
    with pytest.raises(ConfigError, match="invalid source name"):
        load_settings(None, sources={"a b": {"dsn": "postgresql://h/a"}})


def test_a_source_lease_must_outlast_the_shared_producer_timeout():
    with pytest.raises(ConfigError, match=r"sources\.a\.lease_seconds \(5\) must be above"):
        load_settings(
            None,
            relay={"lease_seconds": 30},
            kafka={"delivery_timeout_seconds": 10},
            sources={"a": {"dsn": "postgresql://h/a", "lease_seconds": 5}},
        )


def test_discovered_source_takes_the_discovery_dsn_with_its_database_name():
    from outbox_relay.sources import discovered_source

    settings = load_settings(
        None,
        discovery={
            "dsn": "postgresql://u:pw@cluster:5433/postgres",
            "database_pattern": "tenant_%",
            "table": "app.outbox",
        },
    )
    assert uses_sources(settings) and static_sources(settings) == {}
    source = settings_for(settings, discovered_source(settings, "tenant_42"))
    import psycopg

    params = psycopg.conninfo.conninfo_to_dict(source.database.dsn.get_secret_value())
    assert params["dbname"] == "tenant_42" and params["host"] == "cluster" and params["port"] == "5433"
    assert source.database.table == "app.outbox"
    assert "pw" in settings.secret_values


# --- the scheduler ---------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_due_sources_are_taken_round_robin_and_a_busy_one_keeps_idle_workers():
    s = SourceScheduler(clock=Clock())
    for name in ("busy", "quiet"):
        s.add(name)
    s.probes_due()
    s.probed("busy", has_work=True)
    assert [s.next_due(0)[0] for _ in range(3)] == ["busy", "busy", "busy"]  # alone: every worker takes it
    s.probed("quiet", has_work=True)
    picks = [s.next_due(0)[0] for _ in range(4)]
    # Just due, never claimed since: taken by the next worker, then round-robin.
    assert picks == ["quiet", "busy", "quiet", "busy"]


def test_a_short_claim_makes_a_source_idle_unless_it_was_marked_due_again():
    clock = Clock()
    s = SourceScheduler(clock=clock, probe_min_seconds=0.1, probe_max_seconds=1.0)
    s.add("a")
    s.probes_due()
    s.probed("a", has_work=True)
    _name, epoch = s.next_due(0)
    s.mark_due(["a"])  # a newer signal arrives while the claim runs
    s.claimed("a", epoch, rows=3, batch_size=100)
    assert s.due_count() == 1
    _name, epoch = s.next_due(0)
    s.claimed("a", epoch, rows=3, batch_size=100)
    assert s.due_count() == 0 and s.next_due(0) is None
    # Idle: probed again after probe_min, then backing off to probe_max.
    assert s.probes_due() == []
    clock.now += 0.1
    assert s.probes_due() == ["a"]
    delays = []
    for _ in range(6):
        s.probed("a", has_work=False)
        delays.append(s.state("a").probe_delay)
        clock.now += 5
        assert s.probes_due() == ["a"]
    assert delays[0] == 0.2 and delays[-1] == 1.0


def test_a_failing_source_leaves_the_ring_and_backs_off_alone():
    clock = Clock()
    s = SourceScheduler(clock=clock, error_cap_seconds=30)
    s.add("down")
    s.add("up")
    s.probes_due()
    s.probed("up", has_work=True)
    s.probed("down", has_work=True)
    name, _epoch = s.next_due(0)
    assert name == "up"
    name, _epoch = s.next_due(0)
    assert name == "down"
    delay = s.failed("down", "connection refused")
    assert 0.1 <= delay <= 30.1
    assert not s.state("down").ready and s.state("up").ready
    assert [s.next_due(0)[0] for _ in range(3)] == ["up", "up", "up"]
    s.mark_due(["down"])  # no signal brings a failing source back before its probe
    assert s.due_count() == 1
    clock.now += 31
    assert s.probes_due() == ["down"]
    s.probed("down", has_work=True)
    assert s.state("down").ready and s.due_count() == 2


def test_a_retired_source_is_never_handed_out_and_its_batches_are_awaited():
    s = SourceScheduler(clock=Clock())
    s.add("gone")
    s.probes_due()
    s.probed("gone", has_work=True)
    _name, _ = s.next_due(0)
    state = s.retire("gone")
    assert state is not None and s.next_due(0) is None
    assert state.active == 1
    s.done("gone")  # by name, as a worker finishing the batch does
    assert s.wait_inactive("gone", state, timeout=0)


def test_the_fresh_lane_takes_only_just_due_sources_and_active_sources_are_probed_sooner():
    clock = Clock()
    s = SourceScheduler(clock=clock, probe_min_seconds=0.05, probe_max_seconds=1.0)
    for name in ("busy", "quiet"):
        s.add(name)
    s.probes_due()
    s.probed("busy", has_work=True)
    assert s.next_due(0)[0] == "busy"  # claimed since: no longer fresh
    assert s.next_fresh(0) is None
    s.probed("quiet", has_work=True)
    name, epoch = s.next_fresh(0)
    assert name == "quiet" and s.next_fresh(0) is None
    s.claimed("quiet", epoch, rows=1, batch_size=100)  # a short claim with a row: idle, recently active
    delays = []
    for _ in range(5):
        clock.now += 1.5
        assert s.probes_due() == ["quiet"]
        s.probed("quiet", has_work=False)
        delays.append(s.state("quiet").probe_delay)
    assert delays == [0.1, 0.2, 0.25, 0.25, 0.25]  # a quarter of probe_max while recently active
    clock.now += 10
    s.probes_due()
    s.probed("quiet", has_work=False)
    assert s.state("quiet").probe_delay == 0.5  # quiet for long: the full back-off again


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
