"""Pure building blocks of the relay: decisions, ordering, backoff, budgets, the circuit
breaker, message formats and dead-row filters. Nothing here talks to PostgreSQL or a broker."""
