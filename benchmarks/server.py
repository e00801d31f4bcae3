"""The Redis the benchmark measures on, and what it reads from it.

By default the harness starts its own ``redis-server`` on a free port,
so that nobody else's traffic shows up in ``INFO commandstats``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections import Counter
from typing import Iterator, Optional

import redis

#: Commands the driver itself sends while measuring, left out of counts.
_DRIVER_COMMANDS = {"info"}


class BenchmarkError(Exception):
    """The harness could not measure; the message says what to do."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def replicas_of(url: str, count: int) -> Iterator[None]:
    """``count`` private replicas of the Redis at ``url``, in sync while
    the block runs, and gone after it.
    """
    primary = redis.Redis.from_url(url)
    started = [PrivateRedis().start() for _ in range(count)]
    try:
        port = primary.connection_pool.connection_kwargs["port"]
        for replica in started:
            redis.Redis.from_url(replica.url).execute_command("REPLICAOF", "127.0.0.1", str(port))
        deadline = time.monotonic() + 10
        while primary.info("replication").get("connected_slaves", 0) < count or not all(
            redis.Redis.from_url(r.url).info("replication").get("master_link_status") == "up" for r in started
        ):
            if time.monotonic() > deadline:
                raise BenchmarkError("a replica of the harness's Redis never synced")
            time.sleep(0.05)
        yield
    finally:
        for replica in started:
            replica.stop()


class PrivateRedis:
    """A throw-away ``redis-server`` without persistence."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: Optional[subprocess.Popen[bytes]] = None
        self.workdir: Optional[str] = None

    def start(self) -> "PrivateRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise BenchmarkError(
                "redis-server is not installed: run `apt-get install redis-server`, or pass --redis URL."
            )
        self.workdir = tempfile.mkdtemp(prefix="dramatiq-unique-bench-redis-")
        options = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        options += ["--dir", self.workdir]
        self.process = subprocess.Popen(
            [binary, *options],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while not _answers(client):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise BenchmarkError(f"redis-server did not start on port {self.port}.")
            time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def connect(url: str) -> redis.Redis:
    """A client of ``url``, or a BenchmarkError saying how to get one."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    if not _answers(client):
        raise BenchmarkError(f"Redis at {url} does not answer. Start it, or leave out --redis to use a private one.")
    return client


def command_calls(client: redis.Redis) -> Counter[str]:
    """Calls per command so far, from ``INFO commandstats``; commands
    run inside scripts count too.
    """
    stats = client.info("commandstats")
    calls = Counter({name[len("cmdstat_") :]: int(value["calls"]) for name, value in stats.items()})
    for name in _DRIVER_COMMANDS:
        calls.pop(name, None)
    return calls


def command_usec(client: redis.Redis) -> Counter[str]:
    """Server microseconds spent per command so far."""
    stats = client.info("commandstats")
    return Counter({name[len("cmdstat_") :]: int(value["usec"]) for name, value in stats.items()})


def delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
    return Counter({name: after[name] - before[name] for name in after if after[name] > before[name]})


def cleanup(client: redis.Redis, namespace: str) -> None:
    """Drop every key of one run: all of them start with its namespace."""
    batch = []
    for key in client.scan_iter(match=f"{namespace}*", count=1000):
        batch.append(key)
        if len(batch) == 1000:
            client.unlink(*batch)
            batch = []
    if batch:
        client.unlink(*batch)


def redis_cpu(client: redis.Redis) -> float:
    """CPU seconds the server has used, user and system."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def version(client: redis.Redis) -> str:
    return str(client.info("server")["redis_version"])
