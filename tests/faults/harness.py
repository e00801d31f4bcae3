"""What every fault test needs: the workload's environment, worker
groups that never outlive their test, and readers of what ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Iterator, Optional
from urllib.parse import unquote, urlsplit

import pika  # type: ignore[import-untyped]
import redis

from dramatiq_unique import LockInfo

from tests.conftest import free_port, start_redis_server, wait_for
from tests.faults.apps.workload import Workload, build
from tests.procs import WorkerGroup

APP = "tests.faults.apps.workload:broker"

#: Idle consumers poll every 100 ms instead of every second, so that
#: recovery figures measure the locks, not the polling.
WORKER_ENV = {"dramatiq_worker_timeout": "100"}


@dataclass(frozen=True)
class Run:
    """One execution, as the workload recorded it."""

    actor: str
    key: str
    message_id: str
    pid: int
    fence: Optional[int]
    start: float
    end: Optional[float] = None
    written: Optional[bool] = None


class Harness:
    """One test's namespace: its environment, workers, sends and records.

    Parameters:
      records(redis.Redis): The record Redis, flushed by the fixture.
      env(dict): The workload's ``FAULTS_*`` variables.
    """

    def __init__(self, records: redis.Redis, env: dict[str, str]) -> None:
        self.records = records
        self.env = env
        self.namespace = env["FAULTS_NAMESPACE"]
        self.groups: list[WorkerGroup] = []
        self._workload: Optional[Workload] = None

    @property
    def app(self) -> Workload:
        """The workload built in the test process, for sending."""
        if self._workload is None:
            self._workload = build(self.env)
        return self._workload

    def workers(self, processes: int = 1, threads: int = 2, **env: str) -> WorkerGroup:
        """Start a worker group and wait until it is ready."""
        group = WorkerGroup(APP, processes=processes, threads=threads, env={**self.env, **WORKER_ENV, **env})
        self.groups.append(group.start())
        group.wait_booted(processes, timeout=60)
        return group

    def close(self) -> None:
        for group in self.groups:
            if group.process is not None and group.process.poll() is None:
                group.kill()
            # pytest shows this only for a failing test
            print(f"--- {' '.join(group.args[2:])}\n{group.output()[-6000:]}")
        if self._workload is not None:
            if self.env.get("FAULTS_BROKER") == "rabbitmq":
                delete_queues(self.env["FAULTS_RABBITMQ_URL"], self.namespace)
            self._workload.broker.close()

    # Gates and records ------------------------------------------------------

    def open_gate(self, name: str) -> None:
        self.records.set(f"{self.namespace}:gate:{name}", 1)

    def _read(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.records.lrange(f"{self.namespace}:{name}", 0, -1)]

    def starts(self) -> list[Run]:
        return [Run(**entry) for entry in self._read("starts")]

    def runs(self) -> list[Run]:
        return [Run(**entry) for entry in self._read("runs")]

    def events(self, name: Optional[str] = None) -> list[dict[str, Any]]:
        return [event for event in self._read("events") if name in (None, event["name"])]

    def started(self, message_id: str) -> Run:
        """Wait for a message's first start and return it."""
        wait_for(lambda: any(r.message_id == message_id for r in self.starts()), timeout=30,
                 what=f"message {message_id} to start")
        return next(r for r in self.starts() if r.message_id == message_id)

    def finished(self, message_id: str, timeout: float = 30) -> Run:
        """Wait for a message's completed run and return it."""
        wait_for(lambda: any(r.message_id == message_id for r in self.runs()), timeout=timeout,
                 what=f"message {message_id} to finish")
        return next(r for r in self.runs() if r.message_id == message_id)

    def lock(self, actor: str, key: str, phase: str) -> Optional[LockInfo]:
        """The ``queue`` or ``run`` lock of ``actor(key)``, if held."""
        unique = self.app.unique
        spec = unique.specs[actor]
        return unique.backend.inspect(unique.key(spec, spec.digest((key,), {}), phase))  # type: ignore[union-attr]

    def queued(self) -> int:
        """Messages enqueued, delayed or in flight on the broker: 0
        means nothing can run any more.
        """
        if self.env.get("FAULTS_BROKER") == "rabbitmq":
            return rabbitmq_messages(self.env["FAULTS_RABBITMQ_URL"], self.namespace)
        q = f"{self.namespace}:{self.namespace}"
        return int(self.records.hlen(f"{q}.msgs")) + int(self.records.hlen(f"{q}.DQ.msgs"))

    def fetched(self) -> bool:
        """True when the Redis broker's queue list is empty: every
        message is in some worker's hands.
        """
        return int(self.records.llen(f"{self.namespace}:{self.namespace}")) == 0


# Services -------------------------------------------------------------------


class RedisServer:
    """A private ``redis-server`` a test can stop and start again on
    the same port.  It persists nothing, so a restart forgets every
    lock and every loaded script.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> "RedisServer":
        self.process = start_redis_server(self.port)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


def delete_queues(url: str, namespace: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for queue in (namespace, f"{namespace}.DQ", f"{namespace}.XQ"):
            channel.queue_delete(queue)
    finally:
        connection.close()


def rabbitmq_messages(url: str, namespace: str) -> int:
    """Messages in a namespace's RabbitMQ queues, ready or delivered and
    not yet acknowledged (a Dramatiq worker holds its delayed messages
    unacknowledged until they are due), as ``rabbitmqctl`` counts them:
    AMQP itself counts only the ready ones.
    """
    vhost = unquote(urlsplit(url).path[1:]) or "/"
    listing = subprocess.run(["rabbitmqctl", "list_queues", "-q", "-p", vhost, "name", "messages"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    names = {namespace, f"{namespace}.DQ"}
    return sum(int(count) for name, _, count in (line.partition("\t") for line in listing.splitlines())
               if name in names)


def rabbitmq_ready(url: str, namespace: str) -> int:
    """Messages ready in a RabbitMQ queue (not delivered to anyone)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(connection.channel().queue_declare(namespace, passive=True).method.message_count)
    finally:
        connection.close()


# Analysis ---------------------------------------------------------------------


def overlaps(runs: list[Run]) -> list[tuple[Run, Run]]:
    """Pairs of runs of one key whose intervals intersect."""
    found = []
    for key in {r.key for r in runs}:
        mine = sorted((r for r in runs if r.key == key), key=lambda r: r.start)
        latest: Optional[Run] = None
        for run in mine:
            if latest is not None and run.start < (latest.end or 0):
                found.append((latest, run))
            if latest is None or (run.end or 0) > (latest.end or 0):
                latest = run
    return found


def peak(runs: list[Run]) -> int:
    """The most runs of one key that were running at the same instant."""
    best = 0
    for key in {r.key for r in runs}:
        edges = sorted([(r.start, 1) for r in runs if r.key == key] + [(r.end or 0, -1) for r in runs if r.key == key],
                       key=lambda edge: (edge[0], edge[1]))
        running = 0
        for _, step in edges:
            running += step
            best = max(best, running)
    return best


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the duration of the block: a stand-in for
    a long GC pause or a frozen VM.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
