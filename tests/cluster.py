"""Throw-away Redis servers: a Cluster of three primaries, and a
Sentinel.

:func:`start_cluster` starts three ``redis-server --cluster-enabled
yes`` processes on free ports, each in its own temporary directory,
joins them with ``redis-cli --cluster create`` and waits for
``cluster_state:ok``.  :func:`start_sentinel` starts one primary and
one ``redis-server --sentinel`` watching it.  :meth:`Servers.stop`
tears them down.  The fixtures are in ``tests/test_cluster.py``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from tests.conftest import wait_for

#: How far above a node's port Redis puts its cluster bus.
BUS_OFFSET = 10_000

MISSING = "{} is not installed: run `apt-get install redis-server` (it brings redis-cli and Sentinel too)."


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(count: int) -> list[int]:
    """Free ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + BUS_OFFSET <= 65_535 and port not in ports and _bindable(port + BUS_OFFSET):
            ports.append(port)
    return ports


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(MISSING.format(name))
    return path


@dataclass
class Servers:
    """Redis processes started by a fixture, and their directories."""

    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)

    def start(self, port: int, *options: str) -> None:
        directory = tempfile.mkdtemp(prefix=f"dramatiq-unique-redis-{port}-")
        self.directories.append(directory)
        log = Path(directory) / "redis.log"
        self.processes.append(subprocess.Popen(
            [_binary("redis-server"), *options, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", directory, "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
        wait_for(lambda: _answers(port), timeout=10, what=f"redis-server on port {port}")

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for directory in self.directories:
            shutil.rmtree(directory, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _cluster_ok(port: int) -> bool:
    info = redis.Redis(port=port).cluster("info")
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == 3


def start_cluster(servers: Servers) -> list[int]:
    """Start three primaries on ``servers``, join them into a Cluster
    and wait until every node says ``cluster_state:ok``.

    Returns:
      list[int]: The ports of the nodes.
    """
    ports = cluster_ports(3)
    for port in ports:
        servers.start(port, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                      "--cluster-node-timeout", "5000")
    create = subprocess.run(
        [_binary("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
         "--cluster-replicas", "0", "--cluster-yes"],
        capture_output=True, text=True, timeout=60,
    )
    if create.returncode != 0:
        pytest.fail(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
    for port in ports:
        wait_for(lambda port=port: _cluster_ok(port), timeout=30, what=f"cluster_state:ok on port {port}")
    return ports


class WholeCluster(RedisCluster):
    """A ``RedisCluster`` whose ``KEYS`` asks every primary, as tests
    written for one Redis expect.
    """

    def keys(self, pattern: Any = "*", **kwargs: Any) -> Any:
        return super().keys(pattern, target_nodes=RedisCluster.PRIMARIES, **kwargs)


def start_sentinel(servers: Servers, name: str = "locks") -> int:
    """Start a primary and a Sentinel that watches it as ``name``.

    Returns:
      int: The Sentinel's port.
    """
    primary, sentinel = cluster_ports(2)
    servers.start(primary)
    config = Path(tempfile.mkdtemp(prefix="dramatiq-unique-sentinel-")) / "sentinel.conf"
    servers.directories.append(str(config.parent))
    config.write_text(f"sentinel monitor {name} 127.0.0.1 {primary} 1\n")
    servers.start(sentinel, str(config), "--sentinel")
    wait_for(lambda: _sentinel_knows(sentinel, name), timeout=10, what="the Sentinel to watch its primary")
    return sentinel


def _sentinel_knows(port: int, name: str) -> bool:
    # Through redis-py's Sentinel client: a plain client's
    # sentinel_get_master_addr_by_name fails on redis-py 6.4 and 7.0 (its
    # reply parser is called with an argument it does not take).
    try:
        return bool(Sentinel([("127.0.0.1", port)], socket_timeout=0.5).discover_master(name))
    except redis.RedisError:
        return False
