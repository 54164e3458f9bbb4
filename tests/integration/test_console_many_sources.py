"""The list of sources of a console serving many outboxes, over real HTTP on one real
PostgreSQL: 30 static sources (an outbox table each, in one database), one whose
database does not answer and one discovered database whose name is HTML. The list
(page and ``GET /api/sources``) pages, filters by name and state, sorts worst first,
escapes every name, refuses bad parameters with one line, answers from the figures
it holds, and shows a change made through the console at once."""

from __future__ import annotations

import re
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from markupsafe import escape

from outbox_relay.config import Settings, load_settings
from outbox_relay.db.store import OutboxStore
from tests.helpers.console import running_console, seed_dead
from tests.helpers.db import ON_DONE
from tests.helpers.sources import create_database, drop_database

pytestmark = pytest.mark.timeout(180)
TOKEN = "many-sources-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
TENANTS = 30
GONE = "gone"
# A database name discovery finds: whatever its owner chose, HTML and script included.
HOSTILE_SUFFIX = "<script>alert('x')</script>&"


def tenant(i: int) -> str:
    return f"tenant-{i:02d}"


def pending_rows(i: int) -> int:
    return i % 6


def dead_rows(i: int) -> int:
    return (i * 7) % 4


@pytest.fixture(scope="module")
def many(pg_dsn: str) -> Iterator[dict[str, Any]]:
    """30 outbox tables in one schema, each seeded with its own backlog (pending rows
    created 100*i s ago) and dead rows; a discovered database with a hostile name."""
    schema = "many_" + uuid.uuid4().hex[:8]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    prefix = "dsc_" + uuid.uuid4().hex[:8]
    hostile_db = f"{prefix}_{HOSTILE_SUFFIX}"
    try:
        tables = {}
        with OutboxStore(pg_dsn, f"{schema}.outbox_00", pool_size=1) as first:
            first.migrate(on_done=ON_DONE)
        for i in range(TENANTS):
            table = f"{schema}.outbox_{i:02d}"
            if i:
                with OutboxStore(pg_dsn, table, pool_size=1) as store:
                    store.migrate(on_done=ON_DONE)
            if pending_rows(i):
                seed_dead(pg_dsn, table, pending_rows(i), status="pending", age_seconds=100.0 * i)
            if dead_rows(i):
                seed_dead(pg_dsn, table, dead_rows(i))
            tables[tenant(i)] = table
        hostile_dsn = create_database(pg_dsn, hostile_db)
        seed_dead(hostile_dsn, "public.outbox", 2)
        yield {"dsn": pg_dsn, "tables": tables, "hostile": hostile_db, "prefix": prefix}
    finally:
        drop_database(pg_dsn, hostile_db)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def many_settings(many: dict[str, Any], **console: Any) -> Settings:
    sources: dict[str, dict[str, Any]] = {name: {"dsn": many["dsn"], "table": t} for name, t in many["tables"].items()}
    # Nothing listens on port 1: a source whose database is down.
    sources[GONE] = {"dsn": "postgresql://postgres:pw@127.0.0.1:1/postgres?connect_timeout=2"}
    return load_settings(
        None,
        sources=sources,
        discovery={"dsn": many["dsn"], "database_pattern": many["prefix"] + "%", "table": "outbox"},
        console={"host": "127.0.0.1", "port": 0, "token": TOKEN, **console},
        log={"level": "WARNING", "format": "json"},
    )


def every_source_read(url: str) -> None:
    """Wait until the console has read every source once (the first request waits for
    the first round only so long: on a slow machine it may answer before the end)."""
    deadline = time.monotonic() + 60
    while httpx.get(url + "/api/sources", headers=BEARER, timeout=60).json()["figures_read_at"] is None:
        assert time.monotonic() < deadline, "the console never read every source"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def console_url(many: dict[str, Any]) -> Iterator[str]:
    with running_console(many_settings(many, sources_refresh_seconds=3600)) as url:
        every_source_read(url)
        yield url


@pytest.fixture
def api(console_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=console_url, headers=BEARER, timeout=60) as http:
        yield http


def expected(many: dict[str, Any], key: str) -> list[str]:
    """Every source's name in the order the list sorts ``key`` worst first: the source
    whose database does not answer, then the largest figure, ties by name."""
    figure = {
        "dead": lambda i: dead_rows(i),
        "backlog": lambda i: pending_rows(i),
        "age": lambda i: 100 * i if pending_rows(i) else 0,
    }[key]
    known = [(figure(i), tenant(i)) for i in range(TENANTS)] + [(2 if key == "dead" else 0, many["hostile"])]
    return [GONE] + [name for _, name in sorted(known, key=lambda item: (-item[0], item[1]))]


def esc(name: str) -> str:
    """How the page shows a name: HTML-escaped."""
    return str(escape(name))


def names(listed: dict[str, Any]) -> list[str]:
    return [s["source"] for s in listed["sources"]]


def test_the_api_pages_filters_and_sorts_worst_first(many, api):
    everything = api.get("/api/sources", params={"limit": 200}).json()
    assert (everything["total"], everything["served"], everything["pages"]) == (TENANTS + 2, TENANTS + 2, 1)
    by_name = {s["source"]: s for s in everything["sources"]}
    assert by_name[tenant(11)]["queue_depth"] == {"pending": 5, "processing": 0, "dead": 1}
    assert by_name[tenant(11)]["oldest_pending_age_seconds"] >= 1100
    assert by_name[GONE]["state"] == "unready" and by_name[GONE]["queue_depth"] is None and by_name[GONE]["problem"]
    assert by_name[many["hostile"]]["queue_depth"]["dead"] == 2  # the raw name, as JSON carries it
    assert all(s["read_at"] for s in everything["sources"]) and everything["figures_read_at"]

    # Default: the oldest pending row first; pages of 7 walk the same order, each source once.
    assert names(everything) == expected(many, "age")
    walked: list[str] = []
    for page in range(1, 6):
        listed = api.get("/api/sources", params={"limit": 7, "page": page}).json()
        assert (listed["total"], listed["pages"], listed["page"]) == (TENANTS + 2, 5, page)
        walked += names(listed)
    assert walked == expected(many, "age")
    assert api.get("/api/sources", params={"limit": 7, "page": 6}).json()["sources"] == []

    assert names(api.get("/api/sources", params={"sort": "dead", "limit": 200}).json()) == expected(many, "dead")
    assert names(api.get("/api/sources", params={"sort": "backlog", "limit": 200}).json()) == expected(many, "backlog")
    ascending = names(api.get("/api/sources", params={"sort": "dead", "order": "asc", "limit": 200}).json())
    assert ascending[-1] == GONE and ascending[0] == tenant(0)
    by_name_sorted = names(api.get("/api/sources", params={"sort": "name", "limit": 200}).json())
    assert by_name_sorted == sorted(by_name_sorted)

    # Filters: a name substring (any case), a state, both states at once.
    named = api.get("/api/sources", params={"q": "TENANT-1", "sort": "name"}).json()
    assert names(named) == [tenant(i) for i in range(10, 20)] and named["total"] == 10
    dead = api.get("/api/sources", params={"state": "dead", "limit": 200}).json()
    assert set(names(dead)) == {tenant(i) for i in range(TENANTS) if dead_rows(i)} | {many["hostile"]}
    backlog = api.get("/api/sources", params={"state": "backlog", "limit": 200}).json()
    assert set(names(backlog)) == {tenant(i) for i in range(TENANTS) if pending_rows(i)}
    both = api.get("/api/sources", params=[("state", "dead"), ("state", "backlog"), ("limit", "200")]).json()
    assert set(names(both)) == {tenant(i) for i in range(TENANTS) if dead_rows(i) and pending_rows(i)}
    assert names(api.get("/api/sources", params={"state": "unready"}).json()) == [GONE]
    assert api.get("/api/sources", params={"state": "ready"}).json()["total"] == TENANTS + 1
    nothing = api.get("/api/sources", params={"q": "no-such"}).json()
    assert (nothing["sources"], nothing["total"], nothing["served"]) == ([], 0, TENANTS + 2)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"page": "0"}, "page: 0 is out of range"),
        ({"page": "two"}, "page: 'two' is not a whole number"),
        ({"limit": "0"}, "limit: 0 is out of range"),
        ({"limit": "201"}, "limit: 201 is out of range"),
        ({"sort": "size"}, "sort: 'size' is not one of"),
        ({"order": "up"}, "order: 'up' is not one of"),
        ({"state": "stuck"}, "state: 'stuck' is not one of"),
        ([("state", "ready"), ("state", "unready")], "either ready or unready"),
        ({"q": "x" * 201}, "q: at most 200 characters"),
        ({"pages": "2"}, "unknown parameter 'pages'"),
    ],
)
def test_bad_parameters_are_refused_with_one_line(api, console_url, params, reason):
    refused = api.get("/api/sources", params=params)
    assert refused.status_code == 400
    message = refused.json()["error"]
    assert reason in message and "\n" not in message
    page = httpx.get(console_url + "/", params=params, headers=BEARER, timeout=60)
    assert page.status_code == 400 and esc(reason) in page.text


def test_the_sources_page_pages_links_and_escapes(many, console_url):
    with httpx.Client(base_url=console_url, headers=BEARER, timeout=60) as http:
        first = http.get("/", params={"limit": 10})
        assert first.status_code == 200
        rows = re.findall(r'class="source-link">([^<]*)<', first.text)
        order = expected(many, "age")
        assert len(rows) == 10 and rows == [esc(n) for n in order[:10]]
        assert 'id="page-number">1<' in first.text and 'id="page-count">4<' in first.text
        assert 'href="/?page=2&amp;limit=10" id="next-page"' in first.text
        assert 'href="/?page=4&amp;limit=10" id="last-page"' in first.text
        # Each source links to its own pages.
        assert 'href="/dead?source=tenant-11"' in http.get("/", params={"q": "tenant-11"}).text
        assert 'href="/audit?source=tenant-11"' in http.get("/", params={"q": "tenant-11"}).text

        last = http.get("/", params={"limit": 10, "page": 4})
        assert re.findall(r'class="source-link">([^<]*)<', last.text) == [esc(n) for n in order[30:]]
        assert 'id="prev-page"' in last.text and 'id="next-page"' not in last.text

        # Filtered and sorted: the form keeps what was asked; sort links keep the filter.
        dead = http.get("/", params={"state": "dead", "sort": "dead", "q": "tenant"})
        assert '<option value="dead" selected>' in dead.text and 'value="tenant"' in dead.text
        assert 'href="/?q=tenant&amp;state=dead&amp;sort=dead&amp;order=asc"' in dead.text
        assert re.findall(r'class="source-link">([^<]*)<', dead.text) == [
            n for n in expected(many, "dead") if n.startswith("tenant") and dead_rows(int(n[-2:]))
        ]

        # The hostile name is text everywhere: in the list, in its link, on its own pages.
        hostile = many["hostile"]
        listed = http.get("/", params={"q": "script"})
        assert "<script>" not in listed.text and "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;" in listed.text
        link = re.search(r'<a href="/\?(source=[^"]*)" class="source-link">', listed.text).group(1)
        assert link == esc(urllib.parse.urlencode({"source": hostile}))
        own = http.get("/", params={"source": hostile})
        assert own.status_code == 200 and "<script>" not in own.text and 'id="depth-dead">2<' in own.text
        assert "<script>" not in http.get("/dead", params={"source": hostile}).text
        unknown = http.get("/dead", params={"source": "<img src=x onerror=alert(1)>"})
        assert unknown.status_code == 404 and "<img" not in unknown.text

        # No page's header lists the sources: the current one and a search that leads to the list.
        one = http.get("/dead", params={"source": tenant(3)})
        assert "<select" not in one.text.split("<main>")[0] and tenant(4) not in one.text
        assert 'id="source-name">tenant-03<' in one.text and 'id="source-search"' in one.text


def test_the_list_answers_from_the_figures_it_holds_and_a_change_shows_at_once(many, api):
    table = many["tables"][tenant(3)]
    before = api.get("/api/sources", params={"q": tenant(3)}).json()["sources"][0]
    assert before["queue_depth"]["dead"] == dead_rows(3) > 0
    # A row written behind the console's back shows at the next round (an hour away
    # here): the list did not read the database again.
    seed_dead(many["dsn"], table, 1, status="pending")
    held = api.get("/api/sources", params={"q": tenant(3)}).json()
    assert held["sources"][0]["queue_depth"] == before["queue_depth"] and held["refreshing"] is False
    assert held["sources"][0]["read_at"] == before["read_at"]

    # A retry made through the console reads its source again at once.
    dead_ids = [r["id"] for r in api.get("/api/dead", params={"source": tenant(3)}).json()["rows"]]
    retried = api.post("/api/dead/retry", params={"source": tenant(3)}, json={"ids": dead_ids})
    assert retried.status_code == 200 and retried.json()["changed"] == dead_rows(3)
    after = api.get("/api/sources", params={"q": tenant(3)}).json()["sources"][0]
    assert after["queue_depth"]["dead"] == 0
    assert after["queue_depth"]["pending"] == pending_rows(3) + 1 + dead_rows(3)


def test_stale_figures_are_read_again_in_the_background(many):
    table = many["tables"][tenant(5)]
    with (
        running_console(many_settings(many, sources_refresh_seconds=1)) as url,
        httpx.Client(base_url=url, headers=BEARER, timeout=60) as http,
    ):
        every_source_read(url)
        first = http.get("/api/sources", params={"q": tenant(5)}).json()["sources"][0]
        seed_dead(many["dsn"], table, 3)
        deadline = time.monotonic() + 60
        while True:
            now = http.get("/api/sources", params={"q": tenant(5)}).json()["sources"][0]
            if now["queue_depth"]["dead"] == first["queue_depth"]["dead"] + 3:
                break
            assert time.monotonic() < deadline, "the figures were never read again"
            time.sleep(0.2)
        assert now["read_at"] > first["read_at"]
