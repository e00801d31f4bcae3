"""``dramatiq_unique.testing``, used the way a user would: a small test
file run by ``pytester`` in a fresh ``pytest`` process, which picks the
plugin up through its entry point; and the helpers called directly.
"""

from __future__ import annotations

import importlib.metadata
import re
import uuid

import dramatiq
import pytest
import redis

from dramatiq_unique import ConfigurationError, UniqueMiddleware
from dramatiq_unique.testing import assert_duplicate, disabled
from tests.conftest import free_port, make_worker

pytest_plugins = ("pytester",)

USER_TESTS = '''
import dramatiq
import pytest
import redis
from dramatiq import Worker
from dramatiq.brokers.stub import StubBroker

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.testing import assert_duplicate, disabled


@pytest.fixture
def broker():
    broker = StubBroker()
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


def declare(broker):
    @dramatiq.actor(broker=broker, lock="until_executed")
    def sync_account_balance(account_id):
        pass

    return sync_account_balance


def run_all(broker):
    worker = Worker(broker, worker_timeout=50)
    worker.start()
    broker.join("default")
    worker.join()
    worker.stop()


def test_with_the_stub_backend(broker, unique_stub_backend):
    broker.add_middleware(UniqueMiddleware(backend=unique_stub_backend))
    sync = declare(broker)
    first = sync.send(42)
    assert assert_duplicate(sync.send(42), of=first) == first.message_id
    with disabled(broker):
        assert "unique_duplicate_of" not in sync.send(42).options
    assert_duplicate(sync.send(42), of=first.message_id)
    run_all(broker)
    assert "unique_duplicate_of" not in sync.send(42).options
    assert list(unique_stub_backend.scan("*")) != []


def test_with_redis(broker, unique_redis_backend, unique_prefix):
    broker.add_middleware(UniqueMiddleware(backend=unique_redis_backend, prefix=unique_prefix))
    sync = declare(broker)
    first = sync.send(42)
    assert_duplicate(sync.send(42), of=first)
    assert [key.split(":")[0] for key in unique_redis_backend.scan(unique_prefix + ":*")] == [unique_prefix]
    print("PREFIX", unique_prefix)


def test_a_message_that_was_enqueued(broker, unique_stub_backend):
    broker.add_middleware(UniqueMiddleware(backend=unique_stub_backend))
    sync = declare(broker)
    assert_duplicate(sync.send(1))


def test_a_duplicate_of_another_message(broker, unique_stub_backend):
    broker.add_middleware(UniqueMiddleware(backend=unique_stub_backend))
    sync = declare(broker)
    sync.send(1)
    assert_duplicate(sync.send(1), of="someone-else")
'''


@pytest.fixture
def installed_plugin() -> None:
    """Fail with how to fix it when the entry point is not installed."""
    found = [e for e in importlib.metadata.entry_points(group="pytest11") if e.value == "dramatiq_unique.testing"]
    if not found:
        pytest.fail("The pytest plugin is not installed: run `pip install -e .` in the repository.")


def test_the_plugin_serves_users_tests(pytester, installed_plugin, monkeypatch, redis_url):
    # Given a user's test file, and the suite's Redis as theirs
    monkeypatch.setenv("REDIS_URL", redis_url)
    pytester.makepyfile(test_user=USER_TESTS)
    # When pytest runs it in a fresh process
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-q")
    # Then the fixtures work, and failed assertions say what happened
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*AssertionError: sync_account_balance(1) (message *) was enqueued, not refused as a duplicate.",
        "*AssertionError: sync_account_balance(1) was refused as a duplicate of message *, "
        "not of message someone-else.",
    ])
    # And the Redis test's keys were cleaned up after it
    [prefix] = re.findall(r"PREFIX (\S+)", result.stdout.str())
    client = redis.Redis.from_url(redis_url)
    assert prefix.startswith("dramatiq-unique-test-") and list(client.scan_iter(f"{prefix}*")) == []


def test_the_redis_fixture_fails_with_directions_when_redis_is_down(pytester, installed_plugin, monkeypatch):
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    pytester.makepyfile(test_down="def test_it(unique_redis_backend):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*Redis does not answer at redis://127.0.0.1:*/0 (*): start one with `redis-server`, "
                                 "or set REDIS_URL.*"])


def test_disabled_nests_and_restores_every_middleware_of_a_broker(stub_broker):
    first, second = UniqueMiddleware(), UniqueMiddleware(enabled=False)
    stub_broker.add_middleware(first)
    stub_broker.add_middleware(second)
    with disabled(stub_broker):
        assert not first.enabled and not second.enabled
        with disabled(first):
            assert not first.enabled
        assert not first.enabled
    assert first.enabled and not second.enabled
    with pytest.raises(RuntimeError), disabled(first):
        raise RuntimeError("the block failed")
    assert first.enabled


def test_disabled_refuses_a_broker_without_the_middleware(stub_broker):
    with pytest.raises(ConfigurationError, match="neither a UniqueMiddleware nor a broker that has one"):
        with disabled(stub_broker):
            pass


def test_a_message_run_while_disabled_leaves_the_lock_alone(stub_broker):
    # Given a lock taken by a send, and a copy of the message seeded while disabled
    middleware = UniqueMiddleware()
    stub_broker.add_middleware(middleware)
    ran = []

    def sync(account_id):
        ran.append(account_id)

    actor = dramatiq.actor(sync, broker=stub_broker, actor_name=f"sync_{uuid.uuid4().hex[:6]}", lock="until_executed")
    holder = actor.send(1)
    stub_broker.queues["default"].get()  # take the holder off the queue: only its lock matters here
    stub_broker.queues["default"].task_done()
    with disabled(stub_broker):
        actor.send(1)
    # When the seeded copy runs with locking back on
    worker = make_worker(stub_broker)
    stub_broker.join("default")
    worker.stop()
    # Then it ran, and the holder's lock is untouched and reported nowhere as lost
    assert ran == [1]
    assert_duplicate(actor.send(1), of=holder)
    assert middleware.events.count("lock_lost") == 0 and middleware.events.count("released") == 0
