"""The operator console in a real headless Chromium (Debian's chromium +
chromium-driver, driven by Selenium), served by the real `outbox-relay console`
command: log in, filter the dead rows, preview and retry by filter, see the audit
entry, and check in PostgreSQL that exactly those rows changed; with several sources,
pick one from the list of sources and retry in it (and only in it); with many, sort,
page and filter the list and find a source whose name is HTML.

Skipped with a note where Chromium or its driver is not installed (`./dev test`
installs them). Set OUTBOX_RELAY_SCREENSHOTS=docs/images to save screenshots of the main
pages (the documentation site shows them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.helpers import sources as source_helpers
from tests.helpers.console import console_process as running_console_process
from tests.helpers.console import quoted, row_states, seed_dead

databases = source_helpers.databases  # the fixture

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = [pytest.mark.first_pass_only, pytest.mark.timeout(180)]

TOKEN = "browser-test-token"
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip(
            "Chromium and chromedriver are not installed (Debian: apt-get install chromium chromium-driver; "
            "./dev test installs them when it runs as root)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (test extra)")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="outbox-relay-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1366,860",
        "--lang=en-US",
    ):
        options.add_argument(flag)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager look for downloads
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def console_process(store, pg_dsn, table) -> Iterator[str]:
    """`outbox-relay console --port 0` as a subprocess; yields its base URL."""
    with running_console_process(
        pg_dsn, table, OUTBOX_RELAY_CONSOLE__TOKEN=TOKEN, OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES='["PaymentCaptured"]'
    ) as (url, _lines):
        yield url


def sign_in(driver: Any, url: str, name: str) -> None:
    """Open the console's overview, log in as ``name`` with the token, and wait for the overview."""
    from selenium.webdriver.common.by import By

    driver.get(url + "/")
    driver.find_element(By.ID, "name").send_keys(name)
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    navigate(driver, driver.find_element(By.ID, "login").click, to=url + "/", exact=True)


def navigate(driver: Any, action: Any, *, to: str, exact: bool = False) -> None:
    """Click and wait until the browser has arrived at a URL containing ``to`` (or equal
    to it): a click returns before the navigation it starts has finished."""
    from selenium.webdriver.support.ui import WebDriverWait

    def arrived(d: Any) -> bool:
        here = d.current_url
        return (here == to if exact else to in here) and d.execute_script("return document.readyState") == "complete"

    action()
    WebDriverWait(driver, 20, poll_frequency=0.05).until(arrived, message=f"the browser did not arrive at {to}")


def shoot(driver: Any, name: str) -> None:
    target = os.environ.get("OUTBOX_RELAY_SCREENSHOTS")
    if target:
        folder = ROOT / target if not Path(target).is_absolute() else Path(target)
        folder.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(folder / f"console-{name}.png"))


def test_operator_retries_by_filter_in_the_browser(browser, console_process, pg_dsn, table):
    from selenium.webdriver.common.by import By

    target = seed_dead(pg_dsn, table, 6, aggregates=3)  # what must be retried
    other_error = seed_dead(
        pg_dsn, table, 3, last_error="permanent: MSG_SIZE_TOO_LARGE", aggregate_prefix="refund-", aggregates=3
    )
    other_type = seed_dead(
        pg_dsn,
        table,
        4,
        event_type="OrderCreated",
        aggregate_type="order",
        aggregate_prefix="order-",
        payload={"note": "<script>document.title='pwned'</script>"},
        last_error="permanent: invalid record",
    )
    seed_dead(pg_dsn, table, 5, status="pending", aggregate_prefix="refund-", aggregates=3)  # behind dead heads
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # an hour of published history for the overview
        conn.execute(
            f"INSERT INTO {quoted(table)} (aggregate_type, aggregate_id, event_type, payload, status,"
            " created_at, done_at) SELECT 'order', 'order-' || g, 'OrderPaid', '{}', 'done',"
            " now() - make_interval(secs => g + 1), now() - make_interval(secs => g)"
            " FROM generate_series(1, 3500, 2) AS g"
        )
    b = browser
    url = console_process

    # Log in: every page needs the token; the name goes into the audit trail.
    b.get(url + "/dead")
    assert "/login" in b.current_url
    shoot(b, "login")
    b.find_element(By.ID, "name").send_keys("alice")
    b.find_element(By.ID, "token").send_keys(TOKEN)
    navigate(b, b.find_element(By.ID, "login").click, to="/dead")
    assert b.find_element(By.ID, "matched").text == "13"

    navigate(b, b.find_element(By.LINK_TEXT, "Overview").click, to=url + "/", exact=True)
    assert b.find_element(By.ID, "depth-dead").text == "13"
    assert b.find_element(By.ID, "depth-done").text == "1,750"
    shoot(b, "overview")

    # Filter: the PaymentCaptured rows that hit UNKNOWN_TOPIC.
    navigate(b, b.find_element(By.LINK_TEXT, "Dead rows").click, to="/dead")
    b.find_element(By.NAME, "event_type").send_keys("PaymentCaptured")
    b.find_element(By.NAME, "error_contains").send_keys("unknown_topic")
    navigate(b, b.find_element(By.ID, "apply-filter").click, to="error_contains=unknown_topic")
    assert b.find_element(By.ID, "matched").text == "6"
    listed = [int(e.get_attribute("value")) for e in b.find_elements(By.CSS_SELECTOR, "input[name=id]")]
    assert listed == target
    shoot(b, "dead-rows")

    # Preview, then confirm: nothing changes before the confirmation.
    navigate(b, b.find_element(By.ID, "retry-matching").click, to="/dead/preview")
    assert "6 dead rows will be" in b.find_element(By.ID, "preview-count").text
    assert {s for s, _ in row_states(pg_dsn, table, target).values()} == {"dead"}
    b.find_element(By.ID, "reason").send_keys("topic created after the deploy, OPS-42")
    shoot(b, "preview")
    navigate(b, b.find_element(By.ID, "confirm").click, to="/audit?done=")

    # The audit entry, and the rows really changed in PostgreSQL (only those).
    assert "Done" in b.find_element(By.ID, "done").text
    entry = b.find_element(By.CSS_SELECTOR, "tr.highlight")
    text = entry.text
    assert "alice" in text and "retry" in text and "OPS-42" in text and "PaymentCaptured" in text
    assert entry.find_element(By.CSS_SELECTOR, "td.changed").text == "6"
    shoot(b, "audit")
    assert set(row_states(pg_dsn, table, target).values()) == {("pending", 0)}
    assert {s for s, _ in row_states(pg_dsn, table, other_error + other_type).values()} == {"dead"}

    # A payload carrying a script is shown as text and never runs.
    b.get(f"{url}/rows/{other_type[0]}")
    assert "<script>document.title='pwned'</script>" in b.find_element(By.ID, "payload").text
    assert "pwned" not in b.title
    shoot(b, "row")

    # An aggregate blocked by its dead head says so; one whose head was retried is due.
    b.get(f"{url}/aggregates/pay-1")
    assert "is due" in b.find_element(By.ID, "verdict").text
    b.get(f"{url}/aggregates/refund-1")
    assert f"blocked by dead head {other_error[0]}" in b.find_element(By.ID, "verdict").text
    shoot(b, "aggregate")


def test_operator_picks_a_source_and_retries_in_it_in_the_browser(browser, databases):
    """A console of two sources: the list shows each one's queue, picking one leads to
    its overview, its dead rows and a retry that changes that source's rows only."""
    from selenium.webdriver.common.by import By

    dsn_a, dsn_b = databases("alpha"), databases("beta")
    table = "public.outbox"
    in_a = seed_dead(dsn_a, table, 2)
    in_b = seed_dead(dsn_b, table, 4, event_type="OrderCreated", aggregate_prefix="order-")
    env = {
        "OUTBOX_RELAY_SOURCES__ALPHA__DSN": dsn_a,
        "OUTBOX_RELAY_SOURCES__BETA__DSN": dsn_b,
        "OUTBOX_RELAY_CONSOLE__TOKEN": TOKEN,
    }
    with running_console_process(None, None, **env) as (url, _lines):
        b = browser
        sign_in(b, url, "bob")

        # The list of sources, each with its own queue.
        assert b.find_element(By.ID, "source-count").text == "2"
        rows = {
            r.find_element(By.CSS_SELECTOR, "a.source-link").text: r.find_element(By.CSS_SELECTOR, "td.dead").text
            for r in b.find_elements(By.CSS_SELECTOR, "#sources tbody tr")
        }
        assert rows == {"alpha": "2", "beta": "4"}
        shoot(b, "sources")

        # One source's pages: overview, then its dead rows through the navigation.
        navigate(b, b.find_element(By.LINK_TEXT, "beta").click, to="/?source=beta")
        assert b.find_element(By.ID, "source-name").text == "beta"
        assert b.find_element(By.ID, "depth-dead").text == "4"
        navigate(b, b.find_element(By.LINK_TEXT, "Dead rows").click, to="/dead?source=beta")
        assert b.find_element(By.ID, "matched").text == "4"
        listed = [int(e.get_attribute("value")) for e in b.find_elements(By.CSS_SELECTOR, "input[name=id]")]
        assert listed == in_b

        # Retry beta's rows: beta's change, audited in beta; alpha (same ids) untouched.
        navigate(b, b.find_element(By.ID, "retry-matching").click, to="/dead/preview")
        navigate(b, b.find_element(By.ID, "confirm").click, to="/audit?done=")
        assert "source=beta" in b.current_url
        assert b.find_element(By.CSS_SELECTOR, "tr.highlight td.changed").text == "4"
        assert set(row_states(dsn_b, table, in_b).values()) == {("pending", 0)}
        assert {s for s, _ in row_states(dsn_a, table, in_a).values()} == {"dead"}

        # Back to the list: beta has no dead row left, alpha still has its two.
        navigate(b, b.find_element(By.ID, "nav-sources").click, to=url + "/", exact=True)
        rows = {
            r.find_element(By.CSS_SELECTOR, "a.source-link").text: r.find_element(By.CSS_SELECTOR, "td.dead").text
            for r in b.find_elements(By.CSS_SELECTOR, "#sources tbody tr")
        }
        assert rows == {"alpha": "2", "beta": "0"}


def test_operator_finds_the_worst_of_many_sources_in_the_browser(browser, databases, pg_dsn):
    """A console of 12 sources (an outbox table each in one database) and a discovered
    database named with HTML: sort by dead rows, page through 5 at a time, filter by
    state, find the hostile one from the header's search, see its name as plain text
    (no script ran) and open its overview."""
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    from outbox_relay.db.store import OutboxStore
    from tests.helpers.db import ON_DONE

    schema = "browse_" + databases.prefix[4:]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    hostile = "<img src=x onerror=alert(1)>"
    hostile_dsn = databases(hostile)
    seed_dead(hostile_dsn, "public.outbox", 1)
    env = {
        "OUTBOX_RELAY_CONSOLE__TOKEN": TOKEN,
        "OUTBOX_RELAY_DISCOVERY__DSN": pg_dsn,
        "OUTBOX_RELAY_DISCOVERY__DATABASE_PATTERN": databases.prefix + "%",
    }
    dead_of = {}
    try:
        for i in range(12):
            table = f"{schema}.outbox_{i:02d}"
            with OutboxStore(pg_dsn, table, pool_size=1) as store:
                store.migrate(on_done=ON_DONE)
            dead_of[f"tenant_{i:02d}"] = (i * 5) % 7
            if dead_of[f"tenant_{i:02d}"]:
                seed_dead(pg_dsn, table, dead_of[f"tenant_{i:02d}"])
            env[f"OUTBOX_RELAY_SOURCES__TENANT_{i:02d}__DSN"] = pg_dsn
            env[f"OUTBOX_RELAY_SOURCES__TENANT_{i:02d}__TABLE"] = table
        hostile_name = f"{databases.prefix}_{hostile}"
        dead_of[hostile_name] = 1
        worst = [name for name, _ in sorted(dead_of.items(), key=lambda item: (-item[1], item[0]))]
        with running_console_process(None, None, **env) as (url, _lines):
            b = browser
            sign_in(b, url, "carol")
            assert b.find_element(By.ID, "source-count").text == "13"

            # Worst first by dead rows, five a page.
            Select(b.find_element(By.ID, "filter-sort")).select_by_value("dead")
            limit = b.find_element(By.NAME, "limit")
            limit.clear()
            limit.send_keys("5")
            navigate(b, b.find_element(By.ID, "apply-source-filter").click, to="sort=dead")

            def listed() -> list[str]:
                return [e.text for e in b.find_elements(By.CSS_SELECTOR, "#sources a.source-link")]

            assert listed() == worst[:5] and b.find_element(By.ID, "page-count").text == "3"
            shoot(b, "many-sources")
            navigate(b, b.find_element(By.ID, "next-page").click, to="page=2")
            assert listed() == worst[5:10]

            # Only the sources with dead rows (back to the first page, still five a page).
            Select(b.find_element(By.ID, "filter-state")).select_by_value("dead")
            navigate(b, b.find_element(By.ID, "apply-source-filter").click, to="state=dead")
            with_dead = [n for n in worst if dead_of[n]]
            assert 0 < len(with_dead) < 13 and b.find_element(By.ID, "matched-count").text == str(len(with_dead))
            assert listed() == with_dead[:5]

            # The header's search finds the hostile database; its name is text, no script ran.
            search = b.find_element(By.ID, "source-search")
            search.send_keys("onerror")
            navigate(b, lambda: search.send_keys(Keys.ENTER), to="q=onerror")
            assert listed() == [hostile_name]
            try:
                alert = b.switch_to.alert
            except NoAlertPresentException:
                alert = None
            assert alert is None, f"a script in a source name ran: {alert.text}"
            navigate(b, b.find_element(By.LINK_TEXT, hostile_name).click, to="/?source=")
            assert b.find_element(By.ID, "source-name").text == hostile_name
            assert b.find_element(By.ID, "depth-dead").text == "1"
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
