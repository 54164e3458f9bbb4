"""The list of sources of a console that serves many (hundreds of tenant databases):
what is known of each source, held in memory, and the filtered, sorted page of it a
request asks for.

A request never reads a database per source: ``SourceBoard`` keeps the figures of
every source (queue depth per status, age of the oldest pending row, or why its
database did not answer) from the last round that read them, and a request only
filters, sorts and pages that list in memory. A round reads every source a few at a
time (``READ_WORKERS``, so a database that does not answer holds one thread for its
connect timeout, not the list) and starts when a request finds the figures older than
``console.sources_refresh_seconds``; that request and the ones after it are answered
from the figures held (a round runs in the background), only the very first request
waits for the first round (at most ``FIRST_ROUND_WAIT_SECONDS``; sources not read by
then are listed as such). An idle console therefore reads nothing. A retry or skip
made through the console reads its source again at once.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Literal

from ...db.store import Count

# Sources read at the same time by one round.
READ_WORKERS = 8
# How long the very first request waits for the first round: a source whose database
# does not answer holds its reader for the pool's timeout, and an operator should see
# the list (the sources not read yet marked so) rather than a page that never loads.
FIRST_ROUND_WAIT_SECONDS = 10.0
# The statuses the list shows (done has no index: counting it reads the table).
LISTED_STATUSES = ("pending", "processing", "dead")

STATES = ("ready", "unready", "dead", "backlog")
SORTS = ("age", "backlog", "dead", "name")
ORDERS = ("desc", "asc")
MAX_LIMIT = 200
DEFAULT_LIMIT = 50
MAX_QUERY_CHARS = 200
LIST_PARAMETERS = ("q", "state", "sort", "order", "page", "limit")


@dataclass(frozen=True)
class SourceFigures:
    """What the console last read of one source, or why it could not (``problem``)."""

    name: str
    table: str | None
    depth: dict[str, Count] | None  # pending, processing, dead
    oldest_pending_age_seconds: float | None
    problem: str | None
    read_at: dt.datetime | None  # when this source was read (None: not yet)

    @property
    def ready(self) -> bool:
        return self.depth is not None and self.problem is None

    def count(self, status: str) -> int | None:
        return self.depth[status].n if self.depth is not None else None

    def as_json(self, now: dt.datetime) -> dict[str, Any]:
        return {
            "source": self.name,
            "table": self.table,
            "state": "ready" if self.ready else "unready",
            "queue_depth": {k: c.n for k, c in self.depth.items()} if self.depth is not None else None,
            "queue_depth_estimated": [k for k, c in self.depth.items() if not c.exact]
            if self.depth is not None
            else None,
            "oldest_pending_age_seconds": round(self.oldest_pending_age_seconds, 3)
            if self.oldest_pending_age_seconds is not None
            else None,
            "problem": self.problem,
            "read_at": self.read_at.isoformat() if self.read_at is not None else None,
            "read_seconds_ago": round((now - self.read_at).total_seconds(), 1) if self.read_at is not None else None,
        }


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def not_read_yet(name: str) -> SourceFigures:
    return SourceFigures(name, None, None, None, "not read yet", None)


@dataclass(frozen=True)
class SourceQuery:
    """One request's view of the list: filter by name and state, sort, page."""

    q: str = ""
    states: tuple[str, ...] = ()
    sort: Literal["age", "backlog", "dead", "name"] = "age"
    order: Literal["desc", "asc"] = "desc"
    page: int = 1
    limit: int = DEFAULT_LIMIT

    @classmethod
    def parse(cls, params: Mapping[str, list[str]], *, allowed_extra: tuple[str, ...] = ()) -> SourceQuery:
        """From query parameters (each a list of values); ValueError with a one-line
        reason for anything it does not take."""
        unknown = sorted(set(params) - set(LIST_PARAMETERS) - set(allowed_extra))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} (the list takes: {', '.join(LIST_PARAMETERS)})")

        def one(name: str) -> str:
            values = [v for v in params.get(name, []) if v != ""]
            if len(values) > 1:
                raise ValueError(f"{name}: give it once")
            return values[0] if values else ""

        q = one("q")
        if len(q) > MAX_QUERY_CHARS:
            raise ValueError(f"q: at most {MAX_QUERY_CHARS} characters")
        states: list[str] = []
        for raw in params.get("state", []):
            for state in (s.strip() for s in raw.split(",")):
                if not state:
                    continue
                if state not in STATES:
                    raise ValueError(f"state: {state!r} is not one of {', '.join(STATES)}")
                if state not in states:
                    states.append(state)
        if "ready" in states and "unready" in states:
            raise ValueError("state: a source is either ready or unready, not both")
        sort = one("sort") or "age"
        if sort not in SORTS:
            raise ValueError(f"sort: {sort!r} is not one of {', '.join(SORTS)}")
        order = one("order") or ("asc" if sort == "name" else "desc")
        if order not in ORDERS:
            raise ValueError(f"order: {order!r} is not one of {', '.join(ORDERS)}")
        page = _whole(one("page"), "page", default=1, low=1, high=1_000_000)
        limit = _whole(one("limit"), "limit", default=DEFAULT_LIMIT, low=1, high=MAX_LIMIT)
        return cls(q, tuple(states), sort, order, page, limit)  # type: ignore[arg-type]

    def matches(self, item: SourceFigures) -> bool:
        if self.q and self.q.casefold() not in item.name.casefold():
            return False
        for state in self.states:
            if state == "ready" and not item.ready:
                return False
            if state == "unready" and item.ready:
                return False
            if state == "dead" and not (item.count("dead") or 0) > 0:
                return False
            if state == "backlog" and not (item.count("pending") or 0) > 0:
                return False
        return True

    def select(self, items: list[SourceFigures]) -> tuple[list[SourceFigures], int]:
        """The page asked for and how many sources match the filter."""
        matched = [item for item in items if self.matches(item)]
        if self.sort == "name":
            matched.sort(key=lambda item: item.name, reverse=self.order == "desc")
        else:
            figure = _SORT_FIGURES[self.sort]
            known = [item for item in matched if figure(item) is not None]
            by_name = sorted((item for item in matched if figure(item) is None), key=lambda item: item.name)
            failed = [item for item in by_name if item.read_at is not None]
            not_read = [item for item in by_name if item.read_at is None]
            # Worst first: the largest figure, ties by name; a source whose database did
            # not answer is worse than any figure. Sources not read yet (the console has
            # just started) come last either way: nothing is known of them.
            if self.order == "desc":
                known.sort(key=lambda item: (-(figure(item) or 0), item.name))
                matched = failed + known + not_read
            else:
                known.sort(key=lambda item: (figure(item) or 0, item.name))
                matched = known + failed + not_read
        start = (self.page - 1) * self.limit
        return matched[start : start + self.limit], len(matched)

    def link(self, **changes: Any) -> dict[str, Any]:
        """The query parameters of this view with ``changes`` (for the page's links);
        defaults are left out."""
        values: dict[str, Any] = {
            "q": self.q,
            "state": list(self.states),
            "sort": self.sort,
            "order": self.order,
            "page": self.page,
            "limit": self.limit,
        }
        values.update(changes)
        if values["sort"] == "age" and values["order"] == "desc" and "order" not in changes:
            values["order"] = None
        if values["sort"] == "age":
            values["sort"] = None
        if values["page"] == 1:
            values["page"] = None
        if values["limit"] == DEFAULT_LIMIT:
            values["limit"] = None
        return values


_SORT_FIGURES: dict[str, Callable[[SourceFigures], float | None]] = {
    "age": lambda item: item.oldest_pending_age_seconds,
    "backlog": lambda item: item.count("pending"),
    "dead": lambda item: item.count("dead"),
}


def _whole(raw: str, name: str, *, default: int, low: int, high: int) -> int:
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw[:40]!r} is not a whole number") from None
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is out of range ({low}..{high})")
    return value


@dataclass(frozen=True)
class BoardView:
    """The figures of every source served, as one request sees them."""

    items: list[SourceFigures]
    oldest_read_at: dt.datetime | None  # the least fresh figures listed (None: some not read yet)
    refreshing: bool


class SourceBoard:
    """Every source's figures, held in memory and read again in the background when a
    request finds them older than ``refresh_seconds`` (see the module's docstring)."""

    def __init__(
        self,
        names: Callable[[], list[str]],
        read_one: Callable[[str], SourceFigures],
        *,
        refresh_seconds: float,
        workers: int = READ_WORKERS,
        first_wait_seconds: float = FIRST_ROUND_WAIT_SECONDS,
    ) -> None:
        self._names = names
        self._read_one = read_one
        self.refresh_seconds = refresh_seconds
        self._workers = workers
        self._first_wait_seconds = first_wait_seconds
        self._lock = threading.Lock()
        self._held: dict[str, SourceFigures] = {}
        self._round_started: float | None = None  # monotonic start of the last round
        self._round: threading.Thread | None = None
        self._first_round = threading.Event()
        self._closed = False

    def view(self) -> BoardView:
        """Every source's figures as held now; starts a round when they are stale and
        waits only for the very first one (at most ``first_wait_seconds``)."""
        names = self._names()
        self._maybe_refresh(names)
        self._first_round.wait(self._first_wait_seconds)
        with self._lock:
            items = [self._held.get(name) or not_read_yet(name) for name in names]
            refreshing = self._round is not None and self._round.is_alive()
        read = [item.read_at for item in items]
        oldest = None if any(r is None for r in read) else min((r for r in read if r is not None), default=None)
        return BoardView(items, oldest, refreshing)

    def refresh_source(self, name: str) -> None:
        """Read one source again now (after a change made through the console)."""
        figures = self._read_safely(name)  # never fails the change it follows
        with self._lock:
            self._held[name] = figures

    def _maybe_refresh(self, names: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if self._closed or (self._round is not None and self._round.is_alive()):
                return
            fresh = self._round_started is not None and now - self._round_started < self.refresh_seconds
            if fresh and all(name in self._held for name in names):
                return
            self._round_started = now
            self._round = threading.Thread(
                target=self.read_all, args=(names,), name="console-source-figures", daemon=True
            )
            self._round.start()

    def read_all(self, names: list[str]) -> None:
        """One round: read every named source, a few at a time (what the background
        round runs; blocking)."""
        try:
            if not names:
                return
            with ThreadPoolExecutor(
                max_workers=min(self._workers, len(names)), thread_name_prefix="console-sources"
            ) as pool:
                # Held as each one is read, not in list order: a source that does not
                # answer must not keep the ones after it from the list meanwhile.
                for done in as_completed([pool.submit(self._read_safely, name) for name in names]):
                    figures = done.result()
                    with self._lock:
                        self._held[figures.name] = figures
            with self._lock:
                for gone in set(self._held) - set(names):  # sources no longer served
                    del self._held[gone]
        finally:
            self._first_round.set()

    def _read_safely(self, name: str) -> SourceFigures:
        if self._closed:  # the console is stopping: the rest of the round is not read
            return not_read_yet(name)
        try:
            return self._read_one(name)
        except Exception as exc:  # one source's surprise must not end the round for the others
            return SourceFigures(name, None, None, None, f"could not be read: {type(exc).__name__}", _utcnow())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running = self._round
        self._first_round.set()  # nobody waits for a round that will not run
        if running is not None:
            running.join(timeout=30)
