"""Locks in PostgreSQL, measured in rounds: bare Dramatiq, the Redis
backend's ``while_executing``, the PostgreSQL floor (one committed
single-row write per job on the worker thread) and ``while_executing``
with its locks in PostgreSQL, with ``synchronous_commit`` on and off.

Each round sends every contender's jobs in turns, then runs one real
worker per contender, for each setting in turn; ratios are taken within
a round (see :mod:`.report`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Callable, Optional

import redis

from . import throughput
from .app import BARE
from .pg_app import PG_FLOOR, PG_LOCK, URL_VARIABLE
from .pg_server import check_setting, prepare, rows_of, with_synchronous_commit
from .runs import Config
from .workers import THREADS

#: The Redis backend's lock, measured in the same rounds.
REDIS_LOCK = "while_executing"

CONTENDERS = (BARE, REDIS_LOCK, PG_FLOOR, PG_LOCK)

#: The ``synchronous_commit`` settings, each in every round.
SETTINGS = ("on", "off")

#: The target: the lock's processing rate over the floor's, within a round.
TARGET = 0.90


@dataclass(frozen=True)
class PgPlan:
    sent: int  # jobs per contender per round and setting
    rounds: int
    chunk: int  # jobs a contender sends before the next one's turn
    calls: int  # single calls timed for the profile


FULL = PgPlan(sent=1500, rounds=5, chunk=100, calls=1000)
QUICK = PgPlan(sent=400, rounds=2, chunk=100, calls=300)


@dataclass
class Run:
    """One contender's worker run in one round and setting."""

    rate: float  # jobs per second, first start to last end
    exactly_once: bool
    worker_cpu: Optional[float]  # µs per job
    floor_rows: int  # rows the floor wrote, left in its table
    lock_rows: int  # rows the lock backend left in its table
    events: dict[str, int]


@dataclass
class PgResults:
    plan: PgPlan
    #: (setting, contender) -> one run per round.
    runs: dict[tuple[str, str], list[Run]] = field(default_factory=lambda: defaultdict(list))
    violations: list[str] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)

    def rates(self, setting: str, contender: str) -> list[float]:
        return [run.rate for run in self.runs.get((setting, contender), [])]

    def ratios(self, setting: str, contender: str, base: str) -> list[float]:
        """Per-round ratios of ``contender``'s rate to ``base``'s."""
        return [a / b for a, b in zip(self.rates(setting, contender), self.rates(setting, base)) if b]


def rotated(items: tuple[str, ...], by: int) -> list[str]:
    return list(items[by % len(items) :] + items[: by % len(items)])


def config_of(conninfo: str, setting: str) -> Config:
    return Config(f"postgres, synchronous_commit={setting}", env={URL_VARIABLE: conninfo})


def measure(
    client: redis.Redis,
    redis_url: str,
    postgres_url: str,
    plan: PgPlan,
    progress: Callable[[str], None] = lambda text: None,
    contenders: tuple[str, ...] = CONTENDERS,
) -> PgResults:
    """Every round, for each ``synchronous_commit`` setting: send every
    contender's jobs in turns, then run one worker per contender.
    """
    results = PgResults(plan)
    conninfos = {setting: with_synchronous_commit(postgres_url, setting) for setting in SETTINGS}
    for setting, conninfo in conninfos.items():
        check_setting(conninfo, setting)
    prepare(conninfos["on"])
    for round_ in range(plan.rounds):
        for setting in rotated(SETTINGS, round_):
            order = rotated(contenders, round_)
            progress(f"postgres round {round_ + 1}/{plan.rounds}, synchronous_commit={setting}: {', '.join(order)}")
            _round(client, redis_url, conninfos[setting], setting, order, plan, results, round_)
    return results


def _round(
    client: redis.Redis,
    redis_url: str,
    conninfo: str,
    setting: str,
    order: list[str],
    plan: PgPlan,
    results: PgResults,
    round_: int,
) -> None:
    senders = throughput.enqueue_round(client, redis_url, order, plan.sent, plan.chunk, postgres_url=conninfo)
    try:
        for sender in senders:
            processing = throughput.process_run(client, redis_url, sender, config=config_of(conninfo, setting))
            floor_rows, lock_rows = rows_of(conninfo, sender.namespace)
            run = Run(processing.rate, processing.exactly_once,
                      None if processing.worker_cpu is None else processing.worker_cpu / sender.sent * 1e6,
                      floor_rows, lock_rows, processing.events)
            results.runs[(setting, sender.contender)].append(run)
            problem = check(sender.contender, sender.sent, run)
            if problem:
                results.violations.append(f"{sender.contender}, synchronous_commit={setting}, round {round_ + 1}: "
                                          + problem)
    finally:
        throughput.close(client, senders)
        for sender in senders:
            rows_of(conninfo, sender.namespace)


def check(contender: str, sent: int, run: Run) -> Optional[str]:
    """What is wrong with ``run``, if anything: a job that did not run
    exactly once, or a contender that did not do its work in PostgreSQL
    (the floor a row per job, the lock a row per key), or a lock that
    was not taken and released once per job.
    """
    if not run.exactly_once:
        return "the jobs did not each run exactly once"
    expected = {PG_FLOOR: (sent, 0), PG_LOCK: (0, sent)}.get(contender, (0, 0))
    if (run.floor_rows, run.lock_rows) != expected:
        return f"rows in PostgreSQL (floor, lock) = {(run.floor_rows, run.lock_rows)}, expected {expected}"
    if contender in (REDIS_LOCK, PG_LOCK):
        # A release that rides with the thread's next start, or goes in
        # the background, may land after the last ack: one per thread.
        locked, released = run.events.get("locked", 0), run.events.get("released", 0)
        if locked != sent or not sent - THREADS <= released <= sent:
            return f"{locked} locks taken and {released} released, expected {sent} (released: {THREADS} fewer at most)"
    return None


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if values else "n/a"


def _ratio(values: list[float]) -> str:
    return f"{median(values):.2f} ({spread(values)})" if values else "n/a"


def _name(contender: str) -> str:
    return {BARE: "bare Dramatiq", REDIS_LOCK: "`while_executing`, locks in Redis",
            PG_FLOOR: "PostgreSQL floor (1 committed row write per job)",
            PG_LOCK: "`while_executing`, locks in PostgreSQL"}[contender]


def table(results: PgResults) -> str:
    header = ["synchronous_commit", "contender", "processing msg/s (median)", "× bare (min–max)",
              "÷ PostgreSQL floor (min–max)", "worker CPU µs/job"]
    rows = []
    for setting in SETTINGS:
        for contender in CONTENDERS:
            rates = results.rates(setting, contender)
            if not rates:
                continue
            cpu = [run.worker_cpu for run in results.runs[(setting, contender)] if run.worker_cpu is not None]
            rows.append([
                setting, _name(contender), f"{median(rates):,.0f}",
                "1" if contender == BARE else _ratio(results.ratios(setting, contender, BARE)),
                _ratio(results.ratios(setting, contender, PG_FLOOR)) if contender == PG_LOCK else "",
                f"{median(cpu):,.0f}" if cpu else "n/a",
            ])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def verdicts(results: PgResults) -> list[str]:
    """The target per setting: the lock at least 0.9 of the floor (the
    median of per-round ratios).
    """
    lines = []
    for setting in SETTINGS:
        ratios = results.ratios(setting, PG_LOCK, PG_FLOOR)
        met = "not measured" if not ratios else "met" if median(ratios) >= TARGET else "**not met**"
        lines.append(f"- `while_executing` in PostgreSQL ≥ {TARGET:.2f} × the PostgreSQL floor, "
                     f"synchronous_commit={setting}: {_ratio(ratios)}: {met}")
    return lines

