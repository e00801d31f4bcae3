"""The lock dashboard: its HTTP API on a real local server, and its
page end to end in Debian's headless ``chromium`` driven by Playwright.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Optional
from urllib.parse import quote
from wsgiref.util import shift_path_info

import dramatiq
import pytest

from dramatiq_unique import ConfigurationError, UniqueMiddleware
from dramatiq_unique.ops.admin import LockAdmin
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.dashboard import CSRF_HEADER, make_app
from dramatiq_unique.dashboard.server import make_server
from tests.conftest import free_port, missing_optional_tool, wait_for

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
MINUTE = 60_000


def new_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def run_key(prefix: str, actor: str, n: int) -> str:
    return f"{prefix}:{actor}:{{{n:032x}}}:run"


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Serve ``app`` from a real local HTTP server in a thread."""
    server = make_server(app, host="127.0.0.1", port=0, quiet=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def request(url: str, *, method: str = "GET", body: Optional[bytes] = None, headers: Optional[dict] = None):
    """(status, headers, JSON or text) of one request, errors included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers or {}, method=method), timeout=10) as r:
            status, got, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, got, raw = e.code, e.headers, e.read()
    is_json = got.get("Content-Type", "").startswith("application/json")
    return status, got, json.loads(raw) if is_json else raw.decode()


def release(url: str, payload: dict, **headers: str):
    body = json.dumps(payload).encode()
    return request(url + "api/release", method="POST", body=body, headers=headers)


# The HTTP API ---------------------------------------------------------


def test_release_needs_the_custom_header_a_json_body_and_a_same_origin_request(redis_backend, redis_client):
    # Given a lock and the dashboard
    prefix = new_prefix()
    key = run_key(prefix, "sync", 1)
    redis_backend.acquire(key, "m1/n", ttl=MINUTE)
    digest = {"digest": f"{1:032x}"}
    json_type = {"Content-Type": "application/json"}
    with serving(make_app(redis_backend, prefix=prefix)) as url:
        # When a release lacks any one of the three, then I expect it refused
        assert release(url, digest, **json_type)[0] == 403
        assert release(url, digest, **{CSRF_HEADER: "1", "Content-Type": "text/plain"})[0] == 415
        assert release(url, digest, **json_type, **{CSRF_HEADER: "1", "Sec-Fetch-Site": "same-site"})[0] == 403
        assert request(url + "api/release")[0] == 405
        assert redis_client.exists(key) == 1
        # And one with all three released
        status, _, body = release(url, digest, **json_type, **{CSRF_HEADER: "1", "Sec-Fetch-Site": "same-origin"})
    assert (status, body) == (200, {"released": [key]})
    assert redis_client.exists(key) == 0


def test_api_reports_unknown_digests_bad_requests_and_backend_failures(redis_backend):
    headers = {"Content-Type": "application/json", CSRF_HEADER: "1"}
    with serving(make_app(redis_backend, prefix=new_prefix())) as url:
        status, _, body = request(url + f"api/locks/{2:032x}")
        assert status == 404 and "No lock has digest" in body["error"]
        assert release(url, {"digest": f"{2:032x}"}, **headers)[0] == 404
        assert release(url, {"digest": 5}, **headers)[0] == 400
        assert release(url, {"digest": f"{2:032x}", "phase": "later"}, **headers)[0] == 400
        assert request(url + "nothing-here")[0] == 404
    down = RedisBackend(url=f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=2)
    with serving(make_app(down)) as url:
        status, _, body = request(url + "api/locks")
    assert status == 503 and "Connection refused" in body["error"]


def test_can_be_mounted_under_a_path_with_strict_headers(redis_backend):
    # Given the dashboard mounted at /ops/locks of a bigger app
    prefix = new_prefix()
    redis_backend.acquire(run_key(prefix, "sync", 3), "m/n", ttl=MINUTE)
    dashboard = make_app(redis_backend, prefix=prefix)

    def site(environ, start_response):
        if shift_path_info(environ) == "ops" and shift_path_info(environ) == "locks":
            return dashboard(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not here"]

    with serving(site) as url:
        no_redirect = urllib.request.build_opener(NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as moved:
            no_redirect.open(url + "ops/locks", timeout=10)
        status, headers, page = request(url + "ops/locks/")
        listed = request(url + "ops/locks/api/locks")[2]
    # Then I expect a redirect to the slash, the page, its API, and headers
    # that forbid framing and foreign scripts
    assert (moved.value.code, moved.value.headers["Location"]) == (301, "/ops/locks/")
    assert status == 200 and '<script src="dashboard.js" defer>' in page and "no authentication of its own" in page
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"] and "script-src" not in page
    assert [lock["digest"] for lock in listed["locks"]] == [f"{3:032x}"]


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any) -> None:
        return None


def test_listing_is_capped_at_the_limit(redis_backend):
    prefix = new_prefix()
    for n in range(5):
        redis_backend.acquire(run_key(prefix, "sync", n), "m/n", ttl=MINUTE)
    with serving(make_app(redis_backend, prefix=prefix, limit=3)) as url:
        listed = request(url + "api/locks")[2]
    assert (len(listed["locks"]), listed["truncated"]) == (3, True)


PASSWORD = "pw:" + uuid.uuid4().hex[:8] + "-\u00e9"  # a colon and a non-ASCII letter too


def basic(user: str, password: str) -> dict:
    """The ``Authorization`` header of HTTP Basic auth, in UTF-8."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_with_a_password_every_request_and_the_release_need_it(redis_backend, redis_client):
    # Given a lock and the dashboard with a password
    prefix = new_prefix()
    key = run_key(prefix, "sync", 4)
    redis_backend.acquire(key, "m1/n", ttl=MINUTE)
    digest = f"{4:032x}"
    release_headers = {"Content-Type": "application/json", CSRF_HEADER: "1", "Sec-Fetch-Site": "same-origin"}
    paths = ["", "api/view", "api/locks", f"api/locks/{digest}", "dashboard.js", "dashboard.css"]
    with serving(make_app(redis_backend, prefix=prefix, password=PASSWORD)) as url:
        # When a request has no password, a wrong one, or not as Basic auth, then I expect a 401 that
        # asks for it and shows no lock, and the lock kept
        wrong = [{}, basic("admin", "guess"), basic("admin", PASSWORD + "x"), basic(PASSWORD, ""),
                 {"Authorization": f"Bearer {PASSWORD}"}, {"Authorization": "Basic not-base64!"}]
        for headers in wrong:
            for path in paths:
                status, got, body = request(url + path, headers=headers)
                assert status == 401, (path, headers, status)
                assert got["WWW-Authenticate"] == 'Basic realm="dramatiq-unique", charset="UTF-8"'
                assert body == {"error": "This dashboard needs its password (HTTP Basic auth)."}
            status, got, body = release(url, {"digest": digest}, **release_headers, **headers)
            assert status == 401 and got["WWW-Authenticate"].startswith("Basic ") and "released" not in body
        assert redis_client.exists(key) == 1
        # And the icon, which shows nothing, needs none
        assert request(url + "favicon.ico")[0] == 200
        # When it has the password, with any user name, then I expect the page, the API and the release
        for user in ("admin", "", "someone else"):
            assert all(request(url + path, headers=basic(user, PASSWORD))[0] == 200 for path in paths)
        status, _, page = request(url, headers=basic("admin", PASSWORD))
        assert f'data-key="{key}"' in page and "This dashboard asks for its password." in page
        listed = request(url + "api/locks", headers=basic("admin", PASSWORD))[2]
        assert [lock["key"] for lock in listed["locks"]] == [key]
        status, _, body = release(url, {"digest": digest}, **release_headers, **basic("ops", PASSWORD))
    assert (status, body) == (200, {"released": [key]})
    assert redis_client.exists(key) == 0


def test_the_password_comes_from_the_environment_unless_given(redis_backend, monkeypatch):
    monkeypatch.setenv("DRAMATIQ_UNIQUE_DASHBOARD_PASSWORD", "from-env")
    prefix = new_prefix()
    with serving(make_app(redis_backend, prefix=prefix)) as url:
        assert request(url + "api/locks")[0] == 401
        assert request(url + "api/locks", headers=basic("admin", "from-env"))[0] == 200
    with serving(make_app(redis_backend, prefix=prefix, password=PASSWORD)) as url:
        assert request(url + "api/locks", headers=basic("admin", "from-env"))[0] == 401
        assert request(url + "api/locks", headers=basic("admin", PASSWORD))[0] == 200
    monkeypatch.delenv("DRAMATIQ_UNIQUE_DASHBOARD_PASSWORD")
    with serving(make_app(redis_backend, prefix=prefix)) as url:
        assert request(url + "api/locks")[0] == 200  # unset: no password, as before
    for bad in ("", "\udcff" + PASSWORD, b"bytes"):
        with pytest.raises(ConfigurationError) as refused:
            make_app(redis_backend, password=bad)
        assert "password=(not shown) is invalid" in str(refused.value) and PASSWORD not in str(refused.value)


# The page, in a real browser -----------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        missing_optional_tool(f"{CHROMIUM} is missing: the page tests need it; run `apt-get install chromium` "
                              "(.ci/run installs it).")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing_optional_tool("Playwright is missing: the page tests need it; run `pip install playwright` "
                              "(no `playwright install`: the tests drive Debian's chromium).")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()
    opened = context.new_page()
    opened.set_default_timeout(15_000)
    yield opened
    context.close()


def seconds_left(text: str) -> float:
    """Seconds in a countdown such as ``49.8 s`` or ``1 min 05 s``."""
    found = re.fullmatch(r"(?:(\d+) min )?(\d+(?:\.\d+)?) s", text.strip())
    assert found, f"not a countdown: {text!r}"
    return int(found[1] or 0) * 60 + float(found[2])


def test_page_shows_a_lock_counting_down_and_releases_it_after_confirmation(
    stub_broker, redis_backend, redis_client, page
):
    from playwright.sync_api import expect

    # Given a lock the middleware took at enqueue, with its lock args recorded
    prefix = new_prefix()
    unique = UniqueMiddleware(backend=redis_backend, prefix=prefix, record_lock_args=True)
    stub_broker.add_middleware(unique)

    @dramatiq.actor(broker=stub_broker, lock="until_executed", lock_args=["account_id"], lock_ttl=50_000)
    def sync_account_balance(account_id, requested_at):
        pass

    message = sync_account_balance.send(42, time.time())
    assert unique.flush_confirmations()  # its deadline is final: lock_ttl, not the provisional window
    (key,) = [k.decode() for k in redis_client.scan_iter(f"{prefix}:*")]

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        # When I open the dashboard
        page.goto(url)
        row = page.locator(f'tr.lock[data-key="{key}"]')

        # Then I expect the lock, its holder, and its deadline counting down
        expect(row).to_contain_text("sync_account_balance")
        expect(row).to_contain_text("until_executed")
        expect(row.locator("td.args")).to_have_text("account_id: 42")
        expect(row.locator("li.holder")).to_contain_text(message.message_id)
        expect(row.locator("li.holder .age")).to_contain_text("age ")
        expect(row.locator("li.holder .provisional")).to_have_count(0)
        # (one element, so a refresh of the list cannot pass for the countdown)
        countdown = row.locator("li.holder .remaining").element_handle()
        first = seconds_left(countdown.inner_text())
        deadline = int(redis_client.hget(key, message.message_id))
        assert abs(first - (deadline - time.time() * 1000) / 1000) < 3
        wait_for(lambda: seconds_left(countdown.inner_text()) <= first - 1, timeout=4, what="the countdown to go down")

        # When I ask to release it and cancel, then I expect nothing released
        dialog = page.locator("dialog#confirm")
        row.get_by_role("button", name="Release lock").click()
        expect(dialog).to_be_visible()
        expect(dialog).to_contain_text(key)
        dialog.get_by_role("button", name="Cancel").click()
        expect(dialog).to_be_hidden()
        assert redis_client.exists(key) == 1
        expect(row).to_have_count(1)

        # When I ask again and confirm, then I expect it gone from the page and from Redis
        row.get_by_role("button", name="Release lock").click()
        dialog.get_by_role("button", name="Release", exact=True).click()
        expect(row).to_have_count(0)
        expect(page.locator("#notice")).to_contain_text(f"Released {key}")
        assert redis_client.exists(key) == 0


def test_page_releases_one_holder_and_keeps_the_other(redis_backend, redis_client, page):
    from playwright.sync_api import expect

    # Given a run lock with two holders
    prefix = new_prefix()
    key = run_key(prefix, "resize_image", 7)
    for owner in ("m1/n1", "m2/n2"):
        assert redis_backend.acquire(key, owner, ttl=MINUTE, limit=2, lock="while_executing").acquired

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.goto(url)
        row = page.locator(f'tr.lock[data-key="{key}"]')
        first = row.locator('li.holder[data-owner="m1/n1"]')

        # When I release the first holder, confirming
        first.get_by_role("button", name="Release holder").click()
        expect(page.locator("dialog#confirm")).to_contain_text("m1/n1")
        page.locator("dialog#confirm").get_by_role("button", name="Release", exact=True).click()

        # Then I expect only the second holder, on the page and in Redis
        expect(first).to_have_count(0)
        expect(row.locator("li.holder")).to_have_count(1)
        expect(row.locator('li.holder[data-owner="m2/n2"]')).to_be_visible()
    assert not redis_client.hexists(key, "m1/n1")
    assert redis_client.hexists(key, "m2/n2")


def test_page_filters_by_actor_and_keeps_the_filter_in_its_url(redis_backend, page):
    from playwright.sync_api import expect

    prefix = new_prefix()
    redis_backend.acquire(run_key(prefix, "send_invoice", 1), "m1/n", ttl=MINUTE)
    redis_backend.acquire(run_key(prefix, "send_reminder", 2), "m2/n", ttl=MINUTE)

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.goto(url)
        expect(page.locator("tr.lock")).to_have_count(2)
        page.locator("#actor").select_option("send_invoice")
        expect(page.locator("tr.lock")).to_have_count(1)
        expect(page.locator("tr.lock")).to_contain_text("send_invoice")
        expect(page).to_have_url(url + "?actor=send_invoice")

        page.reload()
        expect(page.locator("#actor")).to_have_value("send_invoice")
        expect(page.locator("tr.lock")).to_have_count(1)


def test_a_page_of_another_origin_cannot_release_a_lock(redis_backend, redis_client, page):
    # Given a lock, the dashboard recording what reaches it, and a page of
    # another origin
    prefix = new_prefix()
    key = run_key(prefix, "sync", 8)
    redis_backend.acquire(key, "m/n", ttl=MINUTE)
    dashboard = make_app(redis_backend, prefix=prefix)
    arrived: list[tuple[str, str, Optional[str]]] = []

    def recording(environ, start_response):
        arrived.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("HTTP_X_DRAMATIQ_UNIQUE")))
        return dashboard(environ, start_response)

    def other_site(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/html")])
        return [b"<!doctype html><title>elsewhere</title>"]

    with serving(recording) as target, serving(other_site) as elsewhere:
        page.goto(elsewhere)

        # When its script posts a simple request, and one with our header
        outcome = page.evaluate(
            """async ([url, digest, header]) => {
              const body = JSON.stringify({digest});
              const outcome = {};
              try {
                await fetch(url, {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body});
                outcome.simple = "sent";
              } catch (e) { outcome.simple = "failed"; }
              try {
                const headers = {"Content-Type": "application/json", [header]: "1"};
                const r = await fetch(url, {method: "POST", headers, body});
                outcome.preflighted = "status " + r.status;
              } catch (e) { outcome.preflighted = "blocked"; }
              return outcome;
            }""",
            [target + "api/release", f"{8:032x}", CSRF_HEADER],
        )

    # Then I expect the simple one refused by the dashboard, the other
    # stopped by the browser after its preflight, and the lock still held
    assert outcome == {"simple": "sent", "preflighted": "blocked"}
    assert ("POST", "/api/release", None) in arrived
    assert ("OPTIONS", "/api/release", None) in arrived
    assert ("POST", "/api/release", "1") not in arrived
    assert redis_client.exists(key) == 1


def test_page_marks_a_provisional_enqueue_lock_and_shows_its_age(redis_backend, page):
    from playwright.sync_api import expect

    # Given an enqueue lock whose publish is not confirmed yet, and a confirmed one
    prefix = new_prefix()
    pending, confirmed = (f"{prefix}:job:{{{c * 32}}}:queue" for c in "ab")
    redis_backend.acquire(pending, "m1", ttl=86_400_000, lock="until_executed", provisional=60_000, where="")
    redis_backend.acquire(confirmed, "m2", ttl=86_400_000, lock="until_executed", provisional=60_000, where="")
    redis_backend.confirm([(confirmed, "m2", 86_400_000)])

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        # When I open the dashboard
        page.goto(url)
        # Then the provisional one is marked so, with its age; the confirmed one is not marked
        expect(page.locator(f'tr.lock[data-key="{pending}"] li.holder .provisional')).to_have_text("provisional")
        expect(page.locator(f'tr.lock[data-key="{pending}"] li.holder .age')).to_contain_text("age ")
        expect(page.locator(f'tr.lock[data-key="{confirmed}"] li.holder .provisional')).to_have_count(0)


def test_page_shows_waiting_messages_and_fits_1000_px(stub_broker, redis_backend, page):
    from playwright.sync_api import expect

    # Given a long-named actor whose run lock is held, a second message
    # rescheduled behind it holding the enqueue lock, and its lock args recorded
    prefix = new_prefix()
    middleware = UniqueMiddleware(backend=redis_backend, prefix=prefix, record_lock_args=True,
                                  reschedule_delay=60_000)
    stub_broker.add_middleware(middleware)
    gate, started = threading.Event(), threading.Event()

    def reconcile_customer_ledger_entries(account_id, currency, requested_by):
        started.set()
        gate.wait(30)

    actor = dramatiq.actor(reconcile_customer_ledger_entries, broker=stub_broker, lock="until_and_while_executing",
                           lock_args=["account_id", "currency", "requested_by"])
    args = (42, "EUR", "finance-operations-team@accounts.example.com")
    actor.send(*args)
    worker = dramatiq.Worker(stub_broker, worker_timeout=50, worker_threads=3)
    worker.start()
    try:
        assert started.wait(10)
        waiting = actor.send(*args).message_id
        wait_for(lambda: middleware.events.count("rescheduled") == 1, what="the second message to wait")

        with serving(make_app(redis_backend, prefix=prefix)) as url:
            # When I open the dashboard in a 1000 px wide window
            page.set_viewport_size({"width": 1000, "height": 900})
            page.goto(url)
            run_row = page.locator('tr.lock[data-phase="run"]')
            queue_row = page.locator('tr.lock[data-phase="queue"]')
            # Then I expect the waiting message, readable lock args, and
            # the page no wider than the window
            expect(run_row.locator(f'li.waiter[data-message-id="{waiting}"]')).to_be_visible()
            expect(run_row.locator("li.waiter")).to_have_count(1)
            expect(queue_row.locator("td.args li")).to_have_text(
                ["account_id: 42", 'currency: "EUR"', f'requested_by: "{args[2]}"'])
            widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px window"
            if os.environ.get("DASHBOARD_SCREENSHOT"):  # a PNG path, to look at the page
                page.screenshot(path=os.environ["DASHBOARD_SCREENSHOT"])
    finally:
        gate.set()
        worker.stop()


def test_the_access_log_skips_the_pages_own_refreshes(redis_backend, capfd):
    # Given the dashboard on the command's server, which logs requests
    prefix = new_prefix()
    redis_backend.acquire(run_key(prefix, "sync", 9), "m/n", ttl=MINUTE)
    server = make_server(make_app(redis_backend, prefix=prefix), host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}/"
    try:
        # When the page loads, refreshes three times, and a release fails
        assert request(url)[0] == 200
        for _ in range(3):
            assert request(url + "api/locks")[0] == 200
            assert request(url + "api/view?sort=actor")[0] == 200
        assert release(url, {"digest": f"{9:032x}"}, **{CSRF_HEADER: "1"})[0] == 415
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    # Then the log has the page load and the refused release, not the refreshes
    log = capfd.readouterr().err
    assert '"GET / HTTP/1.1" 200' in log
    assert "\"POST /api/release HTTP/1.1\" 415" in log
    assert "/api/locks" not in log and "/api/view" not in log


# Sorting, filters, totals, identifiers, actions, favicon, first response ---


WIDTHS = [1000, 1400]


def row_keys(page: Any) -> list[str]:
    return page.eval_on_selector_all("tr.lock", "rows => rows.map(row => row.dataset.key)")


def wait_for_order(page: Any, expected: list[str], what: str) -> None:
    wait_for(lambda: row_keys(page) == expected, timeout=10, what=what)


def enqueue_locks(stub_broker: Any, redis_backend: Any, redis_client: Any, prefix: str,
                  sends: list[tuple[str, str, Any]]) -> list[str]:
    """Take enqueue locks through the middleware, one send per (actor
    name, lock type, lock arg), 30 ms apart so their ages differ.
    Returns the lock key of each send, in order."""
    unique = UniqueMiddleware(backend=redis_backend, prefix=prefix, record_lock_args=True)
    stub_broker.add_middleware(unique)
    actors: dict[str, Any] = {}
    keys = []
    for name, lock, value in sends:
        if name not in actors:
            def job(account, note):
                pass

            job.__name__ = name
            actors[name] = dramatiq.actor(job, broker=stub_broker, actor_name=name, lock=lock, lock_args=["account"],
                                          lock_ttl=600_000)
        before = {k.decode() for k in redis_client.scan_iter(f"{prefix}:*")}
        actors[name].send(value, "note")
        (key,) = {k.decode() for k in redis_client.scan_iter(f"{prefix}:*")} - before
        keys.append(key)
        time.sleep(0.03)
    assert unique.flush_confirmations()
    return keys


@pytest.mark.parametrize("width", WIDTHS)
def test_clicking_a_header_sorts_the_rows(stub_broker, redis_backend, redis_client, page, width):
    from playwright.sync_api import expect

    # Given three enqueue locks taken oldest first as charlie, alpha,
    # bravo, and a run lock with two holders
    prefix = new_prefix()
    charlie, alpha, bravo = enqueue_locks(stub_broker, redis_backend, redis_client, prefix, [
        ("charlie_sync", "until_executed", 1), ("alpha_sync", "until_executed", 2), ("bravo_sync", "until_expired", 3),
    ])
    delta = run_key(prefix, "delta_resize", 4)
    for owner in ("m1/n1", "m2/n2"):
        assert redis_backend.acquire(delta, owner, ttl=MINUTE, limit=2, lock="while_executing").acquired

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(url)
        # Then by default the oldest comes first
        expect(page.locator("th.c-age")).to_have_attribute("aria-sort", "descending")
        keys = row_keys(page)
        assert [k for k in keys if k != delta] == [charlie, alpha, bravo]

        # When I click Actor, then A to Z; again, Z to A
        page.locator("th.c-actor a.sort").click()
        wait_for_order(page, [alpha, bravo, charlie, delta], "actors A to Z")
        expect(page.locator("th.c-actor")).to_have_attribute("aria-sort", "ascending")
        assert "sort=actor" in page.url
        page.locator("th.c-actor a.sort").click()
        wait_for_order(page, [delta, charlie, bravo, alpha], "actors Z to A")

        # When I click Holders, then the lock with two comes first
        page.locator("th.c-holders a.sort").click()
        wait_for_order(page, [delta, alpha, bravo, charlie], "most holders first")
        # When I click Lock, then by lock type: until_executed, until_expired, while_executing
        page.locator("th.c-lock a.sort").click()
        wait_for_order(page, [alpha, charlie, bravo, delta], "lock types A to Z")
        # When I click Expires, then the run lock (a minute) before the enqueue locks (10 minutes),
        # soonest deadline first as Redis has them
        admin = LockAdmin(redis_backend, prefix=prefix)
        deadlines = {lock.key: min(h.deadline for h in lock.holders) for lock in admin.locks()}
        by_deadline = sorted(deadlines, key=lambda key: (deadlines[key], key))
        assert by_deadline[0] == delta
        page.locator("th.c-expires a.sort").click()
        wait_for_order(page, by_deadline, "soonest expiry first")

        # And a reload keeps the order, rendered by the server
        page.reload()
        assert row_keys(page) == by_deadline


@pytest.mark.parametrize("width", WIDTHS)
def test_filters_narrow_the_rows_and_the_totals(stub_broker, redis_backend, redis_client, page, width):
    from playwright.sync_api import expect

    # Given two locks of one actor and lock type, one of another
    prefix = new_prefix()
    acme, globex, initech = enqueue_locks(stub_broker, redis_backend, redis_client, prefix, [
        ("sync_ledger", "until_executed", "acme-corp"), ("sync_ledger", "until_executed", "globex"),
        ("send_mail", "until_expired", "initech"),
    ])
    digest = initech.split("{")[1].split("}")[0]

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(url)
        actors = page.locator('[data-totals="actor"] li')
        types = page.locator('[data-totals="type"] li')
        expect(page.locator("#total-locks")).to_have_text("3")
        expect(actors).to_have_count(2)
        expect(page.locator('[data-totals="actor"]')).to_contain_text("sync_ledger")

        # When I choose an actor, then only its rows, and totals of them only
        page.locator("#actor").select_option("sync_ledger")
        expect(page.locator("tr.lock")).to_have_count(2)
        expect(page.locator("#total-locks")).to_have_text("2")
        expect(page.locator("#total-holders")).to_have_text("2")
        expect(actors).to_have_count(1)
        expect(types).to_have_text([re.compile(r"^until_executed\s*2\s*2$")])

        # and the lock types it uses to choose from
        expect(page.locator("#type option")).to_have_text(["All lock types", "until_executed"])

        # When I also search for a lock arg of another actor, then nothing
        page.locator("#q").fill("initech")
        expect(page.locator("tr.lock")).to_have_count(0)
        expect(page.locator("tr.empty")).to_contain_text("No lock matches")
        expect(page.locator("#total-locks")).to_have_text("0")

        # When I clear them and choose a lock type, then its lock only
        page.get_by_role("button", name="Clear").click()
        page.locator("#type").select_option("until_expired")
        expect(page.locator("tr.lock")).to_have_count(1)
        expect(page.locator(f'tr.lock[data-key="{initech}"]')).to_have_count(1)
        expect(page.locator("#total-locks")).to_have_text("1")
        expect(actors).to_have_text([re.compile(r"^send_mail\s*1\s*1$")])

        # When I clear them and search lock args, then the one lock with that value
        page.get_by_role("button", name="Clear").click()
        expect(page.locator("tr.lock")).to_have_count(3)
        page.locator("#q").fill("GLOBEX")
        expect(page.locator("tr.lock")).to_have_count(1)
        expect(page.locator(f'tr.lock[data-key="{globex}"]')).to_have_count(1)
        expect(page.locator("#total-locks")).to_have_text("1")
        # And a digest prefix finds its lock
        page.locator("#q").fill(digest[:12])
        expect(page.locator("tr.lock")).to_have_count(1)
        expect(page.locator(f'tr.lock[data-key="{initech}"]')).to_have_count(1)
        assert f"q={digest[:12]}" in page.url

        # When I click an actor in the totals, then it filters by that actor
        page.get_by_role("button", name="Clear").click()
        expect(page.locator("tr.lock")).to_have_count(3)
        page.locator('[data-totals="actor"] a.facet', has_text="send_mail").click()
        expect(page.locator("tr.lock")).to_have_count(1)
        expect(page.locator("#actor")).to_have_value("send_mail")
        expect(page.locator(f'tr.lock[data-key="{acme}"]')).to_have_count(0)


@pytest.mark.parametrize("width", WIDTHS)
def test_identifiers_keep_one_line_with_their_whole_value_in_a_tooltip(stub_broker, redis_backend, redis_client,
                                                                         page, width):
    # Given a long-named actor's enqueue and run locks (until_and_while_executing)
    prefix = new_prefix()
    (queue_key,) = enqueue_locks(stub_broker, redis_backend, redis_client, prefix, [
        ("reconcile_customer_ledger_entries_for_the_quarter", "until_and_while_executing", 42)])
    run = queue_key[: -len(":queue")] + ":run"
    owner = f"{uuid.uuid4()}/{uuid.uuid4().hex}"
    assert redis_backend.acquire(run, owner, ttl=MINUTE, lock="until_and_while_executing").acquired

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(url)
        page.locator("tr.lock").nth(1).wait_for()
        cells = page.eval_on_selector_all(
            "td.c-actor .clip, td.c-lock .clip, code.digest, code.message-id",
            """nodes => nodes.map(node => {
              const style = getComputedStyle(node);
              return {text: node.textContent, title: node.title, whiteSpace: style.whiteSpace,
                      height: node.getBoundingClientRect().height, lineHeight: parseFloat(style.lineHeight),
                      clipped: node.scrollWidth > node.clientWidth};
            })""",
        )
        widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    # Then each is one line (no taller than a line), keeps its whole text
    # and shows it in its tooltip
    texts = {cell["text"] for cell in cells}
    assert {"until_and_while_executing", queue_key.split("{")[1][:32], owner.split("/")[0]} <= texts
    assert len(cells) == 2 * 4  # actor, lock name, digest, holder id on each of the two rows
    for cell in cells:
        assert cell["whiteSpace"] == "nowrap", cell
        assert cell["height"] < 1.5 * cell["lineHeight"], f"{cell['text']!r} wraps: {cell}"
        assert cell["title"] == cell["text"], cell
    # and the long actor name is ellipsized rather than widening the page
    assert any(cell["clipped"] for cell in cells if cell["text"].startswith("reconcile_"))
    assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px window"


@pytest.mark.parametrize("width", WIDTHS)
def test_every_release_is_confirmed_in_the_same_place_for_run_and_queue_locks(
    stub_broker, redis_backend, redis_client, page, width
):
    from playwright.sync_api import expect

    # Given an enqueue lock and a run lock with two holders
    prefix = new_prefix()
    (queue_key,) = enqueue_locks(stub_broker, redis_backend, redis_client, prefix, [
        ("sync_ledger", "until_executed", "acme-corp")])
    run = run_key(prefix, "resize_image", 5)
    for owner in ("m1/n1", "m2/n2"):
        assert redis_backend.acquire(run, owner, ttl=MINUTE, limit=2, lock="while_executing").acquired

    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(url)
        dialog = page.locator("dialog#confirm")
        queue_row = page.locator(f'tr.lock[data-key="{queue_key}"]')
        run_row = page.locator(f'tr.lock[data-key="{run}"]')
        # Then both rows have their lock release in the actions cell and a
        # holder release on each holder
        for row, holders in ((queue_row, 1), (run_row, 2)):
            expect(row.locator("td.c-actions button")).to_have_text(["Release lock"])
            expect(row.locator("li.holder button.release-holder")).to_have_count(holders)
            expect(row.locator("button", has_text="Release")).to_have_count(holders + 1)
        # and each holder release sits in the same place, on a line of its own under the holder's
        # details and at its right edge, whatever the lock's phase and details
        for holder in page.locator("li.holder").all():
            item, meta = holder.bounding_box(), holder.locator(".meta").bounding_box()
            button = holder.locator("button.release-holder").bounding_box()
            assert item and meta and button
            assert button["y"] >= meta["y"] + meta["height"] - 1, (button, meta)
            assert abs((button["x"] + button["width"]) - (item["x"] + item["width"])) <= 2, (button, item)

        # When I release the queue lock's holder and cancel, then it stays
        queue_row.get_by_role("button", name="Release holder").click()
        expect(dialog).to_be_visible()
        expect(dialog).to_contain_text(queue_key)
        dialog.get_by_role("button", name="Cancel").click()
        expect(dialog).to_be_hidden()
        assert redis_client.exists(queue_key) == 1
        # and when I accept, it is gone
        queue_row.get_by_role("button", name="Release holder").click()
        dialog.get_by_role("button", name="Release", exact=True).click()
        expect(queue_row).to_have_count(0)
        assert redis_client.exists(queue_key) == 0

        # When I release the whole run lock and cancel, then both holders stay
        run_row.get_by_role("button", name="Release lock").click()
        expect(dialog).to_contain_text("2 holders")
        page.keyboard.press("Escape")
        expect(dialog).to_be_hidden()
        assert redis_client.hlen(run) >= 2 and redis_client.hexists(run, "m1/n1")
        # and when I accept, the key is gone
        run_row.get_by_role("button", name="Release lock").click()
        dialog.get_by_role("button", name="Release", exact=True).click()
        expect(run_row).to_have_count(0)
        expect(page.locator("#notice")).to_contain_text(f"Released {run}")
        assert redis_client.exists(run) == 0


def test_no_page_load_meets_a_404_and_the_favicon_is_served(redis_backend, page):
    prefix = new_prefix()
    redis_backend.acquire(run_key(prefix, "sync", 1), "m/n", ttl=MINUTE)
    responses: list[tuple[int, str]] = []
    page.on("response", lambda response: responses.append((response.status, response.url)))
    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.goto(url)
        page.wait_for_load_state("networkidle")
        icon = page.eval_on_selector('link[rel="icon"]', "link => link.href")
        fetched = page.evaluate(
            "async (urls) => Promise.all(urls.map(async (u) => { const r = await fetch(u); "
            "return [r.status, r.headers.get('content-type'), (await r.text()).slice(0, 4)]; }))",
            [icon, url + "favicon.ico"],
        )
    failed = [(status, got) for status, got in responses if status >= 400]
    assert not failed, f"page load requests failed: {failed}"
    assert {got for _, got in responses} >= {url, url + "dashboard.js", url + "dashboard.css", url + "favicon.svg"}
    assert fetched == [[200, "image/svg+xml", "<svg"], [200, "image/svg+xml", "<svg"]]


def test_the_first_response_already_holds_the_locks(stub_broker, redis_backend, redis_client, browser):
    from playwright.sync_api import expect

    # Given an enqueue lock taken through the middleware
    prefix = new_prefix()
    (key,) = enqueue_locks(stub_broker, redis_backend, redis_client, prefix, [("sync_ledger", "until_executed", 7)])
    digest = key.split("{")[1][:32]
    with serving(make_app(redis_backend, prefix=prefix)) as url:
        # When I fetch the page, then its HTML has the row, the totals and the filter choices
        status, _, html = request(url + "?sort=actor")
        # And a browser without JavaScript shows it too
        context = browser.new_context(java_script_enabled=False)
        try:
            page = context.new_page()
            page.goto(url)
            expect(page.locator(f'tr.lock[data-key="{key}"] td.args')).to_have_text("account: 7")
            expect(page.locator("#total-locks")).to_have_text("1")
        finally:
            context.close()
    assert status == 200
    assert f'data-digest="{digest}"' in html and f'title="{digest}"' in html
    assert '<span id="total-locks">1</span>' in html
    assert '<option value="sync_ledger">sync_ledger</option>' in html
    assert 'th scope="col" class="c-actor sorted" aria-sort="ascending"' in html
    assert "Loading" not in html


def test_auto_refresh_shows_when_it_ran_and_pauses(redis_backend, page):
    from playwright.sync_api import expect

    prefix = new_prefix()
    redis_backend.acquire(run_key(prefix, "sync", 1), "m/n", ttl=MINUTE)
    with serving(make_app(redis_backend, prefix=prefix)) as url:
        page.goto(url)
        refreshed = page.locator("#refreshed")
        first = refreshed.get_attribute("datetime") or refreshed.inner_text()
        # When a lock is taken, then the next refresh shows it and its time
        redis_backend.acquire(run_key(prefix, "sync", 2), "m/n", ttl=MINUTE)
        expect(page.locator("tr.lock")).to_have_count(2, timeout=8_000)
        assert refreshed.get_attribute("datetime") not in (None, first)
        # When I pause, then no refresh shows a new lock
        page.get_by_role("button", name="Pause").click()
        expect(page.locator("#live")).to_have_attribute("data-state", "paused")
        expect(page.locator("#refresh-state")).to_have_text("Auto-refresh paused")
        redis_backend.acquire(run_key(prefix, "sync", 3), "m/n", ttl=MINUTE)
        page.wait_for_timeout(6_000)
        expect(page.locator("tr.lock")).to_have_count(2)
        # When I resume, then it refreshes at once
        page.get_by_role("button", name="Resume").click()
        expect(page.locator("#live")).to_have_attribute("data-state", "live")
        expect(page.locator("tr.lock")).to_have_count(3, timeout=2_000)


class FakeAdmin:
    """Locks as a newer or older LockAdmin reports them."""

    prefix = "fake"

    def __init__(self, locks: list[dict]) -> None:
        self.data = locks

    def locks(self, **_: Any) -> Iterator[Any]:
        for data in self.data:
            yield type("FakeLock", (), {"as_dict": lambda self, data=data: data})()


def test_a_run_lock_shows_its_age_when_its_holders_record_when_they_took_it(redis_backend):
    from dramatiq_unique.dashboard import Dashboard

    now = int(time.time() * 1000)

    def lock(n: int, **fields: Any) -> dict:
        return {"key": f"fake:job:{{{n:032x}}}:run", "digest": f"{n:032x}", "actor": "job", "phase": "run",
                "lock": "while_executing", **fields}

    recorded = lock(1, holders=[{"owner": "m1/n", "message_id": "m1", "deadline": now + MINUTE,
                                 "taken_at": now - 90_000, "queue": "default"}], waiting=[])
    own = lock(2, taken_at=now - 3 * MINUTE, holders=[{"owner": "m2/n", "message_id": "m2", "deadline": now + MINUTE}])
    unknown = lock(3, holders=[{"owner": "m3/n", "message_id": "m3", "deadline": now + MINUTE}])
    bare = {"key": f"fake:job:{{{4:032x}}}:queue", "digest": f"{4:032x}"}  # an older admin's sparse dict
    app = Dashboard(FakeAdmin([unknown, recorded, own, bare]))  # type: ignore[arg-type]
    with serving(app) as url:
        status, _, html = request(url)
        listing = request(url + "api/locks")[2]
    assert status == 200
    rows = re.findall(r'<tr class="lock" data-key="([^"]+)".*?<td class="c-age">(.*?)</td>', html)
    # Then the lock's own time or its holder's gives its age, oldest first; unknown ones show "?" last
    assert [(key.split("{")[1][:32], "?" if ">?<" in age else "known") for key, age in rows] == [
        (f"{2:032x}", "known"), (f"{1:032x}", "known"), (f"{3:032x}", "?"), (f"{4:032x}", "?")]
    assert f'data-taken="{now - 3 * MINUTE}"' in rows[0][1] and f'data-taken="{now - 90_000}"' in rows[1][1]
    assert "1 min 30 s" in rows[1][1]
    assert 'title="published to default"' in html
    assert [lock["digest"] for lock in listing["locks"]] == [f"{n:032x}" for n in (2, 1, 3, 4)]


def test_the_page_asks_for_the_password_and_keeps_refreshing_with_it(redis_backend, redis_client, browser):
    from playwright.sync_api import Error, expect

    prefix = new_prefix()
    first, second = run_key(prefix, "sync", 1), run_key(prefix, "sync", 2)
    redis_backend.acquire(first, "m/n", ttl=MINUTE)
    with serving(make_app(redis_backend, prefix=prefix, password=PASSWORD)) as url:
        port = url.split(":")[-1].rstrip("/")
        logins = {
            # The browser answers the 401 with the password it is given, as after its own prompt
            "prompt": ({"http_credentials": {"username": "admin", "password": PASSWORD}}, url),
            # A link with the password in it: the page's own requests go without it in their URL
            "link": ({}, f"http://admin:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/"),
        }
        for n, (login, (options, address)) in enumerate(logins.items()):
            context = browser.new_context(**options)
            try:
                page = context.new_page()
                page.set_default_timeout(15_000)
                statuses: list[int] = []
                page.on("response", lambda response, seen=statuses: seen.append(response.status))
                page.goto(address)
                expect(page.locator(f'tr.lock[data-key="{first}"]')).to_have_count(1)
                # When a lock is taken, then the auto-refresh shows it: its requests carry the password
                key = run_key(prefix, "sync", 10 + n)
                redis_backend.acquire(key, "m/n", ttl=MINUTE)
                expect(page.locator(f'tr.lock[data-key="{key}"]')).to_have_count(1, timeout=8_000)
                # And the release does too
                if login == "link":
                    redis_backend.acquire(second, "m/n", ttl=MINUTE)
                    row = page.locator(f'tr.lock[data-key="{second}"]')
                    expect(row).to_have_count(1, timeout=8_000)
                    row.get_by_role("button", name="Release lock").click()
                    page.locator("dialog#confirm").get_by_role("button", name="Release", exact=True).click()
                    expect(page.locator("#notice")).to_contain_text(f"Released {second}")
                expect(page.locator("#error")).to_have_text("")
                assert all(status < 400 for status in statuses), (login, statuses)
            finally:
                context.close()
        assert redis_client.exists(second) == 0
        # Given a browser with a wrong password, or none, then I expect no lock shown
        context = browser.new_context(http_credentials={"username": "admin", "password": "guess"})
        try:
            page = context.new_page()
            response = page.goto(url)
            assert response is not None and response.status == 401
            assert first not in page.content() and "needs its password" in page.content()
            expect(page.locator("tr.lock")).to_have_count(0)
        finally:
            context.close()
        context = browser.new_context()
        try:
            page = context.new_page()
            with pytest.raises(Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
                page.goto(url)  # no password to answer the 401 with: headless Chromium, asking no one, gives up
            expect(page.locator("tr.lock")).to_have_count(0)
        finally:
            context.close()
