"""A newcomer's first run of the README's test command: no browser
means skipped page tests that say how to get one (but a failure under
``CI=true``), and the suite's Redis is its own unless ``REDIS_URL``
names another.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from urllib.parse import urlsplit

import redis

from tests.procs import ROOT


def page_tests(**env: str) -> subprocess.CompletedProcess[str]:
    """The dashboard's page tests in a fresh pytest, without a browser."""
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    environ.update(PYTHONPATH=str(ROOT), CHROMIUM="/nonexistent/chromium", **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-k", "page",
         "tests/test_dashboard.py"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300,
    )


def counted(output: str, outcome: str) -> int:
    found = re.search(rf"(\d+) {outcome}", output.splitlines()[-1])
    return int(found[1]) if found else 0


def test_without_chromium_the_page_tests_skip_and_say_how_to_get_it(redis_url):
    done = page_tests(REDIS_URL=redis_url)
    assert done.returncode == 0, done.stdout[-3000:]
    assert counted(done.stdout, "skipped") >= 4 and counted(done.stdout, "failed") == 0
    assert "run `apt-get install chromium`" in done.stdout


def test_under_ci_a_missing_chromium_fails_the_page_tests(redis_url):
    done = page_tests(REDIS_URL=redis_url, CI="true")
    assert done.returncode == 1, done.stdout[-3000:]
    assert counted(done.stdout, "error") >= 4 and counted(done.stdout, "skipped") == 0
    assert "CI=true: these tests must run here" in done.stdout


def test_the_suite_redis_is_private_unless_redis_url_names_one(redis_url):
    if os.environ.get("REDIS_URL"):
        assert redis_url == os.environ["REDIS_URL"]
        return
    # A server of the suite's own: on a port other than the usual 6379,
    # and holding nothing but what this run wrote.
    port = urlsplit(redis_url).port
    assert port not in (None, 6379)
    client = redis.Redis(port=port)
    try:
        assert client.config_get("port")["port"] == str(port)
        assert client.config_get("save")["save"] == ""
    finally:
        client.close()

