"""The lock dashboard: its HTTP API on a real local server, and its
page end to end in Debian's headless ``chromium`` driven by Playwright.
"""

from __future__ import annotations

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
from wsgiref.util import shift_path_info

import dramatiq
import pytest

from dramatiq_unique import UniqueMiddleware
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
    assert status == 200 and '<script src="dashboard.js" defer>' in page
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
        countdown = row.locator(".remaining").element_handle()
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
        page.locator("#actor").fill("send_invoice")
        page.get_by_role("button", name="Filter").click()
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
            run_row = page.locator("tr.lock", has=page.locator("td", has_text="run"))
            queue_row = page.locator("tr.lock", has=page.locator("td", has_text="queue"))
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
        assert release(url, {"digest": f"{9:032x}"}, **{CSRF_HEADER: "1"})[0] == 415
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    # Then the log has the page load and the refused release, not the refreshes
    log = capfd.readouterr().err
    assert '"GET / HTTP/1.1" 200' in log
    assert "\"POST /api/release HTTP/1.1\" 415" in log
    assert "/api/locks" not in log
