"""Lock calls on redis-py's public connection methods, on a real Redis,
as they must behave on every redis-py that CI runs (4.6 to 8.x, with and
without hiredis, on Python 3.9 and 3.11+; ``.ci/run``'s redis-py leg):
the replies and errors redis-py gives, a connection that breaks or a
server that goes silent, health checks, RESP3 and its push messages, and
Unix sockets.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry

from dramatiq_unique.backends.records import Release
from dramatiq_unique.backends.redis.calls import ScriptCalls
from dramatiq_unique.backends.redis import RedisBackend
from tests.conftest import free_port, start_redis_server
from tests.faults.proxy import through

#: The installed redis-py, as ``(major, minor)``.
REDIS_PY = tuple(int(part) for part in redis.__version__.split(".")[:2])

SCRIPTS = {
    "echo": "return ARGV[1]",
    "shapes": "return {1, 'two', false, {3, ARGV[1]}}",
    "fail": "return redis.error_reply('BOOM at ' .. ARGV[1])",
    "long": "return string.rep('x', tonumber(ARGV[1]))",
    "touch": "redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1]",
}

#: Keeps the server busy, answering nobody, for ARGV[1] milliseconds.
BUSY = """
local function now() local t = redis.call('TIME') return t[1] * 1000 + t[2] / 1000 end
local until_ms = now() + tonumber(ARGV[1])
while now() < until_ms do end
"""

#: The socket timeout of the silent-server tests, in seconds, and the
#: most a call may then take: one timeout and the time to notice it,
#: never a second timeout.
SOCKET_TIMEOUT = 0.5
AT_MOST = 1.0


def client_of(redis_client: redis.Redis, **options: object) -> redis.Redis:
    where = redis_client.connection_pool.connection_kwargs
    return redis.Redis(host=where["host"], port=where["port"], db=where["db"], **options)  # type: ignore[arg-type]


def own_connection(calls: ScriptCalls) -> redis.Connection:
    [conn] = calls._idle
    return conn


def connections_received(redis_client: redis.Redis) -> int:
    return int(redis_client.info("stats")["total_connections_received"])


def wait_until_silent(redis_client: redis.Redis) -> None:
    probe = client_of(redis_client, socket_timeout=0.05, retry=Retry(NoBackoff(), 0))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            probe.ping()
        except (redis.TimeoutError, redis.ConnectionError):  # a ConnectionError: a timeout, to redis-py 5.0-7.0 on 3.9
            return
    raise AssertionError("the busy script never kept the server from answering")


@contextmanager
def silent_for(redis_client: redis.Redis, milliseconds: int) -> Iterator[None]:
    """Keep the server from answering anybody for ``milliseconds``, from
    the moment it is silent until the block ends, then wait for it again.
    """
    sleeper = threading.Thread(target=lambda: client_of(redis_client).eval(BUSY, 0, milliseconds))
    sleeper.start()
    wait_until_silent(redis_client)
    try:
        yield
    finally:
        sleeper.join()


def timed_out_after(call: Callable[[], object]) -> float:
    """Seconds until ``call`` failed with redis-py's TimeoutError (a
    ``ConnectionError`` fails the test: a timeout reported as a dropped
    connection is what retry policies send again).
    """
    started = time.monotonic()
    with pytest.raises(redis.RedisError) as failure:
        call()
    elapsed = time.monotonic() - started
    assert isinstance(failure.value, redis.TimeoutError), f"{failure.value!r} after {elapsed:.2f} s"
    return elapsed


@pytest.fixture
def stoppable_redis() -> Iterator[tuple[str, int]]:
    """A private redis-server the test may SIGSTOP: its URL and pid.
    It is sent SIGCONT before it is stopped for good.
    """
    port = free_port()
    process = start_redis_server(port)
    try:
        yield f"redis://127.0.0.1:{port}/0", process.pid
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        process.wait()


# Replies ------------------------------------------------------------------


def test_replies_come_back_as_redis_py_reads_them(redis_client):
    # Given the same scripts called through the backend's calls and through redis-py
    calls = ScriptCalls(client_of(redis_client), SCRIPTS)
    # When each shape of reply comes back in one round trip
    replies = calls.batch([("echo", [], ["é"]), ("shapes", [], ["z"]), ("echo", [], [b"\x00\xff"])])
    # Then each is what redis-py's own commands give, in order
    expected = [
        redis_client.eval(SCRIPTS["echo"], 0, "é"),
        redis_client.eval(SCRIPTS["shapes"], 0, "z"),
        redis_client.eval(SCRIPTS["echo"], 0, b"\x00\xff"),
    ]
    assert replies == expected == ["é".encode(), [1, b"two", None, [3, b"z"]], b"\x00\xff"]


def test_an_error_reply_is_returned_in_its_place_as_redis_py_s_class(redis_client):
    # Given a script that fails between two that do not
    calls = ScriptCalls(client_of(redis_client), SCRIPTS)
    # When all three go in one round trip
    before, failed, after = calls.batch([("echo", [], ["a"]), ("fail", [], ["b"]), ("echo", [], ["c"])])
    # Then the failure is redis-py's ResponseError, and the calls around it are answered
    assert (before, after) == (b"a", b"c")
    assert type(failed) is ResponseError and "BOOM at b" in str(failed)
    # And a NOSCRIPT reply is redis-py's NoScriptError: what makes the scripts load again
    [missing] = calls._round_trip([(b"EVALSHA", b"0" * 40, 0)])
    assert isinstance(missing, NoScriptError)


def test_long_replies_and_many_replies_in_one_round_trip_are_each_their_own(redis_client):
    calls = ScriptCalls(client_of(redis_client), SCRIPTS)
    size = 200_017  # several reads off the socket
    replies = calls.batch([("long", [], [size])] * 5 + [("echo", [], [str(i)]) for i in range(2000)])
    assert [len(reply) for reply in replies[:5]] == [size] * 5
    assert replies[5:] == [str(i).encode() for i in range(2000)]


def resp_of(conn: redis.Connection) -> int:
    """The protocol the server speaks on ``conn``, as it says."""
    conn.send_command("CLIENT", "INFO")
    info = conn.read_response().decode()
    return int(info.split(" resp=")[1].split()[0])


#: The protocols to test: redis-py's default, and RESP3 where it has it (5.0+).
PROTOCOLS = ["default", *([3] if REDIS_PY >= (5, 0) else [])]


def pushes_are_read_apart() -> bool:
    """Whether redis-py's parser keeps RESP3 push messages out of the
    replies: not redis-py 5.x's hiredis parser, which returns a key
    tracking push as the next reply (the lock calls never ask for one:
    pushes come to them only from redis-py 8's maintenance
    notifications, which redis-py 8 reads apart).
    """
    return REDIS_PY >= (6, 0) or importlib.util.find_spec("hiredis") is None


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_resp3_connection_is_read_whole_push_messages_included(protocol, redis_client):
    # Given a client of redis-py's default protocol (RESP3 from redis-py 8, which leaves
    # `protocol` unset), or one that asks for RESP3
    options = {} if protocol == "default" else {"protocol": 3}
    calls = ScriptCalls(client_of(redis_client, **options), SCRIPTS)
    assert calls.call("echo", [], ["warm"]) == b"warm"
    conn = own_connection(calls)
    resp = resp_of(conn)
    assert resp == (3 if protocol == 3 or REDIS_PY >= (8, 0) else 2)
    if resp == 3 and pushes_are_read_apart():
        # And the server pushes on it: it tracks a key that the next call writes
        conn.send_command("CLIENT", "TRACKING", "on")
        assert conn.read_response() == b"OK"
        conn.send_command("GET", "tracked")
        assert conn.read_response() is None
    # When calls write it, in one round trip and then alone
    replies = calls.batch([("touch", ["tracked"], ["a"]), ("echo", [], ["b"]), ("shapes", [], ["c"])])
    alone = calls.call("echo", [], ["d"])
    # Then each call gets its own reply, never a push message in its place
    assert replies == [b"a", b"b", [1, b"two", None, [3, b"c"]]] and alone == b"d"


# Connections that break ---------------------------------------------------


def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_call(redis_client):
    # Given a client that never retries: only the idle check can save the call
    calls = ScriptCalls(client_of(redis_client, retry=Retry(NoBackoff(), 0)), SCRIPTS)
    assert calls.call("echo", [], ["warm"]) == b"warm"
    # When the server closes that idle connection
    assert redis_client.client_kill_filter(_type="normal", skipme=True) >= 1
    before = connections_received(redis_client)
    # Then the next call goes out on a fresh connection and is answered
    assert calls.call("echo", [], ["again"]) == b"again"
    assert connections_received(redis_client) == before + 1


def test_a_connection_lost_mid_call_is_retried_on_a_fresh_connection(redis_url, proxy):
    # Given a client that retries once, through a network that resets the
    # connection of the next call instead of passing its reply on
    calls = ScriptCalls(redis.Redis.from_url(through(proxy, redis_url), retry=Retry(NoBackoff(), 1)), SCRIPTS)
    assert calls.call("echo", [], ["warm"]) == b"warm"
    proxy.lose_replies(b"through", times=1)
    # When the call is made
    reply = calls.call("echo", [], ["through"])
    # Then its reply was lost once, and the retry on a new connection answers it
    assert proxy.replies_lost == 1
    assert reply == b"through"


def backend_made_from(made_from: str, url: str, **options: object) -> RedisBackend:
    """A RedisBackend that makes its own client, from a URL or from
    parameters, or one on the client of a Redis broker, as the
    middleware picks it when given no backend.
    """
    if made_from == "url":
        return RedisBackend(url=url, **options)
    if made_from == "the broker's client":
        return RedisBackend(client=RedisBroker(url=url, **options).client)
    where = redis.Redis.from_url(url).connection_pool.connection_kwargs
    return RedisBackend(host=where["host"], port=where["port"], db=where["db"], **options)


@pytest.mark.parametrize("made_from", ["url", "parameters", "the broker's client"])
def test_a_backend_s_own_client_sends_a_call_again_when_its_connection_was_dropped(made_from, redis_url, proxy):
    # Given a backend that made its own client, or one on a client that names no retry policy
    # (redis-py retries nothing on one made from a URL, as the Redis broker's is), through a
    # network that resets a connection after its call went out
    backend = backend_made_from(made_from, through(proxy, redis_url))
    assert backend.calls is not None
    assert backend.release("retried:{k}:run", "nobody") == Release(False)
    proxy.lose_replies(b"retried:{k}:run", times=1)
    # Then the call goes out again on a fresh connection and is answered
    assert backend.release("retried:{k}:run", "nobody") == Release(False)
    assert proxy.replies_lost == 1


@pytest.mark.parametrize("given_to", ["the backend", "its client"])
def test_a_retry_policy_given_wins(given_to, redis_url, proxy):
    # Given a backend, or the client it is given, told never to retry
    url = through(proxy, redis_url)
    never = Retry(NoBackoff(), 0)
    if given_to == "the backend":
        backend = RedisBackend(url=url, retry=never)
    else:
        backend = RedisBackend(client=redis.Redis.from_url(url, retry=never))
    assert backend.calls is not None
    backend.release("retried:{k}:run", "nobody")
    # When a connection is reset after its call went out
    proxy.lose_replies(b"retried:{k}:run", times=1)
    # Then the call fails
    with pytest.raises(redis.ConnectionError):
        backend.release("retried:{k}:run", "nobody")


# A silent server ----------------------------------------------------------


def test_a_silent_server_fails_the_call_with_a_timeout_and_the_next_call_is_answered(redis_client):
    # Given a client with a short socket timeout and no retries
    calls = ScriptCalls(client_of(redis_client, socket_timeout=0.2, retry=Retry(NoBackoff(), 0)), SCRIPTS)
    assert calls.call("echo", [], ["warm"]) == b"warm"
    # When the server stops answering for longer than that
    with silent_for(redis_client, 1500):
        # Then the call fails as redis-py's TimeoutError
        assert timed_out_after(lambda: calls.call("echo", [], ["late"])) < 0.2 + 0.4
    # And once the server answers again, so do calls, with no stray reply read for theirs
    assert calls.batch([("echo", [], ["one"]), ("echo", [], ["two"])]) == [b"one", b"two"]


def test_a_health_checked_connection_reads_its_own_replies_between_ours(redis_client):
    # Given a client whose health check is due before every call (10 ms after the last reply)
    calls = ScriptCalls(client_of(redis_client, health_check_interval=0.01), SCRIPTS)
    before = int(redis_client.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))
    replies = []
    for i in range(3):
        time.sleep(0.02)  # the interval passes: a clock, not a condition
        replies.append(calls.call("echo", [], [str(i)]))
    # Then redis-py sent its PINGs and read the PONGs itself, and each call read its own reply
    assert replies == [b"0", b"1", b"2"]
    assert int(redis_client.info("commandstats")["cmdstat_ping"]["calls"]) >= before + 2


@pytest.mark.parametrize("made_from", ["url", "parameters"])
def test_a_backend_s_own_client_does_not_multiply_its_socket_timeout(made_from, redis_url, redis_client):
    # Given a backend of its own client, with a socket timeout of 0.2 s
    backend = backend_made_from(made_from, redis_url, socket_timeout=0.2)
    backend.release("retried:{k}:run", "nobody")
    # When the server stops answering for 1.5 s
    with silent_for(redis_client, 1500):
        # Then the call times out once, not once per retry (redis-py's own default
        # for a client made from parameters would take 11 of them: 2.2 s)
        assert timed_out_after(lambda: backend.release("retried:{k}:run", "nobody")) < 0.6


def test_a_fresh_connection_to_a_server_that_never_answers_fails_as_one_timeout():
    # Given a listening socket that accepts connections and never answers
    # (redis-py 5.0-7.0's hiredis parser on Python 3.9 reported this as a
    # dropped connection, sent again: ConnectionError after 2.1 s)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        backend = RedisBackend(url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0", socket_timeout=SOCKET_TIMEOUT)
        # When a lock call connects to it
        elapsed = timed_out_after(lambda: backend.release("silent:{k}:run", "nobody"))
    # Then it fails after one socket timeout, as a timeout
    assert SOCKET_TIMEOUT <= elapsed < AT_MOST


@pytest.mark.parametrize("health_check", [False, True])
def test_a_stopped_server_fails_a_lock_call_as_one_timeout(health_check, stoppable_redis):
    # Given a backend of its own client on a Redis, connected, whose health check may be due
    url, pid = stoppable_redis
    options = {"health_check_interval": 0.01} if health_check else {}
    backend = RedisBackend(url=url, socket_timeout=SOCKET_TIMEOUT, **options)
    assert backend.release("stopped:{k}:run", "nobody") == Release(False)
    # When the server is frozen (SIGSTOP: connections open, nothing answered)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.02)  # the health check's interval passes: a clock, not a condition
    # Then the call fails after one socket timeout, as a timeout (redis-py 7.0.1 and
    # hiredis on Python 3.9 reported it as a dropped connection: 2.45 s and more)
    elapsed = timed_out_after(lambda: backend.release("stopped:{k}:run", "nobody"))
    assert SOCKET_TIMEOUT <= elapsed < AT_MOST
    # And once it wakes up, the next call is answered
    os.kill(pid, signal.SIGCONT)
    assert backend.release("stopped:{k}:run", "nobody") == Release(False)


# Unix sockets -------------------------------------------------------------


def test_a_backend_on_a_unix_socket_url_takes_and_releases_locks():
    # Given a Redis on a Unix socket, and a backend made from its unix:// URL
    # (redis-py 4.5 refused the backend's socket_connect_timeout there)
    path = Path(tempfile.mkdtemp(prefix="dramatiq-unique-unix-")) / "redis.sock"
    process = start_redis_server(free_port(), "--unixsocket", str(path), "--unixsocketperm", "700")
    try:
        backend = RedisBackend(url=f"unix://{path}?db=0")
        # Then lock calls work there
        assert backend.acquire("unix:{k}:run", "a", ttl=10_000).acquired
        assert backend.acquire("unix:{k}:run", "b", ttl=10_000).holder == "a"
        assert backend.release("unix:{k}:run", "a") == Release(True)
    finally:
        process.terminate()
        process.wait()


# Renewals on a connection of one's own --------------------------------------


def test_the_native_extender_renews_a_lease_as_extend_does(redis_url, redis_client):
    # Given a lease of 300 ms, and the extender the backend gives the lease
    # keeper's native thread under gevent (a connection of its own, mirroring
    # the client's as this redis-py describes it)
    backend = RedisBackend(url=redis_url)
    assert backend.acquire("renewed:{k}:run", "a", ttl=300).acquired
    extender = backend.native_extender()
    assert extender is not None
    # When it renews the holder's lease, and a stranger's
    held = extender([("renewed:{k}:run", "a"), ("renewed:{k}:run", "b")], 60_000, timeout=2_000)
    extender.close()
    # Then the holder's lease runs 60 s from now, and a stranger's renewal is refused
    seconds, micros = redis_client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    assert held == [True, False]
    assert backend.inspect("renewed:{k}:run").holders["a"] > now + 50_000
