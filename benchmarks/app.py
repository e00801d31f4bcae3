"""The contenders: one broker and one actor each, built the same way by
the driver (which sends) and by the ``dramatiq`` worker (which runs).

Every contender runs the same ``job(key, seq)``: ``key`` is what it is
locked by, ``seq`` numbers the send, and the body only records when it
started and ended (after sleeping ``seconds``, or spinning for ``cpu``
seconds of its thread's CPU, when those are not 0).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend as RateLimiterBackend

from dramatiq_unique import DEFAULT_LEASE, EVENTS, LOCK_TYPES, UniqueMiddleware
from dramatiq_unique.backends.redis import RedisBackend
from dramatiq_unique.settings import from_environment as from_settings

from . import pg_app, trips

#: Dramatiq with no middleware of ours.
BARE = "bare"
#: The mutex a Dramatiq user would write: ``ConcurrentRateLimiter(limit=1)``
#: around the actor body.
RECIPE = "ConcurrentRateLimiter"
#: Not a contender but the yardstick: one PING where a lock would be
#: taken at enqueue, and one each where a run lock would be taken and
#: released.  It measures what bare round trips cost on this machine.
FLOOR = "floor"
#: The floor of a lock that costs one round trip on the worker thread:
#: one PING in ``before_process_message``, nothing else.
FLOOR_ONE = "floor1"
#: The same round trip with no client library: one PING in
#: ``before_process_message`` written and read on a bare socket.  What
#: no lock that waits for Redis on the worker thread can go below.
FLOOR_RAW = "floor0"
#: The floor of this lock's own scripts: ``start.lua`` in
#: ``before_process_message`` on a bare socket, with the thread's last
#: ``release.lua`` riding in front of it, and no other client work: no
#: group commit, lease, event or state.  What no client of these
#: scripts can go below.
FLOOR_LOCK = "floorL"
CONTENDERS = (BARE, *LOCK_TYPES, RECIPE, FLOOR, FLOOR_ONE, FLOOR_RAW, FLOOR_LOCK)

#: ``while_executing`` with pieces of the throughput layer switched off,
#: by ``RedisBackend(group_commit=..., release_in_background=...)``:
#: contender -> (group commit, releases in the background).  Without the
#: releaser each release goes out on the worker thread, in its own call;
#: without the group commit each start goes out in its own call.
NO_RELEASER = "while_executing/no-releaser"
NO_GROUP = "while_executing/no-group-commit"
PLAIN = "while_executing/plain-calls"
LAYER_SWITCHES = {NO_RELEASER: (True, False), NO_GROUP: (False, True), PLAIN: (False, False)}

#: Set to "1" in a worker's environment to record release latencies.
LATENCY = "BENCH_LATENCY"

#: The queue every contender uses, inside its own broker namespace.
QUEUE = "bench"


def _switches() -> tuple[int, int]:
    """The process's voluntary and involuntary context switches so far,
    every thread's.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw, usage.ru_nivcsw


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` so that a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)


class Recorder(dramatiq.Middleware):
    """Keeps every execution in memory.  Writes ``<report>.progress``
    once ``expect`` executions have ended, its summary to
    ``<report>.acked`` once ``expect`` jobs have been acked (so every
    lock has been released), and to ``report`` when the worker shuts
    down.
    """

    def __init__(
        self, *, report: Optional[str], expect: int, unique: Optional[UniqueMiddleware], latency: bool = False
    ) -> None:
        self.report = Path(report) if report else None
        self.expect = expect
        self.unique = unique
        self.runs: list[tuple[int, float, float]] = []
        self.acked = 0
        self.first_cpu: Optional[float] = None
        self.cpu: Optional[float] = None  # process CPU seconds from the first start to the expect-th end
        # The same span split into user time (Python, mostly under the
        # GIL) and system time (the kernel's, outside it), in seconds.
        self.first_times: Optional[os.times_result] = None
        self.user_sys: Optional[tuple[float, float]] = None
        self.first_switches: tuple[int, ...] = (0, 0)
        self.switches: Optional[tuple[int, ...]] = None  # voluntary and involuntary context switches, same span
        self._mutex = threading.Lock()
        # Added release latency: from the job's end (our after-hook runs
        # before the middleware's) to the run lock's ``released`` event.
        # Only in runs of their own: a listener makes the middleware build
        # every event, which the rate runs must not charge it for.
        self.latency = latency and unique is not None
        self.ended: dict[str, float] = {}
        self.release_latencies: list[float] = []
        if self.latency and unique is not None:
            unique.events.subscribe(self._on_event)

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *, result: Any = None,
                              exception: Any = None) -> None:
        if self.latency:
            self.ended[message.message_id] = time.monotonic()

    def _on_event(self, event: Any) -> None:
        if event.name == "released" and event.key.endswith(":run"):
            ended = self.ended.pop(event.message_id, None)
            if ended is not None:
                latency = time.monotonic() - ended
                with self._mutex:
                    self.release_latencies.append(latency)

    def start(self) -> float:
        """Called as a job starts; returns the wall-clock time."""
        if self.first_cpu is None:  # two first jobs may both set it: a microsecond apart
            self.first_cpu, self.first_times = time.process_time(), os.times()
            self.first_switches = _switches()
        return time.time()

    def ran(self, seq: int, started: float, ended: float) -> None:
        with self._mutex:
            self.runs.append((seq, started, ended))
            reached = len(self.runs) == self.expect
        if reached and self.first_cpu is not None and self.first_times is not None:
            self.cpu, times = time.process_time() - self.first_cpu, os.times()
            self.user_sys = (times.user - self.first_times.user, times.system - self.first_times.system)
            self.switches = tuple(now - then for now, then in zip(_switches(), self.first_switches))
        if reached and self.report is not None:
            write_json(self.report.with_name(self.report.name + ".progress"), {"runs": self.expect})

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        if message.queue_name != QUEUE:
            return  # a delay-queue copy moved to the queue
        with self._mutex:
            self.acked += 1
            reached = self.acked == self.expect
        if reached and self.report is not None:
            write_json(self.report.with_name(self.report.name + ".acked"), self.summary())

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        if self.report is not None:
            write_json(self.report, self.summary())

    def summary(self) -> dict[str, Any]:
        events = {name: self.unique.events.count(name) for name in EVENTS} if self.unique is not None else {}
        with self._mutex:
            runs = list(self.runs)
        with self._mutex:
            latencies = list(self.release_latencies)
        return {"runs": runs, "events": events, "trips": trips.counts(), "worker_trips": trips.worker_counts(),
                "cpu": self.cpu, "user_sys": self.user_sys, "switches": self.switches, "release_latencies": latencies}


class Floor(dramatiq.Middleware):
    """A PING per lock step, through the broker's own client."""

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: Any) -> None:
        broker.client.ping()  # type: ignore[attr-defined]

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        broker.client.ping()  # type: ignore[attr-defined]

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *, result: Any = None,
                              exception: Any = None) -> None:
        broker.client.ping()  # type: ignore[attr-defined]


class FloorOne(dramatiq.Middleware):
    """One PING per job, on the worker thread, through the broker's client."""

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        broker.client.ping()  # type: ignore[attr-defined]


def _bare_socket(broker: dramatiq.Broker) -> tuple[Any, Any]:
    """A connection of the broker's client, connected (handshake
    included), and its socket, for a caller that writes and reads it by
    hand.
    """
    conn = broker.client.connection_pool.make_connection()  # type: ignore[attr-defined]
    conn.connect()
    return conn, conn._sock


def _received(sock: Any, size: int) -> bytes:
    """What one ``recv`` read; a closed connection raises instead of
    reading nothing for ever.
    """
    chunk: bytes = sock.recv(size)
    if not chunk:
        raise ConnectionError("Redis closed the floor's connection.")
    return chunk


class FloorRaw(dramatiq.Middleware):
    """One PING per job, on the worker thread, on a socket of its own:
    redis-py only connects it (handshake included), then steps aside.
    """

    PING = b"*1\r\n$4\r\nPING\r\n"

    def __init__(self) -> None:
        self.sockets = threading.local()

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        sock = getattr(self.sockets, "sock", None)
        if sock is None:
            self.sockets.conn, sock = _bare_socket(broker)  # the connection keeps the socket open
            self.sockets.sock = sock
        sock.sendall(self.PING)
        reply = b""
        while not reply.endswith(b"\r\n"):
            reply += _received(sock, 64)


class FloorLock(dramatiq.Middleware):
    """This lock's own round trip and nothing else: ``start.lua`` for the
    job's key before it runs, packed by hiredis and read by a hiredis
    reader on a bare socket of the worker thread, with the thread's last
    ``release.lua`` in front of it in the same write.
    """

    def __init__(self, *, prefix: str) -> None:
        from hiredis import Reader, pack_command

        self.prefix = prefix
        # Typed for one argument's tuple; it packs any number of them.
        self.pack: Callable[[tuple[Any, ...]], bytes] = pack_command  # type: ignore[assignment]
        self.reader_class = Reader
        self.tokens = itertools.count()
        self.threads = threading.local()
        self.shas: dict[str, bytes] = {}
        self.mutex = threading.Lock()

    def _thread(self, broker: dramatiq.Broker) -> Any:
        mine = self.threads
        if getattr(mine, "sock", None) is None:
            with self.mutex:
                if not self.shas:
                    calls = RedisBackend(client=broker.client).calls  # type: ignore[attr-defined]
                    assert calls is not None  # a standalone client: the broker's own
                    for name in ("start", "release"):
                        broker.client.script_load(calls.sources[name])  # type: ignore[attr-defined]
                        self.shas[name] = calls.shas[name]
            mine.conn, mine.sock = _bare_socket(broker)
            mine.reader, mine.release = self.reader_class(), None
        return mine

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        mine = self._thread(broker)
        raw = getattr(message, "_message", message)  # past the proxy's Python-level __getattr__
        message_id = raw.message_id
        key = f"{self.prefix}:floor:{{{raw.args[0]}}}:run"
        owner = f"{message_id}/{next(self.tokens)}"
        packed = self.pack((b"EVALSHA", self.shas["start"], 4, key, f"{key}:m:{message_id}", f"{key}:wait",
                            f"{key}:bodies", owner, DEFAULT_LEASE, 1, "while_executing", message_id, 0, ""))
        replies = 1
        if mine.release is not None:
            packed, replies, mine.release = mine.release + packed, 2, None
        mine.sock.sendall(packed)
        while replies:
            mine.reader.feed(_received(mine.sock, 65536))
            reply = mine.reader.gets()
            while reply is not False:
                if isinstance(reply, Exception):  # NOSCRIPT, say: a floor that ran no script is no floor
                    raise reply
                replies -= 1
                reply = mine.reader.gets() if replies else False
        mine.key, mine.owner = key, owner

    def after_process_message(self, broker: dramatiq.Broker, message: Any, *, result: Any = None,
                              exception: Any = None) -> None:
        mine, key = self.threads, self.threads.key
        mine.release = self.pack((b"EVALSHA", self.shas["release"], 3, key, f"{key}:wait", f"{key}:bodies",
                                  mine.owner, 1))


def build(
    contender: str,
    *,
    redis_url: str,
    namespace: str,
    seconds: float = 0.0,
    cpu: float = 0.0,
    report: Optional[str] = None,
    expect: int = 0,
    latency: bool = False,
    postgres_url: Optional[str] = None,
) -> tuple[RedisBroker, dramatiq.Actor[Any, Any]]:
    """The broker and actor of one contender, isolated by ``namespace``.

    Raises:
      ValueError: for an unknown contender.
    """
    valid = (*CONTENDERS, *LAYER_SWITCHES, *pg_app.CONTENDERS)
    if contender not in valid:
        raise ValueError(f"Unknown contender {contender!r}. Valid choices: {', '.join(valid)}.")
    broker = RedisBroker(url=redis_url, namespace=namespace)
    unique: Optional[UniqueMiddleware] = None
    options: dict[str, Any] = {}
    if contender in LOCK_TYPES:
        unique = UniqueMiddleware(prefix=namespace)
        broker.add_middleware(unique)
        options = {"lock": contender, "lock_args": ["key"]}
    if contender in LAYER_SWITCHES:
        unique = UniqueMiddleware(prefix=namespace, backend=_switched_backend(broker, contender))
        broker.add_middleware(unique)
        options = {"lock": "while_executing", "lock_args": ["key"]}
    elif contender in pg_app.CONTENDERS:
        unique, options = pg_app.install(broker, contender, namespace=namespace, postgres_url=postgres_url)
    if contender == FLOOR:
        broker.add_middleware(Floor())
    if contender == FLOOR_ONE:
        broker.add_middleware(FloorOne())
    if contender == FLOOR_RAW:
        broker.add_middleware(FloorRaw())
    if contender == FLOOR_LOCK:
        broker.add_middleware(FloorLock(prefix=namespace))
    recorder = Recorder(report=report, expect=expect, unique=unique, latency=latency)
    broker.add_middleware(recorder)
    body = _body(recorder, seconds, cpu)
    if contender == RECIPE:
        body = _under_mutex(body, RateLimiterBackend(url=redis_url), namespace)
    actor = dramatiq.actor(broker=broker, actor_name="job", queue_name=QUEUE, **options)(body)
    return broker, actor


def _switched_backend(broker: RedisBroker, contender: str) -> RedisBackend:
    """The backend the middleware would pick for ``broker`` (its client,
    the settings' replicas), with the switches of ``contender``.
    """
    group_commit, in_background = LAYER_SWITCHES[contender]
    settings = from_settings()
    return RedisBackend(client=broker.client, min_replicas=settings.min_replicas,
                        min_replicas_timeout=settings.min_replicas_timeout, group_commit=group_commit,
                        release_in_background=in_background)


def _body(recorder: Recorder, seconds: float, cpu: float) -> Callable[[int, int], None]:
    def job(key: int, seq: int) -> None:
        started = recorder.start()
        if seconds:
            time.sleep(seconds)
        if cpu:
            spin_until = time.thread_time() + cpu
            while time.thread_time() < spin_until:
                pass
        recorder.ran(seq, started, time.time())

    return job


def _under_mutex(
    body: Callable[[int, int], None], backend: RateLimiterBackend, namespace: str
) -> Callable[[int, int], None]:
    # The cookbook's distributed mutex, one per key, with its defaults.
    def job(key: int, seq: int) -> None:
        with ConcurrentRateLimiter(backend, f"{namespace}:mutex:{key}", limit=1).acquire():
            body(key, seq)

    return job


def from_environment() -> tuple[RedisBroker, dramatiq.Actor[Any, Any]]:
    """The contender named by the ``BENCH_*`` variables the driver sets
    for its worker processes.
    """
    if os.environ.get("BENCH_TRIPS") == "1":
        trips.install()
    return build(
        os.environ["BENCH_CONTENDER"],
        redis_url=os.environ["BENCH_REDIS_URL"],
        namespace=os.environ["BENCH_NAMESPACE"],
        seconds=float(os.environ.get("BENCH_SECONDS", "0")),
        cpu=float(os.environ.get("BENCH_CPU", "0")),
        report=os.environ["BENCH_REPORT"],
        expect=int(os.environ["BENCH_EXPECT"]),
        latency=os.environ.get(LATENCY) == "1",
        postgres_url=os.environ.get(pg_app.URL_VARIABLE),
    )
