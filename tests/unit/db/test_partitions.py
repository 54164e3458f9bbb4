"""The pure rules of a partitioned outbox: partition widths, epoch-aligned ranges,
names, each partition's storage parameters, and the settings' one-line errors."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from outbox_relay.config import PartitioningSettings, load_settings, parse_partition_interval
from outbox_relay.db.partitions import (
    MaintenanceResult,
    partition_storage,
    partition_suffix,
    range_start,
    wanted_ranges,
)
from outbox_relay.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1 hour", 3600),
        ("6 hours", 6 * 3600),
        ("1 day", 86400),
        ("7 days", 7 * 86400),
        ("12h", 43200),
        ("1d", 86400),
        ("1 minute", 60),
        ("5 minutes", 300),
        ("15 min", 900),
        ("90 minutes", 5400),
        ("30m", 1800),
    ],
)
def test_partition_interval_of_whole_minutes_hours_or_days(text: str, seconds: int) -> None:
    assert parse_partition_interval(text) == seconds


@pytest.mark.parametrize("text", ["30 seconds", "1.5 hours", "0 days", "0 minutes", "1 week", "", "day", "5 mins ago"])
def test_other_partition_intervals_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="whole number of minutes, hours or days, at least 1 minute"):
        parse_partition_interval(text)


def test_a_bad_interval_in_the_settings_is_one_readable_line() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, partitioning={"interval": "90 seconds"})
    message = str(caught.value)
    assert "partitioning.interval" in message and "\n" not in message


def test_minute_partitions_must_be_made_ahead_for_two_maintenance_rounds() -> None:
    # 4 partitions of 1 minute ahead, maintenance every 300 s: rows would reach the
    # default partition between two rounds.
    with pytest.raises(ConfigError) as caught:
        load_settings(None, partitioning={"interval": "1 minute", "premake": 4})
    message = str(caught.value)
    assert "partitioning" in message and "raise premake or lower maintain_interval_seconds" in message
    assert "\n" not in message
    ok = load_settings(None, partitioning={"interval": "1 minute", "premake": 10, "maintain_interval_seconds": 30})
    assert ok.partitioning.interval_seconds == 60
    # A CronJob does the maintenance: its schedule is the operator's, not checked here.
    cron = load_settings(None, partitioning={"interval": "1 minute", "premake": 4, "maintain_in_relay": False})
    assert cron.partitioning.premake == 4


def test_partitioning_is_off_unless_an_interval_is_set() -> None:
    assert not PartitioningSettings().enabled
    on = PartitioningSettings(interval="1 day", retention="3d")
    assert on.enabled and on.interval_seconds == 86400 and on.retention_seconds == 3 * 86400


def test_ranges_are_aligned_to_the_epoch_in_utc_and_contiguous() -> None:
    now = datetime(2026, 12, 3, 13, 47, 12, tzinfo=UTC)
    assert range_start(now, 3600) == datetime(2026, 12, 3, 13, tzinfo=UTC)
    assert range_start(now, 86400) == datetime(2026, 12, 3, tzinfo=UTC)
    ranges = wanted_ranges(now, 3600, premake=3)
    assert len(ranges) == 4
    assert ranges[0] == (datetime(2026, 12, 3, 13, tzinfo=UTC), datetime(2026, 12, 3, 14, tzinfo=UTC))
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    # A zone other than UTC names the same instant, so the same partition.
    berlin = now.astimezone(ZoneInfo("Europe/Berlin"))
    assert range_start(berlin, 86400) == range_start(now, 86400)


def test_partition_names_follow_their_start() -> None:
    assert partition_suffix(datetime(2026, 12, 3, 7, tzinfo=UTC)) == "p2026120307"
    assert partition_suffix(datetime(2026, 12, 3, 7, tzinfo=UTC) + timedelta(days=1)) == "p2026120407"


def test_minute_partitions_are_aligned_and_named_to_the_minute_unique_and_sorted() -> None:
    now = datetime(2026, 12, 3, 13, 47, 12, tzinfo=UTC)
    assert range_start(now, 300) == datetime(2026, 12, 3, 13, 45, tzinfo=UTC)
    assert range_start(now, 60) == datetime(2026, 12, 3, 13, 47, tzinfo=UTC)
    assert partition_suffix(datetime(2026, 12, 3, 13, 45, tzinfo=UTC), 300) == "p202612031345"
    # Hour and day widths keep their names to the hour (tables made before keep theirs).
    assert partition_suffix(datetime(2026, 12, 3, 13, tzinfo=UTC), 7200) == "p2026120313"
    for width in (60, 300, 900, 5400, 7 * 60):
        ranges = wanted_ranges(now, width, premake=2 * 86400 // width)  # two days of them
        names = [partition_suffix(start, width) for start, _end in ranges]
        assert len(set(names)) == len(names) and names == sorted(names)
        assert all(
            start.second == 0 and (start - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() % width == 0
            for start, _end in ranges
        )
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_every_partition_gets_the_queue_fillfactor_and_autovacuum_values() -> None:
    storage = partition_storage({})
    assert storage["fillfactor"] == "50"
    assert storage["autovacuum_vacuum_scale_factor"] == "0"
    assert partition_storage({"autovacuum_vacuum_threshold": "5000"})["autovacuum_vacuum_threshold"] == "5000"


def test_a_round_is_ok_only_without_failures_and_says_what_it_did() -> None:
    result = MaintenanceResult(created=["outbox_p2026120314"], dropped=["outbox_p2026113013"], default_rows=2)
    assert result.ok
    lines = result.lines()
    assert "created partition outbox_p2026120314" in lines and "dropped partition outbox_p2026113013" in lines
    assert any("default partition holds 2 rows" in line for line in lines)
    result.failed.append("create outbox_p2026120315: lock not available")
    assert not result.ok and result.lines()[-2].startswith("FAILED:")
