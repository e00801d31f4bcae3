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
import uuid
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from dramatiq_unique import ConfigurationError, UniqueMiddleware
from dramatiq_unique.backends import from_url
from dramatiq_unique.dashboard import make_app
from dramatiq_unique.settings import Settings, from_environment, masked
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
