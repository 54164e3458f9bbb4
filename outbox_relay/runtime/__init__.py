"""The daemon: the relay process, its workers, the submit thread, the fenced finalize,
lease heartbeats and wake-ups."""
