"""The console's JSON API and pages over real HTTP (uvicorn) on a real PostgreSQL:
authentication (401/403), read-only mode, CSRF, HTML escaping of attacker-controlled
rows, dry runs, and audited changes."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.helpers.console import console_process, console_settings, row_states, running_console, seed_dead

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret-console-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def seeded(store, pg_dsn, table):
    return {
        "target": seed_dead(pg_dsn, table, 6, aggregates=3),
        "other": seed_dead(
            pg_dsn,
            table,
            4,
            event_type="OrderCreated",
            aggregate_type="order",
            aggregate_prefix="order-",
            last_error="permanent: MSG_SIZE_TOO_LARGE",
        ),
    }


@pytest.fixture
def console_url(pg_dsn, table, seeded):
    with running_console(console_settings(pg_dsn, table, token=TOKEN)) as url:
        yield url


def test_token_required_everywhere(console_url, pg_dsn, table, seeded):
    with httpx.Client(base_url=console_url, follow_redirects=False) as http:
        anonymous = http.get("/api/status")
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"].startswith("Bearer")
        assert http.get("/api/status", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert http.get("/api/dead", headers={"Authorization": "Basic xyz"}).status_code == 401
        for path in ("/", "/dead", f"/rows/{seeded['target'][0]}", "/audit", "/aggregates/pay-1"):
            page = http.get(path)
            assert page.status_code == 303 and page.headers["location"].startswith("/login?next=")
        for method, path in (("POST", "/api/dead/retry"), ("POST", "/api/dead/skip")):
            body = {"ids": seeded["target"], "reason": "x"}
            assert http.request(method, path, json=body).status_code == 401
            assert http.request(method, path, json=body, headers={"Authorization": "Bearer nope"}).status_code == 403
        assert http.post("/dead/apply", data={"action": "retry", "scope": "all"}).status_code == 303  # to login
        assert {s for s, _ in row_states(pg_dsn, table, seeded["target"]).values()} == {"dead"}

        status = http.get("/api/status", headers=BEARER)
        assert status.status_code == 200
        doc = status.json()
        assert doc["queue_depth"] == {"pending": 0, "processing": 0, "done": 0, "dead": 10}
        assert {"oldest_pending_age_seconds", "expired_leases", "queue_depth_estimated"} <= doc.keys()
        assert "password" not in status.text and pg_dsn not in status.text
        assert status.headers["content-security-policy"].startswith("default-src 'none'")


def test_dry_run_changes_nothing(console_url, pg_dsn, table, seeded):
    with httpx.Client(base_url=console_url, headers=BEARER) as http:
        answer = http.post(
            "/api/dead/retry",
            json={"filter": {"event_type": "PaymentCaptured", "error_contains": "unknown_topic"}, "dry_run": True},
        )
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert (doc["matched"], doc["changed"], doc["dry_run"]) == (6, 0, True)
        assert doc["by_event_type"] == {"PaymentCaptured": 6} and doc["aggregates"] == 3
        skip = http.post("/api/dead/skip", json={"ids": seeded["other"], "dry_run": True}).json()
        assert (skip["matched"], skip["changed"]) == (4, 0)
        assert {s for s, _ in row_states(pg_dsn, table, seeded["target"] + seeded["other"]).values()} == {"dead"}
        assert http.get("/api/audit").json()["entries"] == []


def test_retry_and_skip_by_filter_and_ids_are_audited(console_url, pg_dsn, table, seeded):
    with httpx.Client(base_url=console_url, headers=dict(BEARER, **{"X-Outbox-Relay-User": "deploy-bot"})) as http:
        listed = http.get("/api/dead", params={"event_type": "PaymentCaptured", "limit": 4}).json()
        assert [r["id"] for r in listed["rows"]] == seeded["target"][:4]
        assert (listed["matched"], listed["matched_exact"], listed["next_after_id"]) == (6, True, seeded["target"][3])
        rest = http.get("/api/dead", params={"event_type": "PaymentCaptured", "after_id": listed["next_after_id"]})
        assert [r["id"] for r in rest.json()["rows"]] == seeded["target"][4:]

        retried = http.post("/api/dead/retry", json={"filter": {"event_type": "PaymentCaptured"}})
        assert retried.status_code == 200, retried.text
        assert {k: retried.json()[k] for k in ("matched", "changed")} == {"matched": 6, "changed": 6}
        assert set(row_states(pg_dsn, table, seeded["target"]).values()) == {("pending", 0)}

        no_reason = http.post("/api/dead/skip", json={"ids": seeded["other"][:2]})
        assert no_reason.status_code == 400 and "reason" in no_reason.json()["error"]
        skipped = http.post("/api/dead/skip", json={"ids": [*seeded["other"][:2], 999_999], "reason": "OPS-7"}).json()
        assert (skipped["matched"], skipped["changed"]) == (2, 2)
        states = row_states(pg_dsn, table, seeded["other"])
        assert [states[i][0] for i in seeded["other"]] == ["done", "done", "dead", "dead"]

        row = http.get(f"/api/dead/{seeded['other'][0]}").json()
        assert row["status"] == "done" and row["last_error"] == "skipped by deploy-bot: OPS-7"
        assert row["payload"] == {"amount": 100}
        assert http.get("/api/dead/999999").status_code == 404

        entries = http.get("/api/audit").json()["entries"]
        assert [(e["action"], e["actor"], e["source"], e["rows_changed"], e["reason"]) for e in entries] == [
            ("skip", "deploy-bot", "api", 2, "OPS-7"),
            ("retry", "deploy-bot", "api", 6, None),
        ]
        assert entries[1]["selector"] == {"filter": {"event_type": "PaymentCaptured"}}


def test_bad_requests_are_refused_with_a_reason(console_url, pg_dsn, table, seeded):
    with httpx.Client(base_url=console_url, headers=BEARER) as http:
        cases = [
            ({"filter": {}}, "empty"),
            ({"filter": {"colour": "red"}}, "unknown filter"),
            ({"filter": {"since": "last tuesday"}}, "since"),
            ({"ids": seeded["target"], "filter": {"event_type": "X"}}, "exactly one"),
            ({"ids": ["1; DROP TABLE x"]}, "integers"),
            ({"all": True, "dry_run": "yes"}, "dry_run"),
        ]
        for body, word in cases:
            answer = http.post("/api/dead/retry", json=body)
            assert answer.status_code == 400, (body, answer.text)
            assert word in answer.json()["error"], (body, answer.text)
        assert (
            http.post(
                "/api/dead/retry", content=b"ids=1", headers={"Content-Type": "application/x-www-form-urlencoded"}
            ).status_code
            == 415
        )
        assert http.get("/api/dead", params={"colour": "red"}).status_code == 400
    assert {s for s, _ in row_states(pg_dsn, table, seeded["target"]).values()} == {"dead"}


def test_read_only_console_refuses_every_action(store, pg_dsn, table, seeded):
    with running_console(console_settings(pg_dsn, table)) as url, httpx.Client(base_url=url) as http:
        assert http.get("/api/status").status_code == 200
        refused = http.post("/api/dead/retry", json={"ids": seeded["target"]})
        assert refused.status_code == 403 and "read-only" in refused.json()["error"]
        assert http.post("/api/dead/skip", json={"all": True, "reason": "x"}).status_code == 403
        # A preview is a read, so it is allowed.
        assert http.post("/api/dead/retry", json={"all": True, "dry_run": True}).json()["matched"] == 10
        page = http.get("/dead")
        assert page.status_code == 200 and "read-only" in page.text
        assert "Retry all matching" not in page.text and "retry-selected" not in page.text
        form = http.post("/dead/apply", data={"action": "retry", "scope": "all"})
        assert form.status_code == 400 and "read-only" in form.text
        # Without a token only loopback names are answered (no DNS rebinding).
        assert http.get("/api/status", headers={"Host": "evil.example:9465"}).status_code == 400
    assert {s for s, _ in row_states(pg_dsn, table, seeded["target"]).values()} == {"dead"}


def test_rows_are_escaped(store, pg_dsn, table):
    script = "<script>document.title='pwned'</script>"
    [row_id] = seed_dead(
        pg_dsn,
        table,
        1,
        payload={"note": script},
        event_type="<b>Evil</b>",
        aggregate_prefix="<img src=x onerror=alert(1)>",
        aggregates=1,
        last_error="boom: <iframe src=//evil.example>",
    )
    with running_console(console_settings(pg_dsn, table)) as url, httpx.Client(base_url=url) as http:
        pages = [
            http.get(f"/rows/{row_id}"),
            http.get("/dead"),
            http.get("/aggregates/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E0"),
        ]
        for page in pages:
            assert page.status_code == 200, page.text
            assert "<script>document" not in page.text and "<img src=x" not in page.text
            assert "<iframe" not in page.text and "<b>Evil</b>" not in page.text
        assert "&lt;script&gt;document.title=" in pages[0].text
        assert "&lt;b&gt;Evil&lt;/b&gt;" in pages[1].text
        assert "&lt;img src=x onerror=alert(1)&gt;0" in pages[2].text


def test_login_session_cookie_and_csrf(console_url, pg_dsn, table, seeded):
    with httpx.Client(base_url=console_url, follow_redirects=False) as http:
        wrong = http.post("/login", data={"name": "alice", "token": "guess", "next": "/dead"})
        assert wrong.status_code == 401 and COOKIE not in wrong.headers.get("set-cookie", "")
        login = http.post("/login", data={"name": "alice", "token": TOKEN, "next": "https://evil.example/"})
        assert login.status_code == 303 and login.headers["location"] == "/"  # never off-site
        cookie = login.headers["set-cookie"]
        assert COOKIE in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert http.get("/dead").status_code == 200

        preview = http.get("/dead/preview", params={"action": "skip", "scope": "ids", "id": seeded["other"]})
        assert preview.status_code == 200 and "4</strong> dead rows will be" in preview.text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', preview.text).group(1)
        form = {"action": "skip", "scope": "ids", "id": [str(i) for i in seeded["other"]], "reason": "dup"}
        assert http.post("/dead/apply", data=form).status_code == 403  # no CSRF token
        assert http.post("/dead/apply", data=dict(form, csrf_token="forged")).status_code == 403
        assert (
            http.post(
                "/dead/apply", data=dict(form, csrf_token=csrf), headers={"Origin": "https://evil.example"}
            ).status_code
            == 403
        )
        no_reason = http.post("/dead/apply", data=dict(form, csrf_token=csrf, reason=" "))
        assert no_reason.status_code == 400 and "say why" in no_reason.text
        assert {s for s, _ in row_states(pg_dsn, table, seeded["other"]).values()} == {"dead"}
        # The JSON API with a session (not a bearer token) needs the CSRF header too.
        assert http.post("/api/dead/retry", json={"ids": seeded["target"]}).status_code == 403

        done = http.post("/dead/apply", data=dict(form, csrf_token=csrf))
        assert done.status_code == 303 and done.headers["location"].startswith("/audit?done=")
        assert {s for s, _ in row_states(pg_dsn, table, seeded["other"]).values()} == {"done"}
        audit_page = http.get(done.headers["location"])
        assert "alice" in audit_page.text and "dup" in audit_page.text
        assert (
            http.post("/api/dead/retry", json={"ids": seeded["target"]}, headers={"X-CSRF-Token": csrf}).json()[
                "changed"
            ]
            == 6
        )

        assert http.post("/logout", data={"csrf_token": csrf}).status_code == 303
        assert http.get("/dead").status_code == 303


COOKIE = "outbox_relay_console"


# --- wrong tokens, proxies, cookies ---------------------------------------------------------
def as_client(address: str) -> dict[str, str]:
    """Headers of a request relayed by the proxy the console trusts (loopback) for a client."""
    return {"X-Forwarded-For": address}


def test_wrong_tokens_are_throttled_per_client_address(store, pg_dsn, table, seeded):
    settings = console_settings(
        pg_dsn, table, token=TOKEN, login_max_failures=3, login_lockout_seconds=600, forwarded_allow_ips=["127.0.0.1"]
    )
    with running_console(settings) as url, httpx.Client(base_url=url, follow_redirects=False) as http:
        alice = as_client("198.51.100.7")
        logged_in = http.post("/login", data={"name": "alice", "token": TOKEN}, headers=alice)
        assert logged_in.status_code == 303
        session = {"Cookie": f"{COOKIE}={http.cookies[COOKIE]}"}
        http.cookies.clear()

        # A guesser at alice's address: the third wrong token starts the lockout...
        for _ in range(3):
            wrong = http.post("/login", data={"name": "mallory", "token": "guess"}, headers=alice)
            assert wrong.status_code == 401 and "wrong token" in wrong.text
        # ... during which no token is checked, not even the right one, by form or bearer.
        refused = http.post("/login", data={"name": "mallory", "token": TOKEN}, headers=alice)
        assert refused.status_code == 429 and COOKIE not in refused.headers.get("set-cookie", "")
        assert 1 <= int(refused.headers["retry-after"]) <= 600
        assert "too many wrong tokens" in refused.text
        assert refused.headers["content-security-policy"].startswith("default-src 'none'")
        api = http.get("/api/status", headers=dict(BEARER, **alice))
        assert api.status_code == 429 and 1 <= int(api.headers["retry-after"]) <= 600
        assert "too many wrong tokens" in api.json()["error"]
        assert http.post("/api/dead/retry", json={"all": True}, headers=dict(BEARER, **alice)).status_code == 429
        # A session opened before keeps working: it carries no token to check.
        assert http.get("/dead", headers=dict(session, **alice)).status_code == 200

        # Other addresses are not affected.
        assert http.get("/api/status", headers=dict(BEARER, **as_client("198.51.100.8"))).status_code == 200
        # Wrong bearer tokens count too; an IPv6 client is counted per /64.
        for _ in range(3):
            assert (
                http.get(
                    "/api/status", headers={"Authorization": "Bearer guess", **as_client("2001:db8::1")}
                ).status_code
                == 403
            )
        assert http.get("/api/status", headers=dict(BEARER, **as_client("2001:db8::2"))).status_code == 429
        assert http.get("/api/status", headers=dict(BEARER, **as_client("2001:db8:0:1::1"))).status_code == 200
        # No name given: the token is not checked, so nothing is counted.
        for _ in range(4):
            assert (
                http.post("/login", data={"name": "", "token": "guess"}, headers=as_client("198.51.100.9")).status_code
                == 401
            )
        assert http.get("/api/status", headers=dict(BEARER, **as_client("198.51.100.9"))).status_code == 200
    assert {s for s, _ in row_states(pg_dsn, table, seeded["target"]).values()} == {"dead"}


def test_forwarded_headers_count_only_from_trusted_proxies(store, pg_dsn, table):
    # No proxy configured: X-Forwarded-For cannot dodge the lockout, X-Forwarded-Proto
    # cannot claim https.
    settings = console_settings(pg_dsn, table, token=TOKEN, login_max_failures=2, login_lockout_seconds=600)
    with running_console(settings) as url, httpx.Client(base_url=url, follow_redirects=False) as http:
        https = {"X-Forwarded-Proto": "https"}
        login = http.post("/login", data={"name": "alice", "token": TOKEN}, headers=https)
        assert login.status_code == 303 and "secure" not in login.headers["set-cookie"].lower()
        for _ in range(2):
            assert http.get("/api/status", headers={"Authorization": "Bearer guess"}).status_code == 403
        assert http.get("/api/status", headers=dict(BEARER, **as_client("198.51.100.8"))).status_code == 429
    # A proxy listed that is not the one connecting: its headers are ignored too.
    settings = console_settings(pg_dsn, table, token=TOKEN, forwarded_allow_ips=["10.0.0.0/8"])
    with running_console(settings) as url, httpx.Client(base_url=url, follow_redirects=False) as http:
        login = http.post("/login", data={"name": "alice", "token": TOKEN}, headers={"X-Forwarded-Proto": "https"})
        assert login.status_code == 303 and "secure" not in login.headers["set-cookie"].lower()


def test_session_cookie_secure_behind_a_tls_proxy_or_always(store, pg_dsn, table):
    def attributes(set_cookie: str) -> set[str]:
        return {part.strip().split("=")[0].lower() for part in set_cookie.split(";")[1:]}

    settings = console_settings(pg_dsn, table, token=TOKEN, forwarded_allow_ips=["127.0.0.1"])
    with running_console(settings) as url, httpx.Client(base_url=url, follow_redirects=False) as http:
        # The proxy terminated TLS and says so: the cookie is Secure, HttpOnly, SameSite.
        login = http.post("/login", data={"name": "alice", "token": TOKEN}, headers={"X-Forwarded-Proto": "https"})
        assert login.status_code == 303
        assert {"secure", "httponly", "samesite", "path", "max-age"} <= attributes(login.headers["set-cookie"])
        assert "samesite=strict" in login.headers["set-cookie"].lower()
        session_id = login.headers["set-cookie"].split(";")[0].split("=", 1)[1]
        cookie = {"Cookie": f"{COOKIE}={session_id}", "X-Forwarded-Proto": "https"}
        page = http.get("/", headers=cookie)
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        logout = http.post("/logout", data={"csrf_token": csrf}, headers=cookie)
        assert logout.status_code == 303 and "secure" in attributes(logout.headers["set-cookie"])
        # The same proxy relaying plain http: no Secure flag (the browser would drop the cookie).
        plain = http.post("/login", data={"name": "alice", "token": TOKEN}, headers={"X-Forwarded-Proto": "http"})
        assert "secure" not in attributes(plain.headers["set-cookie"])
    settings = console_settings(pg_dsn, table, token=TOKEN, cookie_secure="always")
    with running_console(settings) as url, httpx.Client(base_url=url, follow_redirects=False) as http:
        login = http.post("/login", data={"name": "alice", "token": TOKEN})
        assert login.status_code == 303 and "secure" in attributes(login.headers["set-cookie"])


def test_wrong_tokens_are_logged_without_the_token(store, pg_dsn, table):
    import json

    guess = "guess-Zq81-never-logged"
    with console_process(
        pg_dsn,
        table,
        OUTBOX_RELAY_CONSOLE__TOKEN=TOKEN,
        OUTBOX_RELAY_CONSOLE__LOGIN_MAX_FAILURES="2",
        OUTBOX_RELAY_CONSOLE__LOGIN_LOCKOUT_SECONDS="600",
    ) as (url, lines):
        with httpx.Client(base_url=url, follow_redirects=False) as http:
            assert http.post("/login", data={"name": "alice", "token": TOKEN}).status_code == 303
            assert http.post("/login", data={"name": "mallory", "token": guess}).status_code == 401
            assert http.get("/api/status", headers={"Authorization": f"Bearer {guess}"}).status_code == 403
            for _ in range(3):
                assert http.get("/api/status", headers={"Authorization": f"Bearer {guess}"}).status_code == 429
    output = "".join(lines)
    assert guess not in output and TOKEN not in output
    events = [json.loads(line) for line in lines if line.startswith("{")]
    logins = [e for e in events if e["event"] == "console login"]
    assert [(e["user"], e["client"], e["level"]) for e in logins] == [("alice", "127.0.0.1", "info")]
    failed = [e for e in events if e["event"].startswith("console login failed")]
    assert [(e["via"], e["client"], e["failures"], e.get("locked_out_seconds"), e["level"]) for e in failed] == [
        ("form", "127.0.0.1", 1, None, "warning"),
        ("bearer", "127.0.0.1", 2, 600.0, "warning"),
    ]
    assert failed[0]["user"] == "mallory"
    refused = [e for e in events if e["event"].startswith("console login refused")]
    assert len(refused) == 1 and refused[0]["via"] == "bearer" and 1 <= refused[0]["retry_after_seconds"] <= 600


def test_bulk_pages_escape_hostile_text_and_every_action_needs_csrf(store, pg_dsn, table):
    hostile = "<script>document.title='pwned'</script>"
    ids = seed_dead(
        pg_dsn,
        table,
        3,
        event_type=f"Evt{hostile}",
        aggregate_prefix=f"agg{hostile}",
        aggregates=2,
        last_error=f"boom {hostile}",
    )
    with (
        running_console(console_settings(pg_dsn, table, token=TOKEN)) as url,
        httpx.Client(base_url=url, follow_redirects=False) as http,
    ):
        assert http.post("/login", data={"name": f"eve{hostile}", "token": TOKEN}).status_code == 303
        by_filter = {"action": "skip", "scope": "filter", "event_type": f"Evt{hostile}", "error_contains": "<script>"}
        pages = [
            http.get("/dead/preview", params=by_filter),
            http.get("/dead/preview", params={"action": "retry", "scope": "all"}),
            http.get("/dead", params={"event_type": f"Evt{hostile}"}),
        ]
        assert [page.status_code for page in pages] == [200, 200, 200]
        assert "3</strong> dead rows will be" in pages[0].text and "3</strong> dead rows will be" in pages[1].text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', pages[0].text).group(1)
        form = {**by_filter, "reason": f"why {hostile}"}

        # State-changing routes: without the session's CSRF token nothing changes.
        assert http.post("/dead/apply", data=form).status_code == 403
        assert (
            http.post("/api/dead/skip", json={"filter": {"event_type": f"Evt{hostile}"}, "reason": "x"}).status_code
            == 403
        )
        assert http.post("/api/dead/retry", json={"all": True}, headers={"X-CSRF-Token": "forged"}).status_code == 403
        cross_site = http.post(
            "/api/dead/retry", json={"all": True}, headers={"X-CSRF-Token": csrf, "Origin": "https://evil.example"}
        )
        assert cross_site.status_code == 403 and "evil.example" in cross_site.json()["error"]
        session_id = http.cookies[COOKIE]
        assert http.post("/logout", data={}).status_code == 303  # no CSRF token: the session is not ended
        http.cookies.set(COOKIE, session_id)
        assert http.get("/dead").status_code == 200
        assert {s for s, _ in row_states(pg_dsn, table, ids).values()} == {"dead"}

        done = http.post("/dead/apply", data=dict(form, csrf_token=csrf))
        assert done.status_code == 303, done.text
        assert {s for s, _ in row_states(pg_dsn, table, ids).values()} == {"done"}
        pages.append(http.get(done.headers["location"]))  # the audit page: actor, selector, reason
        pages.append(http.get(f"/rows/{ids[0]}"))  # last_error now names the hostile actor and reason
        for page in pages:
            assert page.status_code == 200
            assert "<script>document" not in page.text, page.text
            assert page.headers["content-security-policy"].startswith("default-src 'none'")
        assert "&lt;script&gt;document.title=" in pages[0].text  # event type, aggregates, filter pills
        assert "eve&lt;script&gt;" in pages[3].text and "why &lt;script&gt;" in pages[3].text
        audit = http.get("/api/audit").json()["entries"][0]
        assert (audit["actor"], audit["reason"]) == (f"eve{hostile}"[:100], f"why {hostile}")
        # Security headers on static assets and errors as well.
        for response in (http.get("/static/console.css"), http.get("/no-such-page"), http.get("/rows/999999")):
            assert response.headers["content-security-policy"].startswith("default-src 'none'")
            assert response.headers["x-frame-options"] == "DENY"
            assert response.headers["x-content-type-options"] == "nosniff"
