"""The fault suite's broker module, for real ``dramatiq`` workers.

``python -m dramatiq tests.faults.apps.workload:broker`` builds it from
environment variables, so the test process and every worker process
build the same actors:

* ``FAULTS_NAMESPACE``: isolates the keys, queue and records of a test.
* ``FAULTS_RECORD_URL``: the Redis for runs, events, gates and the
  fenced store; never the one a test breaks.
* ``FAULTS_LOCK_URL``: the Redis for locks (default: the record Redis),
  or a ``postgresql://`` URL for locks in PostgreSQL.
* ``FAULTS_BROKER``: ``redis`` (on the record Redis) or ``rabbitmq``.
* ``FAULTS_BROKER_URL``: the Redis broker's URL (default: the record
  Redis), to put the broker behind a proxy.
* ``FAULTS_RABBITMQ_URL``: the RabbitMQ broker's URL, and
  ``FAULTS_CONFIRM_DELIVERY=1`` for publisher confirms.
* ``FAULTS_HEARTBEAT_TIMEOUT``: the Redis broker's ``heartbeat_timeout``
  in ms; when set, maintenance runs on every command, so a killed
  worker's messages come back that long after it died.
* ``FAULTS_LEASE``, ``FAULTS_RESCHEDULE_DELAY`` (ms) and
  ``FAULTS_ON_BACKEND_ERROR``: passed to ``UniqueMiddleware``.
* ``FAULTS_EVENTS``: comma-separated lock event names to record.
* ``FAULTS_SOCKET_TIMEOUT``: the lock client's socket timeout in
  seconds, so a stalled lock Redis times calls out quickly.

``hold`` and ``serial`` store their results (in the record Redis), so
a test can ask what a caller waiting on a result gets.  ``flaky`` fails
its first ``fails`` runs and allows one retry.

Every run appends JSON to ``<ns>:starts`` when it begins and to
``<ns>:runs`` when it ends, with start/end times, pid, message id and
fencing token.  A run given ``gate="name"`` waits until the key
``<ns>:gate:name`` exists, so a test decides when it goes on.  With
``write=True`` it then writes its message id to ``<ns>:store:<key>``
through :data:`FENCED_WRITE`, a store that refuses stale tokens.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import dramatiq
import redis
from dramatiq.middleware import CurrentMessage
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend as RedisResults

from dramatiq_unique import LockEvent, UniqueMiddleware, fence_token
from dramatiq_unique.backends.base import LockBackend
from dramatiq_unique.backends.redis import RedisBackend

#: How long a gated run waits at most, in seconds: a test that forgot
#: to open its gate must not leave a worker busy forever.
GATE_TIMEOUT = 120

#: Writes ``value`` under a fencing token only when the token is higher
#: than every token seen before: the check a fenced store makes.
FENCED_WRITE = """
local seen = tonumber(redis.call("HGET", KEYS[1], "token") or "0")
if tonumber(ARGV[1]) <= seen then return 0 end
redis.call("HSET", KEYS[1], "token", ARGV[1], "value", ARGV[2])
return 1
"""

RETRIES = {"max_retries": 50, "min_backoff": 100, "max_backoff": 1000}


@dataclass
class Workload:
    """The broker and actors built from one environment."""

    broker: dramatiq.Broker
    unique: UniqueMiddleware
    records: redis.Redis
    namespace: str
    hold: dramatiq.Actor
    once: dramatiq.Actor
    limited: dramatiq.Actor
    serial: dramatiq.Actor
    flaky: dramatiq.Actor
    results: RedisResults


def make_broker(env: Mapping[str, str]) -> dramatiq.Broker:
    namespace = env["FAULTS_NAMESPACE"]
    if env.get("FAULTS_BROKER", "redis") == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        confirm = env.get("FAULTS_CONFIRM_DELIVERY") == "1"
        return RabbitmqBroker(url=env["FAULTS_RABBITMQ_URL"], confirm_delivery=confirm)
    from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker

    options: dict[str, Any] = {}
    if env.get("FAULTS_HEARTBEAT_TIMEOUT"):
        options = {"heartbeat_timeout": int(env["FAULTS_HEARTBEAT_TIMEOUT"]), "maintenance_chance": MAINTENANCE_SCALE}
    url = env.get("FAULTS_BROKER_URL") or env["FAULTS_RECORD_URL"]
    return RedisBroker(url=url, namespace=namespace, **options)


def make_unique(env: Mapping[str, str]) -> UniqueMiddleware:
    lock_url = env.get("FAULTS_LOCK_URL") or env["FAULTS_RECORD_URL"]
    timeout = float(env.get("FAULTS_SOCKET_TIMEOUT", "5"))
    backend: LockBackend
    if lock_url.startswith(("postgresql://", "postgres://")):
        from dramatiq_unique.backends.postgres import PostgresBackend

        backend = PostgresBackend(url=lock_url, timeout=timeout)
    else:
        backend = RedisBackend(url=lock_url, socket_timeout=timeout)
    return UniqueMiddleware(
        backend=backend,
        prefix=env["FAULTS_NAMESPACE"],
        lease=int(env.get("FAULTS_LEASE", "2000")),
        reschedule_delay=int(env.get("FAULTS_RESCHEDULE_DELAY", "300")),
        on_backend_error=env.get("FAULTS_ON_BACKEND_ERROR", "fail"),
    )


def record_events(unique: UniqueMiddleware, records: redis.Redis, namespace: str, names: str) -> None:
    wanted = {name for name in names.split(",") if name}

    def listener(event: LockEvent) -> None:
        if event.name in wanted:
            entry = {"name": event.name, "key": event.key, "message_id": event.message_id, "pid": os.getpid(),
                     "at": time.time()}
            records.rpush(f"{namespace}:events", json.dumps(entry))

    unique.events.subscribe(listener)


def build(env: Mapping[str, str] = os.environ) -> Workload:
    namespace = env["FAULTS_NAMESPACE"]
    records = redis.Redis.from_url(env["FAULTS_RECORD_URL"])
    broker = make_broker(env)
    unique = make_unique(env)
    broker.add_middleware(unique)
    broker.add_middleware(CurrentMessage())
    results = RedisResults(client=records, namespace=f"{namespace}-results")
    broker.add_middleware(Results(backend=results))
    record_events(unique, records, namespace, env.get("FAULTS_EVENTS", "lock_lost,backend_error"))
    fenced_write = records.register_script(FENCED_WRITE)

    def run(actor: str, key: str, gate: Optional[str] = None, seconds: float = 0.0, write: bool = False,
            then: Optional[str] = None) -> dict[str, Any]:
        """Record the start, wait for ``gate``, make the fenced write,
        wait for ``then``, sleep, and record the end; return the record.
        """
        message = CurrentMessage.get_current_message()
        message_id = message.message_id if message else ""
        fence = fence_token() or 0
        run: dict[str, Any] = {"actor": actor, "key": key, "message_id": message_id, "pid": os.getpid(),
                               "fence": fence_token(), "start": time.time()}
        records.rpush(f"{namespace}:starts", json.dumps(run))
        wait_for_gate(records, f"{namespace}:gate:{gate}" if gate else None)
        if write:
            store = f"{namespace}:store:{key}"
            run["written"] = bool(fenced_write(keys=[store], args=[fence, message_id]))
        wait_for_gate(records, f"{namespace}:gate:{then}" if then else None)
        time.sleep(seconds)
        run["end"] = time.time()
        records.rpush(f"{namespace}:runs", json.dumps(run))
        return run

    def hold(key: str, gate: Optional[str] = None, seconds: float = 0.0, write: bool = False,
             then: Optional[str] = None) -> dict[str, Any]:
        return run("hold", key, gate, seconds, write, then)

    def serial(key: str, gate: Optional[str] = None, seconds: float = 0.0) -> dict[str, Any]:
        return run("serial", key, gate, seconds)

    def flaky(key: str, fails: int = 1, gate: Optional[str] = None) -> None:
        run("flaky", key, gate)
        message = CurrentMessage.get_current_message()
        if message is not None and message.options.get("retries", 0) < fails:
            raise ValueError("flaky fails this run")

    def once(key: str, gate: Optional[str] = None, seconds: float = 0.0) -> None:
        run("once", key, gate, seconds)

    def limited(key: str, seconds: float = 0.0) -> None:
        run("limited", key, seconds=seconds)

    declare: dict[str, Any] = dict(broker=broker, queue_name=namespace, lock_args=["key"], **RETRIES)
    run_lock: dict[str, Any] = dict(lock="while_executing", on_conflict="reschedule", **declare)
    return Workload(
        broker=broker,
        unique=unique,
        records=records,
        namespace=namespace,
        hold=dramatiq.actor(store_results=True, **run_lock)(hold),
        once=dramatiq.actor(lock="until_executed", **declare)(once),
        limited=dramatiq.actor(lock_limit=3, **run_lock)(limited),
        serial=dramatiq.actor(
            lock="until_and_while_executing",
            on_conflict={"client": "log", "server": "reschedule"},
            store_results=True,
            **declare,
        )(serial),
        flaky=dramatiq.actor(
            **{**run_lock, "max_retries": 1, "min_backoff": 100, "max_backoff": 100}
        )(flaky),
        results=results,
    )


def wait_for_gate(records: redis.Redis, gate: Optional[str]) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT
    while gate is not None and not records.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


def __getattr__(name: str) -> Any:
    # Built on first use, so the test process can import build() with
    # its own environment; the dramatiq CLI asks for ``broker``.
    if name != "broker":
        raise AttributeError(name)
    workload = build()
    globals()["broker"] = workload.broker
    return workload.broker
