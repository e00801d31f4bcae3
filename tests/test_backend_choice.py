"""Which backend ``UniqueMiddleware()`` picks, in order: an explicit
``backend=``, ``dramatiq_unique_redis_url``, the ``RedisBroker``'s own
client, a ``StubBackend`` for a ``StubBroker``, else a clear error.
"""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker

from dramatiq_unique import ConfigurationError, StubBackend, UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend


def declare_locked(broker):
    def sync(account_id):
        pass

    return dramatiq.actor(sync, broker=broker, lock="while_executing")


def test_an_explicit_backend_wins_over_the_environment(monkeypatch, stub_broker, redis_url):
    monkeypatch.setenv("dramatiq_unique_redis_url", redis_url)
    backend = StubBackend()
    stub_broker.add_middleware(UniqueMiddleware(backend=backend))
    declare_locked(stub_broker)
    assert stub_broker.middleware[-1].backend is backend


def test_the_environment_url_wins_over_the_broker(monkeypatch, stub_broker, redis_url):
    monkeypatch.setenv("DRAMATIQ_UNIQUE_REDIS_URL", redis_url)
    unique = UniqueMiddleware()
    stub_broker.add_middleware(unique)
    declare_locked(stub_broker)
    assert isinstance(unique.backend, RedisBackend) and redis_url in unique.backend.describe()


def test_a_redis_broker_lends_its_own_client(redis_url, redis_client):
    broker = RedisBroker(url=redis_url, namespace="choice")
    unique = UniqueMiddleware()
    broker.add_middleware(unique)
    declare_locked(broker)
    assert isinstance(unique.backend, RedisBackend) and unique.backend.client is broker.client
    broker.close()


def test_a_stub_broker_gets_a_stub_backend(stub_broker):
    unique = UniqueMiddleware()
    stub_broker.add_middleware(unique)
    declare_locked(stub_broker)
    assert isinstance(unique.backend, StubBackend)


def test_otherwise_declaring_a_locked_actor_says_what_to_set(rabbitmq_url):
    broker = RabbitmqBroker(url=rabbitmq_url)
    broker.add_middleware(UniqueMiddleware())
    with pytest.raises(ConfigurationError, match="Set the dramatiq_unique_url environment variable"):
        declare_locked(broker)
    assert "sync" not in broker.actors
    broker.close()
