"""OutboxStore: the statements of the outbox table, the only SQL the relay speaks to it.

Every method borrows a pooled connection for one short statement or transaction
and gives it back: no connection is held while a batch is being published.
psycopg errors are mapped to the project's own exceptions by ``_mapped``.

The store is cut by job, one class per module of this package, each on StoreCore
(store_core.py: the pool, lifecycle, error mapping, redaction, ping):
migrate_ops.py (schema, migrate, index convergence), delivery.py (claim, fenced
finalize, lease extension), monitoring.py (stats, exact counts, vacuum figures),
dead_rows.py (dead-letter operations, audit, row and aggregate detail),
replay_rows.py (what a replay of delivered rows reads), pauses.py (operator pauses),
retention.py (purge), partitions.py (a partitioned outbox's maintenance) and
wakeups.py (LISTEN/NOTIFY). This module combines them and
keeps every name callers import from it.
"""

from __future__ import annotations

from ..config import Settings
from ..model import Claimed as Claimed  # re-exported: callers that read claims import it from the store
from ..model import FinalizeItem as FinalizeItem  # re-exported with Claimed
from .dead_rows import DeadRowOps
from .dead_rows import DeadSummary as DeadSummary
from .delivery import CLAIM_SETTINGS as CLAIM_SETTINGS
from .delivery import FINALIZE_SETTINGS as FINALIZE_SETTINGS
from .delivery import GENERIC_FINALIZE_MAX_ROWS as GENERIC_FINALIZE_MAX_ROWS
from .delivery import ClaimResult as ClaimResult
from .delivery import DeliveryOps
from .delivery import Reschedule as Reschedule
from .delivery import finalize_params as finalize_params
from .migrate_ops import MIGRATE_NEEDS_DIRECT as MIGRATE_NEEDS_DIRECT
from .migrate_ops import MigrateOps
from .monitoring import BLOCKED_FROM_DEAD_ROWS as BLOCKED_FROM_DEAD_ROWS
from .monitoring import INDEXED_STATUSES as INDEXED_STATUSES
from .monitoring import STATUSES as STATUSES
from .monitoring import MonitoringOps
from .monitoring import PauseGauges as PauseGauges
from .monitoring import Stats as Stats
from .partitions import PartitionOps
from .pauses import PARKED_FROM as PARKED_FROM
from .pauses import ChunkStep as ChunkStep
from .pauses import PauseOps
from .pauses import PauseRow as PauseRow
from .replay_rows import ReplayOps
from .replay_rows import ReplayStep as ReplayStep
from .store_core import Count as Count
from .store_core import connect_failure_is_permanent as connect_failure_is_permanent
from .store_core import redact_dsn as redact_dsn
from .wakeups import Listener as Listener
from .wakeups import WakeupOps


class OutboxStore(MigrateOps, DeliveryOps, MonitoringOps, DeadRowOps, ReplayOps, PauseOps, PartitionOps, WakeupOps):
    """Statements on one outbox table over a connection pool (autocommit connections)."""


def make_store(
    settings: Settings, *, pool_size: int | None = None, application_name: str = "outbox-relay"
) -> OutboxStore:
    """The store of the outbox ``settings.database`` names, its pool not opened yet."""
    return OutboxStore(
        settings.database.dsn.get_secret_value(),
        settings.database.table,
        pool_size=pool_size or settings.pool_size,
        connect_timeout_seconds=settings.database.connect_timeout_seconds,
        statement_timeout_ms=settings.database.statement_timeout_ms,
        application_name=application_name,
        transaction_pooler=settings.database.transaction_pooler,
        listen_dsn=settings.database.listen_dsn.get_secret_value() if settings.database.listen_dsn else None,
        tcp_params=settings.database.tcp_params(),
        pool_max_idle_seconds=settings.database.pool_max_idle_seconds,
    )
