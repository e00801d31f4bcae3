"""Fixtures on real services.

Redis is a private ``redis-server`` that each test process starts on
a free port, unless ``REDIS_URL`` names one to use instead (and then the
run is serial): a shared Redis (yours on 6379, say) is touched only when
``REDIS_URL`` says so.  Without either, the tests that need Redis fail
with a message saying how to get one.  Tests use their own database
number and never flush anything else.  Each process also has a
PostgreSQL cluster (tests/postgres_server.py) and a RabbitMQ virtual
host of its own (``rabbitmq_url``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from typing import Iterator, Optional
from urllib.parse import urlsplit, urlunsplit

import dramatiq
import pytest
import redis
from dramatiq import Worker
from dramatiq.brokers.stub import StubBroker

from dramatiq_unique import StubBackend, UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend
from tests.faults.proxy import Proxy

#: The Redis database the suite owns and flushes.
TEST_DB = 11

RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")

#: The variable that points the suite at a PostgreSQL server of your own.
#: Not a ``dramatiq_unique_*`` name: the package refuses those it does not know.
POSTGRES_URL_VARIABLE = "DU_TEST_POSTGRES_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="also run the full-size load and soak tests (marker soak)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Each process of a parallel run (setup.cfg's -n) has a redis-server
    # of its own; the one database REDIS_URL names would be flushed by
    # all of them under each other's tests, so with it the run is serial.
    if os.environ.get("REDIS_URL") and getattr(config.option, "numprocesses", None):
        config.option.numprocesses, config.option.dist, config.option.tx = 0, "no", []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The full-size runs are deselected, not skipped: the default suite
    # never reports a skip.
    if config.getoption("--soak"):
        return
    soak = [item for item in items if "soak" in item.keywords]
    if soak:
        config.hook.pytest_deselected(items=soak)
        items[:] = [item for item in items if "soak" not in item.keywords]


def under_ci() -> bool:
    """Whether this run is CI's (``CI=true``), which must run every test."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing_optional_tool(message: str) -> None:
    """A tool that only some tests need (the browser of the dashboard
    tests) is missing: skip, saying how to get it, on a developer's
    machine; fail under CI, which installs it and must run those tests.
    """
    if under_ci():
        pytest.fail(f"{message} (CI=true: these tests must run here)", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def _served_by(port: int, pid: int) -> bool:
    """Whether the Redis on ``port`` answers, and is process ``pid``: in
    a parallel run, another process's server may have taken the port
    that :func:`free_port` gave out.
    """
    client = redis.Redis(port=port, socket_connect_timeout=1)
    try:
        return bool(client.info("server")["process_id"] == pid)
    except redis.RedisError:
        return False
    finally:
        client.close()


def start_redis_server(port: int, *extra: str) -> subprocess.Popen[bytes]:
    """Start a throw-away ``redis-server`` on ``port`` and wait for it."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: run `apt-get install redis-server`, or set REDIS_URL.")
    workdir = tempfile.mkdtemp(prefix="dramatiq-unique-redis-")
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir,
         *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _served_by(port, process.pid):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail(f"redis-server did not start on port {port} (or another process's took it first).")
        time.sleep(0.05)
    return process


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A URL of a Redis database reserved for the suite."""
    if os.environ.get("REDIS_URL"):
        url = os.environ["REDIS_URL"]
        if not _answers(url):
            pytest.fail(f"REDIS_URL={url} does not answer. Start Redis there, or unset REDIS_URL.")
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run `apt-get install redis-server`, or set REDIS_URL "
                    f"to a Redis database the suite may flush, e.g. redis://127.0.0.1:6379/{TEST_DB}.")
    port = free_port()
    process = start_redis_server(port)
    try:
        yield f"redis://127.0.0.1:{port}/{TEST_DB}"
    finally:
        process.terminate()
        process.wait()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """The RabbitMQ that ``RABBITMQ_URL`` names (this machine's by
    default), on a virtual host of this test process's own when
    ``RABBITMQ_URL`` names none and ``rabbitmqctl`` may make one; fails
    with how to start RabbitMQ.
    """
    parts = urlsplit(RABBITMQ_URL)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5672
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        pytest.fail(f"RabbitMQ is not reachable at {host}:{port}. Start it with `rabbitmq-server -detached`.")
    if parts.path.strip("/") or shutil.which("rabbitmqctl") is None:
        yield RABBITMQ_URL
        return
    yield from vhost_on(RABBITMQ_URL)


def rabbitmqctl(*args: str) -> Optional[str]:
    """``rabbitmqctl ARGS``'s output, or None when it failed (it needs
    root or the server's Erlang cookie).
    """
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def vhost_on(url: str) -> Iterator[str]:
    """``url`` on a fresh virtual host, held by a connection of this
    session and deleted afterwards; ``url`` itself when ``rabbitmqctl``
    cannot make one.  The virtual hosts of sessions that ended without
    deleting theirs are deleted first.
    """
    drop_stale_vhosts()
    name = session_name()
    if rabbitmqctl("add_vhost", name) is None:
        yield url
        return
    import pika

    user = urlsplit(url).username or "guest"
    try:
        rabbitmqctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
        own = urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
        # Held open all session (no heartbeat, so idle is fine): a virtual
        # host nobody is connected to is one whose session is gone.
        keeper = pika.BlockingConnection(pika.URLParameters(urlunsplit(urlsplit(own)._replace(query="heartbeat=0"))))
        try:
            yield own
        finally:
            keeper.close()
    finally:
        rabbitmqctl("delete_vhost", name)


def drop_stale_vhosts() -> None:
    """Delete the ``du_test_*`` virtual hosts made before this session
    started that no connection uses: an interrupted session's.
    """
    listed = rabbitmqctl("list_vhosts", "name")
    candidates = [name for name in (listed or "").split() if stale(name)]
    connected = rabbitmqctl("list_connections", "vhost") if candidates else None
    for name in candidates:
        if connected is not None and name not in connected.split():
            rabbitmqctl("delete_vhost", name)


#: When this test process started (Unix time, s).
STARTED = int(time.time())

#: What the names of the suite's own databases and virtual hosts start with.
SESSION_PREFIX = "du_test_"


def session_name() -> str:
    """A fresh name for a database or virtual host of this session:
    ``du_test_<Unix time it was made>_<random>``.
    """
    return f"{SESSION_PREFIX}{int(time.time())}_{uuid.uuid4().hex[:8]}"


def stale(name: str) -> bool:
    """Whether ``name`` is a session's database or virtual host made
    before this session started (made by an older suite, whose names
    carry no time, counts as made then).
    """
    if not name.startswith(SESSION_PREFIX):
        return False
    made = name[len(SESSION_PREFIX):].partition("_")[0]
    return (int(made) if made.isdigit() else 0) < STARTED


@pytest.fixture
def stub_broker() -> Iterator[StubBroker]:
    broker = StubBroker()
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker
    broker.flush_all()
    broker.close()


@pytest.fixture(params=["stub", "redis"])
def any_broker(request: pytest.FixtureRequest) -> Iterator[dramatiq.Broker]:
    """A StubBroker, then a RedisBroker on the suite's database under a
    namespace of its own.
    """
    if request.param == "stub":
        yield request.getfixturevalue("stub_broker")
        return
    from dramatiq.brokers.redis import RedisBroker

    request.getfixturevalue("redis_client")
    broker = RedisBroker(url=request.getfixturevalue("redis_url"), namespace=f"t-{uuid.uuid4().hex[:8]}")
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


def make_worker(broker: dramatiq.Broker, threads: int = 8) -> Worker:
    worker = Worker(broker, worker_timeout=50, worker_threads=threads)
    worker.start()
    return worker


@pytest.fixture
def redis_backend(redis_client: redis.Redis) -> RedisBackend:
    return RedisBackend(client=redis_client)


@pytest.fixture(params=["stub", "redis", "postgres"])
def backend(request: pytest.FixtureRequest) -> object:
    """Each backend in turn, for contract tests."""
    if request.param == "stub":
        return StubBackend()
    return request.getfixturevalue(f"{request.param}_backend")


# PostgreSQL: a private cluster per session, or DU_TEST_POSTGRES_URL (tests/postgres_server.py).


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A URL of a fresh PostgreSQL database, dropped after the session."""
    from tests.postgres_server import PostgresServer, database_on

    server = None
    url = os.environ.get(POSTGRES_URL_VARIABLE)
    if not url:
        server = PostgresServer(free_port())
        server.start()
        url = server.url
    try:
        yield from database_on(url)
    finally:
        if server is not None:
            server.remove()


@pytest.fixture
def postgres_backend(postgres_url: str) -> Iterator[object]:
    """A PostgresBackend on the suite's database, emptied before and after."""
    from dramatiq_unique.backends.postgres import PostgresBackend
    from tests.postgres_server import empty

    backend = PostgresBackend(url=postgres_url)
    empty(backend)
    yield backend
    empty(backend)
    backend.close()


def unique(backend: object = None, **options: object) -> UniqueMiddleware:
    """A middleware with test-friendly timings."""
    options.setdefault("reschedule_delay", 200)
    return UniqueMiddleware(backend=backend, **options)  # type: ignore[arg-type]


def wait_for(condition, timeout: float = 10.0, interval: float = 0.01, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    """Poll ``condition`` until it is true, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def proxy(redis_url: str) -> Iterator[Proxy]:
    """A :class:`Proxy` in front of the suite's Redis."""
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    with Proxy(port) as proxy:
        yield proxy


@pytest.fixture
def rabbitmq_proxy(rabbitmq_url: str) -> Iterator[Proxy]:
    """A :class:`Proxy` in front of the suite's RabbitMQ."""
    parts = urlsplit(rabbitmq_url)
    with Proxy(parts.port or 5672, target_host=parts.hostname or "127.0.0.1") as proxy:
        yield proxy
