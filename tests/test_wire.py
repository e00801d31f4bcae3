"""Lock calls read off the socket by hand (``backends/wire.py``), on a
real Redis: the replies and errors redis-py would give, a socket that
breaks or goes silent, replies longer than one read, and a connection
that redis-py health-checks in between.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry

from dramatiq.brokers.redis import RedisBroker

from dramatiq_unique.backend import Release
from dramatiq_unique.backends import wire
from dramatiq_unique.backends.calls import ScriptCalls
from dramatiq_unique.backends.redis import RedisBackend

SCRIPTS = {
    "echo": "return ARGV[1]",
    "shapes": "return {1, 'two', false, {3, ARGV[1]}}",
    "fail": "return redis.error_reply('BOOM at ' .. ARGV[1])",
    "long": "return string.rep('x', tonumber(ARGV[1]))",
}


#: Keeps the server busy, answering nobody, for ARGV[1] milliseconds.
BUSY = """
local function now() local t = redis.call('TIME') return t[1] * 1000 + t[2] / 1000 end
local until_ms = now() + tonumber(ARGV[1])
while now() < until_ms do end
"""


def wait_until_silent(redis_client: redis.Redis) -> None:
    probe = client_of(redis_client, socket_timeout=0.05, retry=Retry(NoBackoff(), 0))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            probe.ping()
        except redis.TimeoutError:
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
    """Seconds until ``call`` failed with redis-py's TimeoutError."""
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        call()
    return time.monotonic() - started


def calls_on(client: redis.Redis) -> ScriptCalls:
    calls = ScriptCalls(client, SCRIPTS)
    assert calls.raw, "hiredis is installed with the test extra: these calls must be read by hand"
    return calls


def client_of(redis_client: redis.Redis, **options: object) -> redis.Redis:
    where = redis_client.connection_pool.connection_kwargs
    return redis.Redis(host=where["host"], port=where["port"], db=where["db"], **options)  # type: ignore[arg-type]


def own_connection(calls: ScriptCalls) -> redis.Connection:
    [conn] = calls._idle
    return conn


def test_replies_come_back_as_redis_py_reads_them(redis_client):
    # Given the same scripts called by hand and through redis-py
    calls = calls_on(redis_client)
    # When each shape of reply comes back in one round trip
    replies = calls.batch([("echo", [], ["é"]), ("shapes", [], ["z"]), ("echo", [], [b"\x00\xff"])])
    # Then each is what redis-py's own parser gives, in order
    expected = [
        redis_client.eval(SCRIPTS["echo"], 0, "é"),
        redis_client.eval(SCRIPTS["shapes"], 0, "z"),
        redis_client.eval(SCRIPTS["echo"], 0, b"\x00\xff"),
    ]
    assert replies == expected == ["é".encode(), [1, b"two", None, [3, b"z"]], b"\x00\xff"]


def test_an_error_reply_is_returned_in_its_place_as_redis_py_s_class(redis_client):
    # Given a script that fails between two that do not
    calls = calls_on(redis_client)
    # When all three go in one round trip
    before, failed, after = calls.batch([("echo", [], ["a"]), ("fail", [], ["b"]), ("echo", [], ["c"])])
    # Then the failure is redis-py's ResponseError, and the calls around it are answered
    assert (before, after) == (b"a", b"c")
    assert type(failed) is ResponseError and "BOOM at b" in str(failed)
    # And a NOSCRIPT reply is redis-py's NoScriptError: what makes the scripts load again
    [missing] = calls._round_trip([(b"EVALSHA", b"0" * 40, 0)])
    assert isinstance(missing, NoScriptError)


def test_a_reply_longer_than_one_read_is_read_whole(redis_client):
    # Given replies far longer than one read off the socket, many of them
    calls = calls_on(redis_client)
    size = 3 * wire.READ_SIZE + 17
    # When they come back in one round trip
    replies = calls.batch([("long", [], [size])] * 5 + [("echo", [], ["last"])])
    # Then each is whole, and the one after them too
    assert [len(reply) for reply in replies[:5]] == [size] * 5
    assert replies[5] == b"last"


def test_many_replies_in_one_round_trip_are_each_their_own(redis_client):
    calls = calls_on(redis_client)
    replies = calls.batch([("echo", [], [str(i)]) for i in range(2000)])
    assert replies == [str(i).encode() for i in range(2000)]


def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_call(redis_client):
    # Given a client that never retries: only the idle check can save the call
    calls = calls_on(client_of(redis_client, retry=Retry(NoBackoff(), 0)))
    assert calls.call("echo", [], ["warm"]) == b"warm"
    conn = own_connection(calls)
    # When the server closes that idle connection
    host, port = conn._sock.getsockname()[:2]
    assert redis_client.client_kill_filter(addr=f"{host}:{port}") == 1
    # Then the next call goes out on a fresh socket and is answered
    old = conn._sock
    assert calls.call("echo", [], ["again"]) == b"again"
    assert conn._sock is not None and conn._sock is not old


def test_a_connection_lost_mid_call_is_retried_on_a_fresh_socket(redis_client, monkeypatch):
    # Given a client that retries once, and a connection the server drops
    # after the idle check (so that the send or the read finds it gone)
    calls = calls_on(client_of(redis_client, retry=Retry(NoBackoff(), 1)))
    assert calls.call("echo", [], ["warm"]) == b"warm"
    conn = own_connection(calls)
    old = conn._sock
    old.shutdown(2)  # as a network failure leaves it: closed under the connection
    monkeypatch.setattr(wire, "readable", lambda _conn: False)
    # When the call is made
    reply = calls.call("echo", [], ["through"])
    # Then the retry answers it, on a new socket with a new, empty reader
    assert reply == b"through"
    assert conn._sock is not old and conn._unique_socket.sock is conn._sock


def test_a_silent_server_fails_the_call_with_a_timeout_and_the_next_call_is_answered(redis_client):
    # Given a client with a short socket timeout and no retries
    calls = calls_on(client_of(redis_client, socket_timeout=0.2, retry=Retry(NoBackoff(), 0)))
    assert calls.call("echo", [], ["warm"]) == b"warm"
    # When the server stops answering for longer than that
    with silent_for(redis_client, 1500):
        # Then the call fails as redis-py's TimeoutError, and leaves no socket behind
        timed_out_after(lambda: calls.call("echo", [], ["late"]))
        assert own_connection(calls)._sock is None
    # And once the server answers again, so do calls, with no stray reply read for theirs
    assert calls.batch([("echo", [], ["one"]), ("echo", [], ["two"])]) == [b"one", b"two"]


def test_a_plain_socket_keeps_the_connection_s_timeout_in_the_kernel(redis_client):
    # Given a client with a socket timeout of 1.25 s
    calls = calls_on(client_of(redis_client, socket_timeout=1.25))
    assert calls.call("echo", [], ["warm"]) == b"warm"
    sock = own_connection(calls)._sock
    # Then its socket blocks, with no Python-level wait before each read and write,
    # and the kernel times a silent server out after those 1.25 s both ways (in its
    # own ticks: Linux rounds up to one of them, at most 10 ms)
    assert sock.gettimeout() is None
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        seconds, micros = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("ll")))
        assert 1.25 <= seconds + micros / 1_000_000 <= 1.26


def test_a_timeout_under_a_microsecond_is_still_a_timeout_in_the_kernel():
    # Given a socket whose timeout is too short for a timeval's microseconds
    with socket.socket() as sock:
        sock.settimeout(1e-7)
        # When the timeout moves into the kernel
        wire._timeout_in_kernel(sock)
        # Then the kernel holds a timeout both ways, not the zero that means none
        assert sock.gettimeout() is None
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            assert struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("ll"))) != (0, 0)


def test_a_health_checked_connection_reads_its_own_replies_between_ours(redis_client):
    # Given a client that health-checks its connections before every use
    calls = calls_on(client_of(redis_client, health_check_interval=1))
    conn_replies = [calls.call("echo", [], [str(i)]) for i in range(3)]
    conn = own_connection(calls)
    # When the check is due, redis-py sends its PING and reads the PONG itself
    conn.next_health_check = 0
    # Then our call after it reads its own reply, not the PONG
    assert calls.call("echo", [], ["after the check"]) == b"after the check"
    assert conn_replies == [b"0", b"1", b"2"]
    assert conn.next_health_check > 0


def test_redis_py_reads_what_we_cannot(redis_client):
    # Without hiredis, or on RESP3, the connection's own parser reads the replies
    resp3 = client_of(redis_client, protocol=3, socket_timeout=2)
    assert not wire.readable_by_us(resp3)
    calls = ScriptCalls(resp3, SCRIPTS)
    assert not calls.raw
    assert calls.call("echo", [], ["resp3"]) == b"resp3"
    assert calls.call("echo", [], ["again"]) == b"again"
    # and its socket keeps the timeout that redis-py's reads expect
    assert own_connection(calls)._sock.gettimeout() == 2


def backend_made_from(made_from: str, redis_url: str, redis_client: redis.Redis, **options: object) -> RedisBackend:
    """A RedisBackend that makes its own client, from a URL or from
    parameters, or one on the client of a Redis broker, as the
    middleware picks it when given no backend.
    """
    if made_from == "url":
        return RedisBackend(url=redis_url, **options)
    if made_from == "the broker's client":
        return RedisBackend(client=RedisBroker(url=redis_url, **options).client)
    where = redis_client.connection_pool.connection_kwargs
    return RedisBackend(host=where["host"], port=where["port"], db=where["db"], **options)


@pytest.mark.parametrize("made_from", ["url", "parameters", "the broker's client"])
def test_a_backend_s_own_client_sends_a_call_again_when_its_connection_was_dropped(
    made_from, redis_url, redis_client, monkeypatch
):
    # Given a backend that made its own client, or one on a client that names no retry policy
    # (redis-py retries nothing on one made from a URL, as the Redis broker's is)
    backend = backend_made_from(made_from, redis_url, redis_client)
    assert backend.calls is not None
    assert backend.release("retried:{k}:run", "nobody") == Release(False)
    conn = own_connection(backend.calls)
    old = conn._sock
    # When its connection is dropped after the idle check, as a reset in flight would be
    old.shutdown(socket.SHUT_RDWR)
    monkeypatch.setattr(wire, "readable", lambda _conn: False)
    # Then the call goes out again on a fresh connection and is answered
    assert backend.release("retried:{k}:run", "nobody") == Release(False)
    assert conn._sock is not None and conn._sock is not old


@pytest.mark.parametrize("given_to", ["the backend", "its client"])
def test_a_retry_policy_given_wins(given_to, redis_url, redis_client, monkeypatch):
    # Given a backend, or the client it is given, told never to retry
    never = Retry(NoBackoff(), 0)
    if given_to == "the backend":
        backend = RedisBackend(url=redis_url, retry=never)
    else:
        backend = RedisBackend(client=redis.Redis.from_url(redis_url, retry=never))
    assert backend.calls is not None
    backend.release("retried:{k}:run", "nobody")
    own_connection(backend.calls)._sock.shutdown(socket.SHUT_RDWR)
    monkeypatch.setattr(wire, "readable", lambda _conn: False)
    # Then a dropped connection fails the call
    with pytest.raises(redis.ConnectionError):
        backend.release("retried:{k}:run", "nobody")


@pytest.mark.parametrize("made_from", ["url", "parameters"])
def test_a_backend_s_own_client_does_not_multiply_its_socket_timeout(made_from, redis_url, redis_client):
    # Given a backend of its own client, with a socket timeout of 0.2 s
    backend = backend_made_from(made_from, redis_url, redis_client, socket_timeout=0.2)
    backend.release("retried:{k}:run", "nobody")
    # When the server stops answering for 1.5 s
    with silent_for(redis_client, 1500):
        # Then the call times out once, not once per retry (redis-py's own default
        # for a client made from parameters would take 11 of them: 2.2 s)
        assert timed_out_after(lambda: backend.release("retried:{k}:run", "nobody")) < 0.6


def test_a_health_check_that_meets_a_silent_server_times_out_once(redis_url, redis_client):
    # Given a backend of its own client that health-checks its connections, with a socket timeout of 0.5 s
    backend = RedisBackend(url=redis_url, socket_timeout=0.5, health_check_interval=1)
    assert backend.calls is not None
    backend.release("retried:{k}:run", "nobody")
    conn = own_connection(backend.calls)
    conn.next_health_check = 0  # the check is due before the next call
    # When the server stops answering for 2.5 s
    with silent_for(redis_client, 2500):
        # Then redis-py's check fails with its TimeoutError, once, as our own read would:
        # not as a dropped connection, which is sent again after each timeout
        assert timed_out_after(lambda: backend.release("retried:{k}:run", "nobody")) < 0.8  # two would take 1 s
    # And once the server answers, the next call is answered, on a socket timed in the kernel again
    assert backend.release("retried:{k}:run", "nobody") == Release(False)
    assert conn._sock.gettimeout() is None
