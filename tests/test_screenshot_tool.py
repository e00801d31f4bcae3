"""The docs' screenshot tool (``docs/dashboard_screenshots.py``, outside
the package) still makes its pictures: the locks it stages are on the
page it photographs, and, where Debian's chromium and Playwright are
installed, the command writes both PNGs at their widths.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType

import pytest

from dramatiq_unique.dashboard import make_app
from tests.conftest import free_port, missing_optional_tool
from tests.test_dashboard import serving

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "dashboard_screenshots.py"


def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard_screenshots", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs_redis_server() -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is missing: the suite needs it; run `apt-get install redis-server`.")


def test_the_page_it_photographs_shows_the_locks_it_staged() -> None:
    needs_redis_server()
    screenshots = tool()
    with ExitStack() as stack:
        # Its own redis-server, which it flushes: never the suite's
        url = stack.enter_context(screenshots.redis_server(free_port()))
        backend = stack.enter_context(screenshots.demo_locks(url))
        with serving(make_app(backend, prefix=screenshots.PREFIX)) as page_url:
            with urllib.request.urlopen(page_url) as response:
                html = response.read().decode()
    # Every actor it staged, held or waiting, is a row of the first response
    for actor in ("sync_account_balance", "send_invoice_email", "reconcile_customer_ledger_entries",
                  "resize_image", "export_report"):
        assert f'<option value="{actor}">' in html, actor
    assert html.count('<tr class="lock') >= 8


def png_width(path: Path) -> int:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int(struct.unpack(">I", header[16:20])[0])


def test_the_command_writes_both_screenshots(tmp_path: Path) -> None:
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    if not os.path.exists(chromium):
        missing_optional_tool(f"{chromium} is missing: the screenshot tool needs it; run `apt-get install chromium`.")
    if importlib.util.find_spec("playwright") is None:
        missing_optional_tool("Playwright is missing: the screenshot tool needs it; run `pip install playwright`.")
    needs_redis_server()
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {png_width(tmp_path / f"dashboard-{width}.png") for width in (1000, 1400)} == {1000, 1400}
