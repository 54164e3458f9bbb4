"""The PostgreSQL side: connections and error mapping, the outbox table's SQL (``sql/``), claims,
finalize, monitoring and operator queries."""
