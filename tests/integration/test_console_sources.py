"""The console of a configuration with several sources, over real HTTP on real
PostgreSQL databases (one per source): the overview lists every source with its
queue, every page and API call works on the source it names (``?source=NAME``) and on
no other, links and forms carry the source, an unreachable source is shown as such
(its password never), and naming no source or an unknown one is refused clearly."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from outbox_relay.config import Settings, load_settings
from tests.helpers import sources as source_helpers
from tests.helpers.console import row_states, running_console, seed_dead

databases = source_helpers.databases  # the fixture

pytestmark = pytest.mark.timeout(120)
TOKEN = "sources-console-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
TABLE = "public.outbox"
GONE_PASSWORD = "never-shown-pw"


def sources_console_settings(sources: dict[str, dict[str, Any]]) -> Settings:
    return load_settings(
        None,
        sources=sources,
        console={"host": "127.0.0.1", "port": 0, "token": TOKEN},
        log={"level": "WARNING", "format": "json"},
    )


@pytest.fixture
def two_sources(databases):
    dsn_a, dsn_b = databases("a"), databases("b")
    seeded = {
        "a": seed_dead(dsn_a, TABLE, 3, aggregate_prefix="a-"),
        "b": seed_dead(dsn_b, TABLE, 5, aggregate_prefix="b-", event_type="OrderCreated"),
    }
    settings = sources_console_settings(
        {
            "alpha": {"dsn": dsn_a},
            "beta": {"dsn": dsn_b},
            # Nothing listens on port 1: a source whose database is down.
            "gone": {"dsn": f"postgresql://postgres:{GONE_PASSWORD}@127.0.0.1:1/postgres?connect_timeout=2"},
        }
    )
    return {"dsn": {"a": dsn_a, "b": dsn_b}, "ids": seeded, "settings": settings}


def test_the_api_lists_the_sources_and_every_call_works_on_the_one_it_names(two_sources):
    ids, dsn = two_sources["ids"], two_sources["dsn"]
    with (
        running_console(two_sources["settings"]) as url,
        httpx.Client(base_url=url, headers=BEARER, timeout=30) as http,
    ):
        listed = {s["source"]: s for s in http.get("/api/sources").json()["sources"]}
        assert sorted(listed) == ["alpha", "beta", "gone"]
        assert listed["alpha"]["queue_depth"] == {"pending": 0, "processing": 0, "dead": 3}
        assert listed["beta"]["queue_depth"]["dead"] == 5 and listed["beta"]["problem"] is None
        assert listed["gone"]["queue_depth"] is None and listed["gone"]["problem"]
        assert GONE_PASSWORD not in http.get("/api/sources").text

        # Naming no source, or one not served, is refused with the reason.
        unnamed = http.get("/api/status")
        assert unnamed.status_code == 400 and "?source=NAME" in unnamed.json()["error"]
        unknown = http.get("/api/dead", params={"source": "nope"})
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"]

        status = http.get("/api/status", params={"source": "beta"}).json()
        assert (status["source"], status["queue_depth"]["dead"]) == ("beta", 5)
        dead_a = http.get("/api/dead", params={"source": "alpha"}).json()
        assert [r["id"] for r in dead_a["rows"]] == ids["a"]
        assert http.get(f"/api/dead/{ids['b'][0]}", params={"source": "beta"}).json()["event_type"] == "OrderCreated"

        # A retry by ids in beta changes beta's rows; alpha's rows with the same ids stay dead.
        retried = http.post("/api/dead/retry", params={"source": "beta"}, json={"ids": ids["b"]})
        assert retried.status_code == 200 and retried.json()["changed"] == 5, retried.text
        assert set(row_states(dsn["b"], TABLE, ids["b"]).values()) == {("pending", 0)}
        assert {s for s, _ in row_states(dsn["a"], TABLE, ids["a"]).values()} == {"dead"}
        assert [e["rows_changed"] for e in http.get("/api/audit", params={"source": "beta"}).json()["entries"]] == [5]
        assert http.get("/api/audit", params={"source": "alpha"}).json()["entries"] == []


def test_pages_carry_their_source_in_every_link_and_form(two_sources):
    ids, dsn = two_sources["ids"], two_sources["dsn"]
    with httpx.Client(timeout=30, follow_redirects=False) as http, running_console(two_sources["settings"]) as url:
        login = http.post(url + "/login", data={"name": "alice", "token": TOKEN, "next": "/"})
        assert login.status_code == 303
        sources_page = http.get(url + "/")
        assert sources_page.status_code == 200
        assert 'href="/?source=alpha"' in sources_page.text and 'href="/dead?source=beta">5<' in sources_page.text
        assert "unready" in sources_page.text and GONE_PASSWORD not in sources_page.text

        overview = http.get(url + "/", params={"source": "alpha"})
        assert overview.status_code == 200 and 'id="depth-dead">3<' in overview.text
        assert 'href="/dead?source=alpha"' in overview.text and 'href="/audit?source=alpha"' in overview.text

        dead = http.get(url + "/dead", params={"source": "alpha"})
        assert 'id="matched">3<' in dead.text
        assert f'href="/rows/{ids["a"][0]}?source=alpha"' in dead.text
        assert dead.text.count('<input type="hidden" name="source" value="alpha">') == 2  # filter and selection forms
        assert http.get(url + "/dead").status_code == 400  # which source?

        # The preview -> confirm flow of beta posts to beta (CSRF and all).
        preview = http.get(
            url + "/dead/preview", params={"source": "beta", "action": "retry", "scope": "ids", "id": ids["b"][:2]}
        )
        assert preview.status_code == 200 and 'action="/dead/apply?source=beta"' in preview.text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', preview.text).group(1)
        form = {"action": "retry", "scope": "ids", "id": [str(i) for i in ids["b"][:2]], "csrf_token": csrf}
        assert (
            http.post(url + "/dead/apply", params={"source": "beta"}, data=dict(form, csrf_token="x")).status_code
            == 403
        )
        done = http.post(url + "/dead/apply", params={"source": "beta"}, data=form)
        assert done.status_code == 303 and done.headers["location"].startswith("/audit?done=")
        assert "source=beta" in done.headers["location"]
        states = row_states(dsn["b"], TABLE, ids["b"])
        assert [states[i][0] for i in ids["b"]] == ["pending", "pending", "dead", "dead", "dead"]
        assert {s for s, _ in row_states(dsn["a"], TABLE, ids["a"]).values()} == {"dead"}

        assert http.get(url + "/rows/1", params={"source": "nope"}).status_code == 404
        gone = http.get(url + "/", params={"source": "gone"})
        assert gone.status_code == 503 and GONE_PASSWORD not in gone.text
