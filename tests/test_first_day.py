"""What a first-day user trips on: a worker that cannot reach its lock
backend says so when it boots; the command ends quietly when what reads
its output stops reading (``... | head``); and no test hard-codes a
RabbitMQ server, so that ``RABBITMQ_URL`` reaches every one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from dramatiq_unique.ops.cli import CLOSED_PIPE_STATUS
from tests.conftest import free_port, wait_for
from tests.procs import ROOT, WorkerGroup

MINUTE = 60_000

# A worker's boot --------------------------------------------------------------

#: The start of the line a worker logs when its lock backend does not answer.
UNREACHABLE = "Lock backend {backend}({url}) does not answer at worker boot ("


def boot(url: str) -> str:
    """Boot one worker process whose locks are at ``url``, wait until
    it logged what it found, and stop it: its output.
    """
    with WorkerGroup("tests.apps.boot:broker", processes=1, threads=1, env={"BOOT_LOCKS_URL": url}) as workers:
        workers.wait_booted(1)
        wait_for(lambda: "does not answer" in workers.output() or "is ready for action" in workers.output(),
                 timeout=30, what="the worker's boot")
        assert workers.process is not None and workers.process.poll() is None, "the worker stopped at boot"
        assert workers.stop() == 0, workers.output()
        return workers.output()


@pytest.mark.parametrize("url, reason, error", [
    ("redis://no-such-host.invalid:6379/0", "Name or service not known", "(ConnectionError: Error "),
    ("redis://127.0.0.1:{port}/0", "Connection refused", "(ConnectionError: Error "),
    ("postgresql://no-such-host.invalid:5432/db", "Name or service not known", "(OperationalError: "),
], ids=["unknown host", "closed port", "unknown host on postgres"])
def test_a_worker_that_cannot_reach_its_lock_backend_says_so_at_boot_and_goes_on(url, reason, error):
    url = url.format(port=free_port())
    output = boot(url)
    backend = "PostgresBackend" if url.startswith("postgresql") else "RedisBackend"
    lines = [line for line in output.splitlines() if UNREACHABLE.format(backend=backend, url=url) in line]
    assert len(lines) == 1, output
    assert "[ERROR]" in lines[0] and error in lines[0], lines[0]
    assert reason in lines[0] and "on_backend_error='fail'" in lines[0], lines[0]
    # It booted all the same: the backend may come up later.
    assert "Worker process is ready for action." in output


def test_a_worker_that_reaches_its_lock_backend_says_nothing_of_it(redis_url, redis_client):
    output = boot(redis_url)
    assert "does not answer" not in output and "Traceback" not in output, output


# A closed pipe ----------------------------------------------------------------


@pytest.fixture
def locks(redis_backend, redis_url) -> Iterator[tuple[str, str]]:
    """Many locks under a fresh prefix, more JSON than a pipe holds:
    (prefix, url).
    """
    prefix = f"p-{uuid.uuid4().hex[:10]}"
    for n in range(400):
        key = f"{prefix}:sync_account_balance:{{{n:032x}}}:queue"
        assert redis_backend.acquire(key, f"m{n}", ttl=MINUTE, lock="until_executed", lock_args='{"id":1}').acquired
    yield prefix, redis_url


def closed_pipe(*args: str, stream: str = "stdout", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dramatiq_unique ARGS`` with its ``stream`` a pipe
    that nobody reads any more; capture the other.
    """
    read, write = os.pipe()
    os.close(read)
    env = {name: value for name, value in os.environ.items() if not name.lower().startswith("dramatiq_unique_")}
    streams = {"stdout": write, "stderr": subprocess.PIPE} if stream == "stdout" else \
        {"stdout": subprocess.PIPE, "stderr": write}
    try:
        return subprocess.run([sys.executable, "-m", "dramatiq_unique", *args], cwd=ROOT, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env={**env, "PYTHONPATH": str(ROOT)}, **streams)
    finally:
        os.close(write)


def test_every_command_ends_quietly_when_its_output_pipe_is_closed(locks):
    prefix, url = locks
    common = ("--redis", url, "--prefix", prefix)
    digest = f"{1:032x}"
    runs = {
        "help": ["--help"],
        "locks": ["locks", *common],
        "locks --json": ["locks", "--json", *common],
        "inspect": ["inspect", digest, *common],
        "inspect --json": ["inspect", digest, "--json", *common],
        "reap": ["reap", "--dry-run", "--min-age", "0", *common],
        "release": ["release", digest, "--json", *common],
        "demo": ["demo"],
    }
    for name, args in runs.items():
        done = closed_pipe(*args)
        # argparse gives up its help quietly itself, with status 0.
        status = (0, CLOSED_PIPE_STATUS) if name == "help" else (CLOSED_PIPE_STATUS,)
        assert done.returncode in status and done.stderr == "", f"{name}: {done.returncode} {done.stderr[-3000:]}"
    # The dashboard writes to stderr only: it stops there, quietly.
    done = closed_pipe("dashboard", "--port", "0", *common, stream="stderr")
    assert (done.returncode, done.stdout) == (CLOSED_PIPE_STATUS, "")


def test_a_head_of_the_json_listing_ends_without_a_traceback(locks):
    prefix, url = locks
    command = f"{sys.executable} -m dramatiq_unique locks --json --redis {url} --prefix {prefix}"
    env = {name: value for name, value in os.environ.items() if not name.lower().startswith("dramatiq_unique_")}
    done = subprocess.run(["bash", "-c", f'{command} | head -n 3; echo "status ${{PIPESTATUS[0]}}" >&2'], cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[0] == "["
    assert len(done.stdout.splitlines()) == 3
    assert done.stderr == f"status {CLOSED_PIPE_STATUS}\n", done.stderr


# RABBITMQ_URL -----------------------------------------------------------------


def test_no_test_names_a_rabbitmq_server_but_through_rabbitmq_url():
    # tests/conftest.py reads RABBITMQ_URL (its default is the one place
    # that names a server); every other test takes its URL from there.
    server = re.compile("amqp" + r"s?://|\b" + "5672" + r"\b")
    here = Path(__file__).resolve()
    files = [path for folder in ("tests", "benchmarks") for path in (ROOT / folder).rglob("*.py")]
    named = [f"{path.relative_to(ROOT)}:{n}" for path in files if path not in (here, ROOT / "tests" / "conftest.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if server.search(line)]
    assert named == []


# Warnings -----------------------------------------------------------------------


def test_a_new_warning_fails_the_test_that_raised_it(tmp_path):
    # setup.cfg's filterwarnings: a warning is an error unless ignored there, with why.
    (tmp_path / "test_warns.py").write_text(
        "import warnings\n\n\ndef test_warns():\n    warnings.warn('something new', UserWarning)\n"
    )
    done = subprocess.run(
        # -n 0: one test, in this process, not setup.cfg's four workers
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-c", str(ROOT / "setup.cfg"),
         "--rootdir", str(tmp_path), str(tmp_path / "test_warns.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stdout[-3000:]
    assert "UserWarning: something new" in done.stdout and "1 failed" in done.stdout
