"""RetentionOps: purging done rows and the dedup keys whose rows are gone, chunk by chunk."""

from __future__ import annotations

from .store_core import StoreCore


class RetentionOps(StoreCore):
    # --- retention -------------------------------------------------------------------
    def count_purgeable(self, older_than_seconds: float) -> int:
        with self._mapped("purge"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("count_purgeable"), {"older_than_seconds": float(older_than_seconds)}
            ).fetchone()
            return int(row[0]) if row else 0

    def purge_chunk(self, older_than_seconds: float, limit: int, after: int = 0) -> tuple[int, int | None]:
        """Delete the done rows older than the cutoff among the next ``limit`` rows by
        id after ``after``. Returns (rows deleted, where the next chunk starts), the
        latter None once no row further on can be old enough (see purge_chunk)."""
        with self._mapped("purge"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("purge_chunk"),
                {"older_than_seconds": float(older_than_seconds), "limit": limit, "after": after},
            ).fetchone()
        deleted, last_id, old_rows = (int(row[0]), row[1], int(row[2])) if row else (0, None, 0)
        return deleted, (int(last_id) if last_id is not None and old_rows > 0 else None)

    def purge_dedup_keys_chunk(self, older_than_seconds: float, limit: int, after: str = "") -> tuple[int, str | None]:
        """Delete dedup keys older than the cutoff whose row is gone, among the next
        ``limit`` keys after ``after``. Returns (keys deleted, next start or None at the end)."""
        with self._mapped("purge"), self._pool.connection() as conn:
            row = conn.execute(
                self.sql.query("purge_dedup_keys_chunk"),
                {"older_than_seconds": float(older_than_seconds), "limit": limit, "after": after},
            ).fetchone()
        deleted, last_key = (int(row[0]), row[1]) if row else (0, None)
        return deleted, (str(last_key) if last_key is not None else None)
