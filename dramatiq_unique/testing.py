"""Helpers for testing your own actors: pytest fixtures, a switch that turns uniqueness off, and an
assertion for refused duplicates.  See docs/testing.md for examples.

The fixtures come as a pytest plugin that pytest loads by itself once dramatiq-unique is installed:

* ``unique_stub_backend``: a fresh in-memory :class:`StubBackend`;
* ``unique_prefix``: a key prefix that no other test uses;
* ``unique_redis_backend``: a Redis lock backend on ``REDIS_URL`` (default
  ``redis://127.0.0.1:6379/0``); keys under ``unique_prefix`` are deleted after the test, and the
  test fails, saying how to get one, when that Redis does not answer.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

from .model.wire import UNIQUE_DUPLICATE_OF, check_key

# A pytest plugin wherever dramatiq-unique is installed: import nothing heavy, so a broken install breaks no other run.
if TYPE_CHECKING:
    from dramatiq import Broker, Message

    from .backends import StubBackend
    from .backends.base import LockBackend
    from .middleware import UniqueMiddleware

#: The Redis the ``unique_redis_backend`` fixture uses when ``REDIS_URL`` is not set.
DEFAULT_TEST_REDIS_URL = "redis://127.0.0.1:6379/0"


def _middlewares(target: Union["UniqueMiddleware", "Broker"]) -> list["UniqueMiddleware"]:
    from .errors import ConfigurationError
    from .middleware import UniqueMiddleware

    if isinstance(target, UniqueMiddleware):
        return [target]
    found = [m for m in getattr(target, "middleware", ()) if isinstance(m, UniqueMiddleware)]
    if not found:
        raise ConfigurationError(f"{target!r} is neither a UniqueMiddleware nor a broker that has one.")
    return found


@contextlib.contextmanager
def disabled(target: Union["UniqueMiddleware", "Broker"]) -> Iterator[None]:
    """Turn locking off inside a ``with`` block, for one middleware or every one of a broker.

    Sends inside take no lock and are never refused; messages that start running inside neither
    take nor release locks.  Nested blocks restore what was there before.

    Raises:
      ConfigurationError: when a broker has no ``UniqueMiddleware``.
    """
    middlewares = _middlewares(target)
    before = [m.enabled for m in middlewares]
    for middleware in middlewares:
        middleware.enabled = False
    try:
        yield
    finally:
        for middleware, enabled in zip(middlewares, before):
            middleware.enabled = enabled


def assert_duplicate(message: "Message[Any]", of: Union["Message[Any]", str, None] = None) -> str:
    """Assert that ``send()`` refused ``message`` as a duplicate under the client strategy ``log``.

    For ``raise``, use ``pytest.raises(DuplicateMessage)``.

    Parameters:
      message(Message): What ``send()`` returned.
      of(Message|str): The message, or message id, expected to hold the lock.

    Returns:
      str: The id of the message that holds the lock.

    Raises:
      AssertionError: when ``message`` was enqueued, or another message holds the lock.
    """
    holder = message.options.get(UNIQUE_DUPLICATE_OF)
    if holder is None:
        raise AssertionError(f"{message} (message {message.message_id}) was enqueued, not refused as a duplicate.")
    expected = getattr(of, "message_id", of)
    if expected is not None and holder != expected:
        raise AssertionError(f"{message} was refused as a duplicate of message {holder}, not of message {expected}.")
    return str(holder)


def wait_for_releases(target: Union[UniqueMiddleware, "Broker"], timeout: int = 10_000) -> None:
    """Wait at most ``timeout`` ms until the run locks released in the background reach the backend.

    A worker's ``join()`` returns once every message is processed; on Redis the release comes a moment later.

    Raises:
      TimeoutError: when releases are still pending after ``timeout``.
    """
    for middleware in _middlewares(target):
        releaser = middleware.threads.releaser
        if releaser is not None and not releaser.drain(timeout):
            raise TimeoutError(f"{releaser.pending()} run lock release(s) still pending after {timeout} ms.")


def redis_backend_for_tests(url: Optional[str] = None) -> "LockBackend":
    """A Redis lock backend on ``url``, ``REDIS_URL`` or :data:`DEFAULT_TEST_REDIS_URL`.

    Raises:
      ConfigurationError: naming the URL, when Redis does not answer.
    """
    from .backends import from_url
    from .errors import ConfigurationError

    url = url or os.environ.get("REDIS_URL") or DEFAULT_TEST_REDIS_URL
    backend = from_url(url, socket_connect_timeout=2)
    try:
        backend.check(check_key("dramatiq-unique-test"))
    except Exception as e:
        backend.close()
        raise ConfigurationError(
            f"Redis does not answer at {url} ({e}): start one with `redis-server`, or set REDIS_URL."
        ) from None
    return backend


def delete_prefix(backend: "LockBackend", prefix: str) -> int:
    """Delete every key under ``prefix`` (locks, waiters and message records); return how many."""
    return backend.delete_prefix(f"{prefix}:")


try:
    import pytest
except ImportError:  # pragma: no cover - the helpers above work without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def unique_stub_backend() -> "StubBackend":
        """A fresh in-memory lock backend."""
        from .backends import StubBackend

        return StubBackend()

    @pytest.fixture
    def unique_prefix() -> str:
        """A lock key prefix of this test's own."""
        return f"dramatiq-unique-test-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def unique_redis_backend(unique_prefix: str) -> Iterator["LockBackend"]:
        """A Redis lock backend; the keys under ``unique_prefix`` are deleted after the test."""
        from .errors import ConfigurationError

        try:
            backend = redis_backend_for_tests()
        except ConfigurationError as e:
            pytest.fail(str(e), pytrace=False)
        yield backend
        delete_prefix(backend, unique_prefix)
        backend.close()
