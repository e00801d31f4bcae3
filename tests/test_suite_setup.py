"""The suite's own set-up holds to what the README says of it: the
variables it names point the tests elsewhere without the package
refusing them, the test count it states is the one pytest collects, and
the databases and virtual hosts the suite makes on a server are gone
after it, even when it was interrupted.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from urllib.parse import urlsplit

import psycopg

from tests.conftest import POSTGRES_URL_VARIABLE, RABBITMQ_URL, SESSION_PREFIX, rabbitmqctl, wait_for
from tests.postgres_server import drop_stale_databases, with_database
from tests.procs import ROOT

README = (ROOT / "README.md").read_text()

#: The README's paragraph on running the tests, up to its test command.
RUN_THE_TESTS = README[README.index("Run the tests:"):README.index("pip install -e '.[test]' && python -m pytest")]


# The variables the README names -----------------------------------------------


def refused(variable: str) -> str:
    """What the package says when ``variable`` is set at a middleware's
    construction, in a fresh process: empty when it accepts it.
    """
    done = subprocess.run(
        [sys.executable, "-c", "from dramatiq_unique import StubBackend, UniqueMiddleware\n"
                               "UniqueMiddleware(backend=StubBackend())"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), variable: "postgresql://u@h:5432/db"},
        capture_output=True, text=True, timeout=60,
    )
    return done.stderr.strip().splitlines()[-1] if done.returncode else ""


def test_every_variable_the_readme_gives_the_tests_is_read_by_them_and_accepted_by_the_package():
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", RUN_THE_TESTS))
    assert named == {"REDIS_URL", "RABBITMQ_URL", POSTGRES_URL_VARIABLE}, named
    read = "".join(path.read_text() for path in (ROOT / "tests").glob("*.py"))
    for variable in sorted(named):
        assert f'"{variable}"' in read, f"the README names {variable}, which no test reads"
        assert refused(variable) == "", f"the package refuses {variable}, which the README gives the tests"
    # The name the suite read before: every test then failed at its first middleware.
    assert "is not a dramatiq-unique setting" in refused("DRAMATIQ_UNIQUE_POSTGRES_URL")


# The README's test count ----------------------------------------------------


def test_the_readme_states_the_number_of_tests_the_suite_collects():
    stated = re.search(r"\(([\d,]+) tests,", RUN_THE_TESTS)
    assert stated, "the README's paragraph on running the tests states no count of them"
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = re.search(r"^(\d+)(?:/\d+)? tests collected", done.stdout, re.MULTILINE)
    assert collected, done.stdout[-3000:]
    assert int(stated[1].replace(",", "")) == int(collected[1]), "update the README's count of the tests"


# What the suite leaves on a server ------------------------------------------------


def server_of(postgres_url: str) -> str:
    return with_database(postgres_url, "postgres")


def databases(server: str) -> set[str]:
    with psycopg.connect(server, autocommit=True) as conn:
        return {row[0] for row in conn.execute("SELECT datname FROM pg_database") if row[0].startswith(SESSION_PREFIX)}


def test_a_database_an_earlier_session_left_is_dropped_and_a_live_one_kept(postgres_url):
    server = server_of(postgres_url)
    left, held = f"{SESSION_PREFIX}1_deadbeef", f"{SESSION_PREFIX}1_feedbeef"
    with psycopg.connect(server, autocommit=True) as conn:
        for name in (left, held):
            conn.execute(f"CREATE DATABASE {name}")
    try:
        with psycopg.connect(with_database(server, held)):
            drop_stale_databases(server)
            # Gone: the one nobody held. Kept: one held open, and this session's own.
            assert left not in databases(server)
            assert {held, urlsplit(postgres_url).path[1:]} <= databases(server)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            for name in (left, held):
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


HOLD = textwrap.dedent("""
    import threading


    def test_holds(postgres_url, rabbitmq_url):
        print("holding", postgres_url, rabbitmq_url, flush=True)
        threading.Event().wait(120)
""")


def test_an_interrupted_session_drops_its_database_and_its_virtual_host(postgres_url, tmp_path):
    # Given a session of the suite on a server of "your own", stopped with Ctrl-C while a test runs
    server = server_of(postgres_url)
    (tmp_path / "test_hold.py").write_text(HOLD)
    out = tmp_path / "out"
    with open(out, "w") as output:
        session = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest", "test_hold.py"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), POSTGRES_URL_VARIABLE: server},
            stdout=output, stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: "holding" in out.read_text(), timeout=60, what="the session's test")
        database = urlsplit(out.read_text().split("holding ")[1].split()[0]).path[1:]
        vhost = urlsplit(out.read_text().split("holding ")[1].split()[1]).path[1:]
        assert database in databases(server)
        session.send_signal(signal.SIGINT)
        assert session.wait(timeout=60) != 0
    finally:
        if session.poll() is None:
            session.kill()
    # Then its database is dropped, and its virtual host (when it had one) deleted
    assert database not in databases(server), out.read_text()[-3000:]
    if vhost:
        assert vhost not in (rabbitmqctl("list_vhosts", "name") or "").split()


def test_each_session_has_a_virtual_host_of_its_own_when_rabbitmqctl_can_make_one(rabbitmq_url):
    own, listed = urlsplit(rabbitmq_url).path[1:], rabbitmqctl("list_vhosts", "name")
    if urlsplit(RABBITMQ_URL).path.strip("/") or listed is None:
        # RABBITMQ_URL names a virtual host, or rabbitmqctl cannot make one here: RABBITMQ_URL as it is
        assert rabbitmq_url == RABBITMQ_URL
    else:
        assert own.startswith(SESSION_PREFIX) and own in listed.split()


# What a parallel run prints ---------------------------------------------------------


def test_a_parallel_run_prints_the_figures_its_workers_measured(tmp_path):
    # The fault suite's figures, recorded in worker processes, printed by the one that reports
    (tmp_path / "conftest.py").write_text("from tests.faults.conftest import figure, pytest_terminal_summary  # noqa\n")
    (tmp_path / "test_measures.py").write_text("def test_measures(figure):\n    figure('recovery_s', 1.5)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "test_measures.py"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "dramatiq-unique fault figures" in done.stdout and "test_measures: recovery_s = 1.5" in done.stdout
