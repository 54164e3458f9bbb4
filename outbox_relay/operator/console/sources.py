"""The outboxes one console serves, by name.

A console started without ``--source`` on a configuration with ``[sources.<name>]`` or
``[discovery]`` serves every source: each page and API call names its source with
``?source=NAME`` (the overview without one lists them all). Otherwise it serves one
source (today's ``[database]``, named ``default``, or the one ``--source`` named) and
``?source=`` is optional.

A source's store is opened on first use (one connection attempt, failing at once for
a database that is down), with a small pool bounded by the console's statement
timeout; a discovered database is looked up in the cluster's list, which is read
again at most every ``discovery.refresh_interval_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...config import Settings
from ...core.ordering import OrderingRule
from ...db.store import OutboxStore
from ...db.vacuum_health import HorizonClock
from ...errors import DatabaseError
from ...source_config import DEFAULT_SOURCE
from ...sources import discovered_source, list_databases, settings_for, uses_sources

StoreFactory = Callable[[Settings], OutboxStore]


class SourceNotNamed(Exception):
    """The console serves several sources and the request named none."""


class SourceUnknown(Exception):
    """The request named a source the console does not serve."""


@dataclass
class ConsoleSource:
    """One outbox as the console sees it: its settings, its store and what the pages
    derive from them."""

    name: str
    settings: Settings
    store: OutboxStore
    ordered_types: list[str] = field(init=False)
    ordering: OrderingRule = field(init=False)
    # A slot records no time: the console counts from when it first saw one (a lower bound).
    horizon_clock: HorizonClock = field(default_factory=HorizonClock)

    def __post_init__(self) -> None:
        self.ordered_types = list(self.settings.relay.ordered_event_types)
        self.ordering = OrderingRule.of(self.ordered_types)

    @property
    def table(self) -> str:
        return self.settings.database.table


class ConsoleSources:
    """Resolves ``?source=NAME`` to a ``ConsoleSource``; blocking (opens pools, lists
    databases): call it off the event loop."""

    def __init__(
        self,
        settings: Settings,
        *,
        store: OutboxStore | None = None,
        name: str | None = None,
        store_factory: StoreFactory | None = None,
    ) -> None:
        self.settings = settings
        #: Several sources (each request names one) or exactly one.
        self.multi = store is None and uses_sources(settings)
        self._lock = threading.Lock()
        self._open: dict[str, ConsoleSource] = {}
        self._store_factory = store_factory
        self._listed: tuple[float, list[str]] | None = None
        if not self.multi:
            if store is None:
                raise ValueError("a single-source console needs its store")
            self.single = ConsoleSource(name or DEFAULT_SOURCE, settings, store)
            self._open[self.single.name] = self.single

    def names(self) -> list[str]:
        """Every source's name, sorted (static ones, then the discovered databases)."""
        if not self.multi:
            return [self.single.name]
        # The names only: building every static source's settings on each request
        # costs milliseconds per hundred sources.
        found = set(self.settings.sources)
        if self.settings.discovery.enabled:
            found.update(self._discovered())
        return sorted(found)

    def _discovered(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            listed = self._listed
        if listed is not None and now - listed[0] < self.settings.discovery.refresh_interval_seconds:
            return listed[1]
        try:
            names = list_databases(self.settings)
        except DatabaseError:
            if listed is not None:
                return listed[1]  # the last list read, rather than no discovered source at all
            raise
        with self._lock:
            self._listed = (now, names)
        return names

    def get(self, name: str | None) -> ConsoleSource:
        """The source a request names (``None``: the only one; SourceNotNamed when
        there are several, SourceUnknown for a name not served)."""
        if not self.multi:
            if name not in (None, "", self.single.name):
                raise SourceUnknown(f"no source named {name!r}: this console serves {self.single.name!r} only")
            return self.single
        if not name:
            raise SourceNotNamed(
                "this console serves several sources: name one with ?source=NAME (the overview lists them)"
            )
        with self._lock:
            known = self._open.get(name)
        if known is not None:
            return known
        settings = self._settings_of(name)
        source = ConsoleSource(name, settings, self._make_store(settings))
        with self._lock:
            if name in self._open:  # another request opened it meanwhile
                source.store.close()
                return self._open[name]
            self._open[name] = source
        return source

    def _settings_of(self, name: str) -> Settings:
        static = self.settings.sources.get(name)
        if static is not None:
            return settings_for(self.settings, static)
        if self.settings.discovery.enabled and name in self._discovered():
            return settings_for(self.settings, discovered_source(self.settings, name))
        raise SourceUnknown(f"no source named {name!r}")

    def _make_store(self, settings: Settings) -> OutboxStore:
        if self._store_factory is None:
            raise ValueError("a console of several sources needs a store factory")
        store = self._store_factory(settings)
        # One connection attempt first: a source whose database is down fails at once
        # with its reason (its page says so, the list of sources marks it unready, the
        # next use tries again) instead of holding a request or a round for the pool's
        # timeout. Then waiting for the pool's first connection, so the first statement
        # uses it: not waiting made the pool open a second one for it, two connections
        # per source for every source the list reads.
        store.open(wait=True, fail_fast=True)
        return store

    def close(self) -> None:
        with self._lock:
            opened = list(self._open.values())
            self._open.clear()
        for source in opened:
            source.store.close()
