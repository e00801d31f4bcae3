"""A password in the lock backend's URL is never shown: not by the
settings' repr, the middleware's attributes, the command's text and
JSON, the dashboard's page and API, nor the log lines.

Against the suite's real Redis (with an ACL user whose password is in
the URL) and PostgreSQL (trust auth: the password is accepted and
ignored).
"""

from __future__ import annotations

import io
import json
import logging
import os
import urllib.request
import uuid
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import dramatiq
import pytest
import redis

from dramatiq_unique import ConfigurationError, UniqueMiddleware
from dramatiq_unique.backends import from_url
from dramatiq_unique.dashboard import make_app
from dramatiq_unique.settings import Settings, from_environment, masked
from tests.conftest import free_port, wait_for
from tests.procs import WorkerGroup
from tests.test_cli import run

PASSWORD = "s3cr3t-" + uuid.uuid4().hex[:8]


def with_password(url: str, user: str) -> str:
    """``url`` logging in as ``user`` with :data:`PASSWORD`."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{PASSWORD}@{parts.hostname}:{parts.port}"))


@pytest.fixture
def redis_secret_url(redis_url: str, redis_client: redis.Redis) -> Iterator[str]:
    """The suite's Redis, as an ACL user whose password is in the URL."""
    user = f"app-{uuid.uuid4().hex[:8]}"
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{PASSWORD}", "~*", "&*", "+@all")
    try:
        yield with_password(redis_url, user)
    finally:
        redis_client.execute_command("ACL", "DELUSER", user)


@pytest.fixture
def postgres_secret_url(postgres_url: str) -> str:
    """The suite's PostgreSQL with a password (trust auth accepts it)."""
    return with_password(postgres_url, "postgres") + "?sslmode=disable"


@pytest.fixture(params=["redis", "postgres"])
def secret_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_secret_url"))


def wsgi_get(app: Any, path: str) -> str:
    """The body of a GET of ``path`` from the WSGI ``app``."""
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "wsgi.input": io.BytesIO()}
    status: list[str] = []
    body = b"".join(app(environ, lambda s, headers: status.append(s)))
    assert status == ["200 OK"], (path, body[:300])
    return body.decode()


def test_masked_hides_the_password_of_every_url_form() -> None:
    assert masked(f"redis://app:{PASSWORD}@host:6379/0") == "redis://app:***@host:6379/0"
    assert masked(f"rediss://:{PASSWORD}@host/0") == "rediss://:***@host/0"
    assert masked(f"postgresql://u@h/db?sslmode=require&password={PASSWORD}") == (
        "postgresql://u@h/db?sslmode=require&password=***"
    )
    assert masked(f"unix://:{PASSWORD}@/run/redis.sock?db=1") == "unix://:***@/run/redis.sock?db=1"
    assert masked(f"redis://u:{PASSWORD}@[::1") == "redis://u:***@[::1"  # does not parse: still masked
    for unchanged in ("redis://host:6379/0", "redis://[::1]:6379/0", "postgresql://u@h:5432/db", "redis://h?db=1"):
        assert masked(unchanged) == unchanged
    assert masked(None) is None


def test_the_settings_and_the_middleware_show_no_password(secret_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    middleware = UniqueMiddleware(url=secret_url)
    try:
        settings = middleware.settings
        assert settings.url == secret_url  # still usable: only its showing is masked
        shown = [repr(settings), str(settings), repr(vars(middleware)), masked(secret_url)]
        shown += [repr(from_environment({"dramatiq_unique_url": secret_url})), repr(Settings(url=secret_url))]
        assert all(PASSWORD not in text for text in shown), shown
        assert "***" in repr(settings)
        assert middleware.backend is not None and middleware.backend.check(f"check-{uuid.uuid4().hex}") is None
        assert PASSWORD not in caplog.text
    finally:
        if middleware.backend is not None:
            middleware.backend.close()


def test_a_bad_url_is_refused_without_its_password() -> None:
    for url in (f"redis://u:{PASSWORD}@[::1", f"redis://u:{PASSWORD}@host:99999/0", f"mysql://u:{PASSWORD}@h/db"):
        with pytest.raises(ConfigurationError) as refused:
            UniqueMiddleware(url=url)
        assert PASSWORD not in str(refused.value) and "***" in str(refused.value)


def test_the_command_and_the_dashboard_show_no_password(secret_url: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    backend = from_url(secret_url)
    try:
        key = f"{prefix}:sync_account_balance:{{{'a' * 32}}}:queue"
        assert backend.acquire(key, "m1", ttl=60_000, lock="until_executed").acquired
        for args in (["locks"], ["locks", "--json"], ["inspect", "a" * 32], ["inspect", "a" * 32, "--json"]):
            result = run(*args, "--prefix", prefix, env={"dramatiq_unique_url": secret_url})
            assert result.returncode == 0, result.stderr
            assert PASSWORD not in result.stdout + result.stderr
        broker = f"redis://u:{PASSWORD}@127.0.0.1:1/0"
        refused = run("reap", "--url", secret_url, "--prefix", prefix, "--broker-redis", broker)
        assert refused.returncode == 1 and PASSWORD not in refused.stdout + refused.stderr
        assert "redis://u:***@127.0.0.1:1/0" in refused.stderr, refused.stderr
        listed = json.loads(run("locks", "--json", "--url", secret_url, "--prefix", prefix).stdout)
        assert [lock["key"] for lock in listed] == [key]
        app = make_app(backend, prefix=prefix)
        for path in ("/", "/api/locks", "/api/view", f"/api/locks/{'a' * 32}"):
            assert PASSWORD not in wsgi_get(app, path)
        assert PASSWORD not in repr(vars(app)) + repr(vars(app.admin))
    finally:
        backend.delete_prefix(f"{prefix}:")
        backend.close()


def test_a_failing_connection_shows_no_password(secret_url: str) -> None:
    parts = urlsplit(secret_url)
    unreachable = urlunsplit(parts._replace(netloc=parts.netloc.rsplit(":", 1)[0] + ":1"))
    for args in (["locks"], ["locks", "--json"], ["reap"]):
        result = run(*args, "--url", unreachable, timeout=60)
        assert result.returncode != 0
        assert "Traceback" not in result.stderr
        assert PASSWORD not in result.stdout + result.stderr, result.stderr


@pytest.mark.parametrize(
    "url",
    ["redis://localhost:6379/0?password=s3cret", "redis://user:s3cret@localhost:6379/0"],
)
def test_redis_backend_describe_hides_the_password(url: str) -> None:
    from dramatiq_unique.backends.redis import RedisBackend

    backend = RedisBackend(url=url)
    try:
        assert "s3cret" not in backend.describe()
        assert "s3cret" not in repr(backend)
        assert "***" in backend.describe()
    finally:
        backend.close()


# Real workers at DEBUG --------------------------------------------------------------


def secret_worker_broker() -> None:
    """The broker of the worker processes (``dramatiq tests.test_no_secrets_shown:secret_worker_broker``):
    locks wherever ``dramatiq_unique_url`` says, Dramatiq's ``Prometheus`` and ours, and every lock
    event printed to the log.
    """
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.middleware.prometheus import Prometheus

    from dramatiq_unique.ops.prometheus import LockMetrics

    namespace = os.environ["SECRET_NAMESPACE"]
    broker = RedisBroker(url=os.environ["SECRET_BROKER_URL"], namespace=namespace)
    broker.add_middleware(Prometheus())
    middleware = UniqueMiddleware(prefix=namespace, reschedule_delay=100)
    LockMetrics(middleware)
    middleware.events.subscribe(lambda event: logging.getLogger("secret.events").info("event %r", event))
    broker.add_middleware(middleware)
    done = redis.Redis.from_url(os.environ["SECRET_BROKER_URL"])

    @dramatiq.actor(broker=broker, queue_name=namespace, lock="while_executing", on_conflict="reschedule",
                    max_retries=0)
    def sync(account_id: int) -> None:
        done.rpush(f"{namespace}:done", account_id)

    dramatiq.set_broker(broker)


def scrape(url: str, into: list[str]) -> str:
    """The exposition at ``url`` (also appended to ``into``), or "" while it is not served."""
    try:
        into.append(urllib.request.urlopen(url, timeout=10).read().decode())
    except OSError:
        return ""
    return into[-1]


def wrong_password(url: str) -> str:
    return url.replace(PASSWORD, PASSWORD[::-1])  # the same length: a password that fails


def unreachable(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit(":", 1)[0] + f":{free_port()}"))


@pytest.mark.parametrize("case", ["right", "wrong password", "unreachable"])
def test_a_worker_at_debug_shows_no_password(secret_url, redis_url, redis_client, monkeypatch, tmp_path, case):
    if case == "wrong password" and secret_url.startswith("postgres"):
        pytest.skip("the suite's PostgreSQL trusts every password")
    locks_url = {"right": secret_url, "wrong password": wrong_password(secret_url),
                 "unreachable": unreachable(secret_url)}[case]
    # Given worker processes at DEBUG whose lock URL holds the password, with Prometheus metrics
    namespace, port = f"secret-{uuid.uuid4().hex[:8]}", free_port()
    env = {"SECRET_NAMESPACE": namespace, "SECRET_BROKER_URL": redis_url, "dramatiq_unique_url": locks_url,
           "dramatiq_prom_db": str(tmp_path), "dramatiq_prom_host": "127.0.0.1", "dramatiq_prom_port": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    secret_worker_broker()
    sync: Any = dramatiq.get_broker().get_actor("sync")
    try:
        with WorkerGroup("tests.test_no_secrets_shown:secret_worker_broker", processes=1, threads=2, env=env,
                         extra=("--verbose",)) as workers:
            workers.wait_booted(1)
            # When jobs run (or fail to take their locks)
            for account in (1, 1, 2):
                sync.send(account)
            if case == "right":
                wait_for(lambda: redis_client.llen(f"{namespace}:done") == 3, timeout=30, what="three runs")
            else:
                wait_for(lambda: workers.output().count("failed to take the run lock") >= 3, timeout=60,
                         what="three failed lock calls")
            scraped: list[str] = []
            wait_for(lambda: "dramatiq_unique_lock_events" in scrape(f"http://127.0.0.1:{port}/metrics", scraped),
                     timeout=30, what="the metrics to be served")
            metrics = scraped[-1]
            assert workers.stop() == 0
            output = workers.output()
        # Then the password is in none of the log, at DEBUG, its events, nor the metrics
        assert PASSWORD not in output and PASSWORD[::-1] not in output
        assert PASSWORD not in metrics
        assert "[DEBUG]" in output and "event LockEvent(" in output
        assert "dramatiq_unique_lock_events" in metrics
        assert "Backend(" in output or case == "right"  # the failing backend is named, without its password
    finally:
        dramatiq.get_broker().close()
        redis_client.delete(f"{namespace}:done")


def test_the_dashboard_password_is_shown_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from dramatiq_unique import StubBackend

    monkeypatch.setenv("dramatiq_unique_dashboard_password", PASSWORD)
    settings = from_environment()
    assert settings.dashboard_password == PASSWORD  # still usable: only its showing is masked
    middleware = UniqueMiddleware(backend=StubBackend())
    app = make_app(StubBackend())
    shown = [repr(settings), str(settings), repr(middleware.settings), repr(vars(middleware)), repr(vars(app))]
    shown += [repr(Settings(dashboard_password=PASSWORD)), repr(Settings().merge(dashboard_password=PASSWORD))]
    assert all(PASSWORD not in text for text in shown), shown
    assert "dashboard_password='***'" in repr(settings) and "dashboard_password=None" in repr(Settings())
    assert app.protected
    for bad in (" ", "\udcff" + PASSWORD):
        with pytest.raises(ConfigurationError) as refused:
            from_environment({"DRAMATIQ_UNIQUE_DASHBOARD_PASSWORD": bad})
        assert "DRAMATIQ_UNIQUE_DASHBOARD_PASSWORD=(not shown) is invalid" in str(refused.value)
        assert PASSWORD not in str(refused.value)
