"""The ``dramatiq-unique`` command, run as a subprocess against real
Redis.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from urllib.parse import urlsplit
from typing import Optional

import pytest

from tests.conftest import free_port
from tests.procs import ROOT

MINUTE = 60_000


def run(*args: str, stdin: Optional[str] = None, env: Optional[dict] = None, timeout: float = 60):
    """Run ``python -m dramatiq_unique ARGS`` with no ``dramatiq_unique_*``
    variables but those in ``env``.
    """
    clean = {name: value for name, value in os.environ.items() if not name.lower().startswith("dramatiq_unique_")}
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_unique", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=timeout,
    )


def one_line_error(result) -> str:
    """The single stderr line of a failed command."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dramatiq-unique: ")
    return lines[0]


@pytest.fixture
def locks(redis_backend, redis_url):
    """Locks of two actors under a fresh prefix: (prefix, url, keys)."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    keys = {
        "sync_run": f"{prefix}:sync_account_balance:{{{'a' * 32}}}:run",
        "sync_queue": f"{prefix}:sync_account_balance:{{{'a' * 32}}}:queue",
        "other_sync": f"{prefix}:sync_account_balance:{{{'b' * 32}}}:run",
        "mail": f"{prefix}:send_mail:{{{'c' * 32}}}:queue",
    }
    acquire = redis_backend.acquire
    assert acquire(keys["sync_run"], "m1/n1", ttl=MINUTE, limit=2, lock="until_and_while_executing").acquired
    assert acquire(keys["sync_run"], "m2/n2", ttl=MINUTE, limit=2, lock="until_and_while_executing").acquired
    lock_args = '{"id":1}'
    assert acquire(keys["sync_queue"], "m3", ttl=MINUTE, lock="until_and_while_executing", lock_args=lock_args).acquired
    assert acquire(keys["other_sync"], "m4/n4", ttl=MINUTE, lock="while_executing").acquired
    assert acquire(keys["mail"], "m5", ttl=MINUTE, lock="until_executed").acquired
    return prefix, redis_url, keys


def test_locks_lists_every_lock_as_text_and_json(locks):
    prefix, url, keys = locks
    text = run("locks", "--redis", url, "--prefix", prefix)
    listed = run("locks", "--redis", url, "--prefix", prefix, "--json")

    assert text.returncode == 0, text.stderr
    assert "4 locks under prefix" in text.stdout
    assert text.stdout.splitlines()[0].split() == [
        "ACTOR", "DIGEST", "PHASE", "LOCK", "HOLDERS", "AGE", "NEXT", "EXPIRY", "STATE", "WAITING"
    ]
    assert any(line.split()[:5] == ["sync_account_balance", "a" * 32, "run", "until_and_while_executing", "2"]
               for line in text.stdout.splitlines())
    assert listed.returncode == 0, listed.stderr
    assert sorted(lock["key"] for lock in json.loads(listed.stdout)) == sorted(keys.values())


def test_locks_filters_by_actor_and_pattern(locks):
    prefix, url, keys = locks
    common = ("locks", "--redis", url, "--prefix", prefix, "--json")
    by_actor = json.loads(run(*common, "--actor", "send_mail").stdout)
    by_pattern = json.loads(run(*common, "--pattern", f"*{{{'a' * 32}}}*").stdout)

    assert [lock["key"] for lock in by_actor] == [keys["mail"]]
    assert sorted(lock["key"] for lock in by_pattern) == sorted([keys["sync_run"], keys["sync_queue"]])


def test_url_names_the_locks_as_redis_did_and_the_two_must_agree(locks):
    prefix, url, keys = locks
    ways = ((["--url", url], {}), ([], {"dramatiq_unique_url": url}), (["--url", url, "--redis", url], {}))
    for options, env in ways:
        result = run("locks", "--json", "--prefix", prefix, *options, env=env)
        assert result.returncode == 0, result.stderr
        assert len(json.loads(result.stdout)) == len(keys)
    other = run("locks", "--url", url, "--redis", "redis://127.0.0.1:1/0")
    assert "--url and --redis name different locks" in one_line_error(other)
    bad = run("locks", "--url", "http://127.0.0.1:6379")
    assert "url='http://127.0.0.1:6379' is invalid: expected a URL starting with redis://" in one_line_error(bad)


def test_reads_redis_and_prefix_from_the_environment(locks):
    prefix, url, keys = locks
    result = run("locks", "--json", env={"dramatiq_unique_redis_url": url, "dramatiq_unique_prefix": prefix})

    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == len(keys)


def test_inspect_shows_holders_deadlines_and_lock_args(locks):
    prefix, url, keys = locks
    before = time.time() * 1000
    text = run("inspect", "a" * 32, "--redis", url, "--prefix", prefix)
    data = json.loads(run("inspect", "a" * 32, "--redis", url, "--prefix", prefix, "--json").stdout)

    assert text.returncode == 0, text.stderr
    for shown in (keys["sync_queue"], keys["sync_run"], "message m1  owner m1/n1", "message m2", 'lock args  {"id":1}'):
        assert shown in text.stdout
    assert [lock["phase"] for lock in data] == ["queue", "run"]
    assert data[0]["lock_args"] == {"id": 1}
    run_holders = data[1]["holders"]
    assert sorted(h["message_id"] for h in run_holders) == ["m1", "m2"]
    assert all(before < h["deadline"] <= time.time() * 1000 + MINUTE for h in run_holders)


def test_release_a_digest_a_phase_or_one_holder(locks, redis_client):
    prefix, url, keys = locks
    common = ("--redis", url, "--prefix", prefix)

    holder = run("release", "a" * 32, "--holder", "m1", *common)
    assert holder.returncode == 0, holder.stderr
    assert "Released holder m1/n1" in holder.stdout
    assert redis_client.hexists(keys["sync_run"], "m2/n2")
    assert not redis_client.hexists(keys["sync_run"], "m1/n1")

    phase = run("release", "a" * 32, "--phase", "queue", "--json", *common)
    assert json.loads(phase.stdout) == {"released": [keys["sync_queue"]]}
    assert redis_client.exists(keys["sync_queue"]) == 0 and redis_client.exists(keys["sync_run"]) == 1

    whole = run("release", "a" * 32, *common)
    assert whole.returncode == 0, whole.stderr
    assert redis_client.exists(keys["sync_run"]) == 0
    assert redis_client.exists(keys["other_sync"], keys["mail"]) == 2


def test_release_actor_asks_first_unless_yes(locks, redis_client):
    prefix, url, keys = locks
    common = ("--redis", url, "--prefix", prefix)
    actor_keys = (keys["sync_run"], keys["sync_queue"], keys["other_sync"])

    declined = run("release", "--actor", "sync_account_balance", *common, stdin="n\n")
    assert "Release 3 locks of actor 'sync_account_balance'? [y/N]" in declined.stderr
    assert declined.returncode == 1
    assert redis_client.exists(*actor_keys) == 3

    no_answer = run("release", "--actor", "sync_account_balance", *common)
    assert no_answer.returncode == 1
    assert redis_client.exists(*actor_keys) == 3

    accepted = run("release", "--actor", "sync_account_balance", *common, stdin="y\n")
    assert accepted.returncode == 0, accepted.stderr
    assert "Released 3 locks of actor 'sync_account_balance'." in accepted.stdout
    assert redis_client.exists(*actor_keys) == 0
    assert redis_client.exists(keys["mail"]) == 1

    forced = run("release", "--actor", "send_mail", "--yes", "--json", *common)
    assert json.loads(forced.stdout) == {"released": [keys["mail"]]}
    assert "[y/N]" not in forced.stderr
    assert redis_client.exists(keys["mail"]) == 0


def test_an_unreachable_redis_is_a_one_line_error_for_every_command():
    url = f"redis://127.0.0.1:{free_port()}/0"
    for args in (["locks"], ["inspect", "a" * 32], ["release", "a" * 32], ["release", "--actor", "x", "--yes"],
                 ["dashboard", "--port", "0"]):
        line = one_line_error(run(*args, "--redis", url))
        assert f"RedisBackend({url}) failed" in line and "Connection refused" in line, line


def test_unknown_and_malformed_digests_are_one_line_errors(locks):
    prefix, url, _ = locks
    common = ("--redis", url, "--prefix", prefix)
    assert "No lock has digest " + "f" * 32 in one_line_error(run("inspect", "f" * 32, *common))
    assert "No lock has digest " + "f" * 32 in one_line_error(run("release", "f" * 32, *common))
    assert "no holder 'nobody'" in one_line_error(run("release", "a" * 32, "--holder", "nobody", *common))
    assert "not a digest" in one_line_error(run("inspect", "nope", *common))


def test_missing_or_bad_settings_are_one_line_errors(redis_url):
    assert "give --url URL or set dramatiq_unique_url" in one_line_error(run("locks"))
    bad = run("locks", env={"dramatiq_unique_redis_url": redis_url, "dramatiq_unique_lease": "soon"})
    assert "dramatiq_unique_lease" in one_line_error(bad)
    usage = run("release", "--redis", redis_url)
    assert usage.returncode == 2 and "one of a DIGEST, --actor NAME or --queue NAME" in usage.stderr


def serve_dashboard(*args: str, env: Optional[dict] = None) -> subprocess.Popen:
    """Start ``python -m dramatiq_unique dashboard ARGS``, with ``env`` added; the caller stops it."""
    return subprocess.Popen(
        [sys.executable, "-m", "dramatiq_unique", "dashboard", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_served_url(server: subprocess.Popen) -> str:
    """The address in the dashboard's first line on stderr, "Serving the
    locks under prefix 'P' at URL".
    """
    assert server.stderr is not None
    line = server.stderr.readline()
    if " at http" not in line:
        pytest.fail(f"the dashboard exited early, or said no address:\n{line}{server.stderr.read()}")
    return line.rstrip("\n").rpartition(" at ")[2]


def test_dashboard_serves_the_locks_until_stopped(locks):
    prefix, url, keys = locks
    server = serve_dashboard("--redis", url, "--prefix", prefix, "--port", "0")
    try:
        page_url = read_served_url(server)
        with urllib.request.urlopen(page_url + "api/locks", timeout=10) as response:
            listed = json.load(response)
        assert sorted(lock["key"] for lock in listed["locks"]) == sorted(keys.values())
        # Bound to 127.0.0.1, it refuses other host names (DNS rebinding).
        foreign = urllib.request.Request(page_url + "api/locks", headers={"Host": "attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(foreign, timeout=10)
        assert refused.value.code == 400
    finally:
        server.terminate()
        server.wait(10)
    assert "no authentication" in server.stderr.read()


def test_the_dashboard_off_loopback_refuses_to_start_without_allowed_hosts(locks):
    prefix, url, _ = locks
    refused = run("dashboard", "--redis", url, "--prefix", prefix, "--host", "0.0.0.0", "--port", "0", timeout=30)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "not a loopback address" in refused.stderr and "--allowed-host NAME" in refused.stderr
    assert "Serving" not in refused.stderr


def test_the_dashboard_off_loopback_serves_only_its_allowed_hosts(locks):
    prefix, url, keys = locks
    server = serve_dashboard(
        "--redis", url, "--prefix", prefix, "--host", "0.0.0.0", "--port", "0", "--allowed-host", "Locks.Example"
    )
    try:
        port = urlsplit(read_served_url(server)).port
        local = f"http://127.0.0.1:{port}/api/locks"

        def fetch(host: str) -> int:
            request = urllib.request.Request(local, headers={"Host": host})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    assert sorted(lock["key"] for lock in json.load(response)["locks"]) == sorted(keys.values())
                    return response.status
            except urllib.error.HTTPError as e:
                return e.code

        # The named host, in any case and with its port, is served; any other name is refused (DNS rebinding).
        assert fetch(f"locks.example:{port}") == 200
        assert fetch("attacker.example") == 400
        assert fetch(f"127.0.0.1:{port}") == 400  # loopback names are not implied off loopback
    finally:
        server.terminate()
        server.wait(10)


def test_the_dashboard_asks_for_the_password_of_its_variable_and_never_shows_it(locks):
    prefix, url, keys = locks
    password = f"pw-{uuid.uuid4().hex}"
    env = {"DRAMATIQ_UNIQUE_DASHBOARD_PASSWORD": password}
    args = ("--redis", url, "--prefix", prefix, "--port", "0", "--host", "0.0.0.0", "--allowed-host", "127.0.0.1")
    server = serve_dashboard(*args, env=env)
    try:
        page_url = read_served_url(server).replace("0.0.0.0", "127.0.0.1")

        def fetch(path: str, password: Optional[str], method: str = "GET") -> tuple[int, str]:
            headers = {"Content-Type": "application/json", "X-Dramatiq-Unique": "1"}
            if password is not None:
                headers["Authorization"] = "Basic " + base64.b64encode(f"admin:{password}".encode()).decode()
            body = json.dumps({"digest": "a" * 32}).encode() if method == "POST" else None
            request = urllib.request.Request(page_url + path, body, headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        for path, method in (("", "GET"), ("api/view", "GET"), ("api/locks", "GET"), ("api/release", "POST")):
            for wrong in (None, "guess", password[:-1]):
                status, body = fetch(path, wrong, method)
                assert status == 401 and prefix not in body and password not in body, (path, wrong, status, body)
        status, body = fetch("api/locks", password)
        assert status == 200 and sorted(lock["key"] for lock in json.loads(body)["locks"]) == sorted(keys.values())
        status, body = fetch("api/release", password, "POST")
        assert status == 200 and sorted(json.loads(body)["released"]) == sorted([keys["sync_run"], keys["sync_queue"]])
    finally:
        server.terminate()
        server.wait(10)
    said = server.stderr.read() + server.stdout.read()
    assert "asks for the password of dramatiq_unique_dashboard_password" in said and "HTTPS" in said
    assert "no authentication" not in said and password not in said


def test_demo_still_runs():
    result = run("demo", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Account 42 ran one sync at a time: yes." in result.stdout
    # and it counts the syncs that waited, not the reschedules, which can be more
    waited = re.search(r"(\d+) syncs of account 42 waited for its lock, rescheduled (\d+) times", result.stdout)
    assert waited and waited.group(1) == "3" and int(waited.group(2)) >= 3, result.stdout


# Flags only where they mean something ----------------------------------------

#: A run of each command that prints JSON, against the ``locks`` fixture.
JSON_RUNS = {
    "locks": ["locks"],
    "inspect": ["inspect", "a" * 32],
    "reap": ["reap", "--dry-run"],
    "release": ["release", "c" * 32],  # last: it releases send_mail's lock
}


def subcommands() -> list[str]:
    from dramatiq_unique.ops.cli import parser

    return [name for action in parser()._actions if action.dest == "command" for name in action.choices or ()]


def test_the_dashboard_and_the_demo_refuse_json_saying_why():
    for command, reason in (("dashboard", "serves a web page"), ("demo", "prints a timeline")):
        started = time.monotonic()
        result = run(command, "--json", "--redis", f"redis://127.0.0.1:{free_port()}/0", timeout=30)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
        assert f"dramatiq-unique {command}: error: --json is not an option of this command" in result.stderr
        assert reason in result.stderr
        assert time.monotonic() - started < 20  # refused before connecting or serving


def test_every_command_that_lists_json_prints_valid_json(locks):
    prefix, url, keys = locks
    helps = {command: run(command, "--help").stdout for command in subcommands()}
    assert all(helps.values()), "every command has a --help"
    listing = sorted(command for command, text in helps.items() if "--json" in text)
    # Only the commands whose output is data take --json; every command but the demo reads locks.
    assert listing == sorted(JSON_RUNS)
    assert sorted(command for command, text in helps.items() if "--prefix" in text) == sorted(
        command for command in helps if command != "demo"
    )
    assert all("--redis" in text for text in helps.values())
    for command in listing:
        result = run(*JSON_RUNS[command], "--redis", url, "--prefix", prefix, "--json")
        assert result.returncode == 0, f"{command}: {result.stderr}"
        try:
            data = json.loads(result.stdout)
        except json.JSONDecodeError as e:
            pytest.fail(f"`dramatiq-unique {command} --json` printed no valid JSON ({e}):\n{result.stdout}")
        assert data, f"{command} printed empty JSON"
    assert json.loads(result.stdout) == {"released": [keys["mail"]]}
