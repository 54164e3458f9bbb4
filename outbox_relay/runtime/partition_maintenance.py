"""PartitionMaintenance: a running relay keeps its partitioned outbox maintained
([partitioning], db/partitions.py) every ``partitioning.maintain_interval_seconds``,
as ``outbox-relay maintain`` does from a CronJob. Replicas take turns through the
table's maintenance lock: a round that finds it held is skipped."""

from __future__ import annotations

import structlog

from ..core.service import PeriodicService
from ..db.partitions import PartitionLayout
from ..db.store import OutboxStore
from ..errors import ConfigError
from ..observability.metrics import RelayMetrics

log = structlog.get_logger("outbox_relay.partitions")


class PartitionMaintenance(PeriodicService):
    thread_name = "partition-maintenance"

    def __init__(
        self, store: OutboxStore, layout: PartitionLayout, metrics: RelayMetrics, *, interval_seconds: float
    ) -> None:
        super().__init__(interval_seconds, run_first=True)
        self._store = store
        self._layout = layout
        self._metrics = metrics

    def step(self) -> None:
        try:
            result = self._store.maintain_partitions(self._layout, sleep=self._stop.wait)
        except ConfigError as exc:  # [partitioning] set on a plain table: one line, not a traceback
            self._metrics.record_partition_maintenance(None)
            log.warning("partition maintenance skipped", reason=str(exc))
            return
        except Exception:
            self._metrics.record_partition_maintenance(None)
            raise  # logged by PeriodicService, the next round tries again
        self._metrics.record_partition_maintenance(result)
        if result.skipped:
            log.debug("partition maintenance skipped", reason=result.skipped)
            return
        fields = dict(
            partitions=result.partitions,
            created=result.created,
            dropped=result.dropped,
            kept=result.kept,
            default_rows=result.default_rows,
        )
        if result.failed:
            log.warning("partition maintenance: some changes failed", failed=result.failed, **fields)
        elif result.created or result.dropped or result.kept or result.default_rows:
            log.info("partition maintenance", **fields)
