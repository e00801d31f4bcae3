"""Screenshots of the dashboard for the docs, of real locks.

It starts a throw-away ``redis-server`` (or uses ``--redis``), takes
locks through :class:`UniqueMiddleware` on a stub broker, some held by
running workers with messages waiting behind them, serves the
dashboard, and saves it from Debian's ``chromium`` through Playwright
(``pip install playwright``; no ``playwright install`` needed).  From
a checkout, with the package installed::

  python docs/dashboard_screenshots.py

writes ``dashboard-1000.png`` and ``dashboard-1400.png`` into
``docs/_static`` (``--out`` for another folder).  It is a tool for the
docs, not part of the package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
WIDTHS = (1000, 1400)
PREFIX = "dramatiq-unique"
#: Where the docs take their images from: ``_static`` beside this script.
STATIC = Path(__file__).resolve().parent / "_static"


@contextmanager
def redis_server(port: int) -> Iterator[str]:
    """A redis-server of its own on ``port``, stopped afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is missing: run `apt-get install redis-server`, or pass --redis.")
    workdir = tempfile.mkdtemp(prefix="dashboard-screenshot-")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise SystemExit(f"redis-server did not start on port {port}.") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def demo_locks(redis_url: str) -> Iterator[Any]:
    """Locks as in a busy app, taken the way workers take them; yields
    the backend, with the run locks held until the block ends."""
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from dramatiq_unique import UniqueMiddleware
    from dramatiq_unique.backends import from_url

    backend = from_url(redis_url)
    backend.delete_prefix(f"{PREFIX}:")
    broker = StubBroker()
    unique = UniqueMiddleware(backend=backend, prefix=PREFIX, record_lock_args=True, reschedule_delay=600_000)
    broker.add_middleware(unique)
    gate = threading.Event()
    started: list[str] = []

    def hold(name: str) -> None:
        started.append(name)
        gate.wait(120)

    def sync_account_balance(account_id: int, day: str) -> None:
        hold("sync")

    def send_invoice_email(invoice_id: str) -> None:
        hold("invoice")

    def reconcile_customer_ledger_entries(account_id: int, currency: str) -> None:
        hold("ledger")

    def resize_image(bucket: str, path: str) -> None:
        hold("resize")

    def export_report(report_id: int) -> None:
        hold("report")

    sync = dramatiq.actor(broker=broker, lock="until_executed", lock_args=["account_id"],
                          lock_ttl=3_600_000)(sync_account_balance)
    invoice = dramatiq.actor(broker=broker, lock="until_expired", lock_args=["invoice_id"],
                             lock_ttl=900_000)(send_invoice_email)
    ledger = dramatiq.actor(broker=broker, lock="until_and_while_executing",
                            lock_args=["account_id", "currency"])(reconcile_customer_ledger_entries)
    resize = dramatiq.actor(broker=broker, lock="while_executing", lock_limit=2, lock_args=["bucket"])(resize_image)
    report = dramatiq.actor(broker=broker, lock="while_executing", lock_args=["report_id"])(export_report)

    for n, account in enumerate((42, 43, 1187)):
        sync.send_with_options(args=(account, "2026-12-01"), delay=600_000 + n)
        time.sleep(0.4)
    for invoice_id in ("INV-2026-0912", "INV-2026-0913"):
        invoice.send_with_options(args=(invoice_id,), delay=600_000)
        time.sleep(0.3)
    unique.flush_confirmations()
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=6)
    worker.start()
    try:
        ledger.send(42, "EUR")
        resize.send("avatars", "u/81.png")
        resize.send("avatars", "u/93.png")
        report.send(8)
        deadline = time.monotonic() + 10
        while len(started) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        ledger.send(42, "EUR")
        resize.send("avatars", "u/102.png")
        deadline = time.monotonic() + 10
        while unique.events.count("rescheduled") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        yield backend
    finally:
        gate.set()
        worker.stop()


def screenshots(url: str, out: str, widths: tuple[int, ...] = WIDTHS) -> list[str]:
    """Save the page at each width; returns the paths."""
    from playwright.sync_api import sync_playwright

    paths = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
        try:
            for width in widths:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(url)
                page.wait_for_selector("tr.lock")
                path = os.path.join(out, f"dashboard-{width}.png")
                page.screenshot(path=path, full_page=True)
                paths.append(path)
                page.close()
        finally:
            browser.close()
    return paths


def main(argv: Any = None) -> int:
    from dramatiq_unique.dashboard import make_app
    from dramatiq_unique.dashboard.server import make_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(STATIC), help="the folder of the PNGs (default: the docs' _static)")
    parser.add_argument("--redis", help="a Redis database to use (it is flushed); default: start one on --port")
    parser.add_argument("--port", type=int, default=6427, help="the port of the redis-server it starts")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with ExitStack() as stack:
        redis_url = args.redis or stack.enter_context(redis_server(args.port))
        backend = stack.enter_context(demo_locks(redis_url))
        server = make_server(make_app(backend, prefix=PREFIX), host="127.0.0.1", port=0, quiet=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            for path in screenshots(f"http://127.0.0.1:{server.server_port}/", args.out):
                print(path)
        finally:
            server.shutdown()
            server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
