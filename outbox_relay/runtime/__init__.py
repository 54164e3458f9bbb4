"""The daemon: the process shell serving one source or many, its workers, the submit
thread, the fenced finalize, the lease keeper and wake-ups.

One word per concept (code, logs and docs use these and no other):

- **source**: one outbox table the process serves (``[database]`` is the one source
  of a single-outbox relay; ``[sources.<name>]`` and discovered databases are many).
- **process shell** (``shell.RelayShell``): what a relay process does the same for one
  source (``relay.Relay``) or many (``multi.MultiRelay``): publisher, tracing, metrics
  server, breaker, byte budget, readiness, stop sequence, signals.
- **claimed batch** (``worker.ClaimedBatch``): a batch a worker claimed and is
  delivering; its state goes claimed -> started -> finished (``Worker.claim_batch``,
  ``start_batch``, ``finish_batch``, the steps every loop drives).
- **lease keeper** (``lease_keeper.LeaseKeeper``): extends the leases of claimed
  batches whose delivery runs long; **leased batch** (``lease_keeper.LeasedBatch``)
  is its record of one claimed batch. Its setting: ``relay.lease_extend_after_fraction``.
- **finalizer** (``finalizer.Finalizer``): writes a batch's decisions with fencing.
- **pending batch** (``publishers.base.PendingBatch``; Kafka's ``KafkaPendingBatch``):
  a publisher's messages submitted and waiting for their outcomes.
- **byte budget** (``core.budget.ByteBudget``): the bytes of claimed rows the process
  holds at most (``relay.max_in_flight_bytes``).
"""
