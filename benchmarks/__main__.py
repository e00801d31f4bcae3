"""``python -m benchmarks [--quick | --layers] [--redis URL] [--output PATH] [--postgres [URL]]``

Measures every contender side by side, prints the tables and writes
``docs/performance.md``.  Exits with 1 when a run broke a guarantee
(a job ran twice or not at all, or two same-key runs overlapped).
With ``--layers``, runs only the rounds of the throughput layer (see
:mod:`.layers`) and replaces that section of the document.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import redis

from . import app, costs, document, footprint, layers, pg_document, pg_main, replace_cost, serial, throughput
from .report import CONFIG_CONTENDERS, Results, figure_name, tables
from .runs import CPU_1MS, DEFAULT, MIN_REPLICAS_1, PREFETCH_64, SLEEP_1MS, Config
from .server import BenchmarkError, PrivateRedis, connect, replicas_of
from .workers import ROOT, clean_environment


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    sent: int  # jobs per contender per round
    rounds: int
    chunk: int  # jobs a contender sends before the next one's turn
    audit: int  # jobs of the round-trip count
    makespans: tuple[tuple[int, int], ...]  # (jobs, rounds)
    locks: int  # locks held for the footprint
    calls: int  # calls of each kind timed for the cost of one call
    configs: tuple[Config, ...] = (PREFETCH_64, SLEEP_1MS, CPU_1MS, MIN_REPLICAS_1)  # beside the default, per round
    # Rounds of the configurations: their few contenders cost little a round, and their targets compare
    # figures within a few percent of each other, on machines whose rate moves by more from round to round.
    config_rounds: int = 0  # 0: as many as rounds
    layers: bool = True  # the throughput layer's variants in the rounds of layers.CONFIGS

    @property
    def every_config_round(self) -> int:
        return self.config_rounds or self.rounds


#: The contender whose release latencies are measured.
LATENCY_CONTENDER = "while_executing"

#: Two waves of 8 jobs, each outliving two renewal intervals of the lease.
RENEWAL_JOBS, RENEWAL_SECONDS, RENEWAL_LEASE = 16, 2.5, 3_000

FULL = Plan(sent=3000, rounds=5, chunk=100, audit=1000, makespans=((10, 5), (100, 2)), locks=2000, calls=2000,
            config_rounds=9)
QUICK = Plan(sent=600, rounds=2, chunk=100, audit=300, makespans=((10, 2), (100, 1)), locks=300, calls=500,
             layers=False)
#: Only the rounds of the throughput layer (``--layers``).
LAYERS = Plan(sent=2000, rounds=8, chunk=100, audit=0, makespans=(), locks=0, calls=0, configs=(PREFETCH_64,))


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="a fast check with fewer jobs and rounds")
    parser.add_argument("--layers", action="store_true", help="only what each piece of the throughput layer buys "
                        "(%d rounds); replaces that section of the report" % LAYERS.rounds)
    parser.add_argument("--redis", metavar="URL", help="measure on this Redis instead of a private redis-server; "
                        "the harness only touches keys under its own bench-* namespaces")
    parser.add_argument("--output", metavar="PATH", default=str(ROOT / "docs" / "performance.md"),
                        help="where to write the report (default: docs/performance.md); '-' writes none")
    parser.add_argument("--postgres", metavar="URL", nargs="?", const="",
                        help="measure locks in PostgreSQL instead (bare Dramatiq, a PostgreSQL floor, "
                        "while_executing on Redis and on PostgreSQL, synchronous_commit on and off), on a "
                        "private PostgreSQL or the one at URL, and write only its section of the report")
    return parser.parse_args(argv)


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def rotated(items: list[str], by: int) -> list[str]:
    return items[by % len(items) :] + items[: by % len(items)]


def measure(client: redis.Redis, url: str, plan: Plan, results: Results) -> None:
    contenders = results.contenders
    progress("timing single calls")  # this also loads every lock script before round trips are counted
    results.costs = costs.call_costs(client, url, plan.calls, plan.chunk)
    results.costs += costs.hook_costs(plan.calls)
    results.costs += replace_cost.send_costs(client, url, plan.calls, plan.chunk)
    for contender in contenders:
        progress(f"counting round trips: {contender}")
        sending, processing = throughput.audit(client, url, contender, plan.audit)
        results.add_audit(contender, plan.audit, sending, processing)
    for round_ in range(max(plan.rounds, plan.every_config_round)):
        if round_ < plan.rounds:
            rate_round(client, url, plan, results, round_)
        elif round_ < plan.every_config_round:
            # The default's target compares rates a few percent apart too: its
            # contenders of the configurations get as many rounds.
            rate_round(client, url, plan, results, round_, DEFAULT)
        if round_ < plan.every_config_round:
            for config in plan.configs:
                rate_round(client, url, plan, results, round_, config)
    for round_ in range(max(rounds for _, rounds in plan.makespans)):
        for jobs, rounds in plan.makespans:
            if round_ < rounds:
                progress(f"makespan of {jobs} same-key jobs, round {round_ + 1}/{rounds}")
                run = serial.makespan_run(client, url, jobs)
                results.makespans[jobs].append(run)
                if not run.exactly_once or run.overlaps:
                    results.violations.append(
                        f"makespan of {jobs}: exactly once={run.exactly_once}, overlaps={run.overlaps}"
                    )
    for config in (DEFAULT, *plan.configs):
        progress(f"release latency, {config.name}")
        with replicas_of(url, config.replicas):
            results.latencies[(config.name, LATENCY_CONTENDER)] += latency_run(client, url, plan, config)
    progress("lease renewals of long jobs")
    results.renewals = serial.renewal_run(client, url, RENEWAL_JOBS, RENEWAL_SECONDS, RENEWAL_LEASE)
    for contender in contenders:
        progress(f"footprint: {contender}")
        results.footprints += footprint.footprints(client, url, contender, plan.locks)


def measure_layers(client: redis.Redis, url: str, plan: Plan, results: Results) -> None:
    """Only the rounds of :mod:`.layers`: its contenders, in its configurations."""
    for round_ in range(plan.rounds):
        for config in layers.CONFIGS:
            rate_round(client, url, plan, results, round_, config, only=layers.CONTENDERS)


def rate_round(
    client: redis.Redis,
    url: str,
    plan: Plan,
    results: Results,
    round_: int,
    config: Optional[Config] = None,
    only: Optional[Sequence[str]] = None,
) -> None:
    """Send every contender's jobs in turns, then run each one's worker:
    every contender at the defaults, or those of ``config``, or ``only``
    those given; the throughput layer's too in its configurations.
    """
    contenders = list(only or (results.contenders if config is None else CONFIG_CONTENDERS))
    if only is None and plan.layers and (config or DEFAULT) in layers.CONFIGS:
        contenders += [name for name in layers.CONTENDERS if name not in contenders]
    order = rotated(contenders, round_)
    rounds = plan.rounds if config is None else plan.every_config_round
    progress(f"round {round_ + 1}/{rounds}{'' if config is None else ', ' + config.name}: {', '.join(order)}")
    with replicas_of(url, config.replicas if config else 0):
        senders = throughput.enqueue_round(client, url, order, plan.sent, plan.chunk)
        try:
            for sender in senders:
                record(results, sender, throughput.process_run(client, url, sender, config=config or DEFAULT),
                       round_, config)
        finally:
            throughput.close(client, senders)


def latency_run(client: redis.Redis, url: str, plan: Plan, config: Config) -> list[float]:
    """Release latencies of one ``while_executing`` run, apart from the
    rate rounds: recording them subscribes a listener to every event.
    """
    [sender] = throughput.enqueue_round(client, url, [LATENCY_CONTENDER], plan.sent, plan.chunk)
    try:
        latency = replace(config, env={**config.env, app.LATENCY: "1"})
        return throughput.process_run(client, url, sender, config=latency).release_latencies
    finally:
        throughput.close(client, [sender])


def record(
    results: Results,
    sender: throughput.Sender,
    processing: throughput.Processing,
    round_: int,
    config: Optional[Config] = None,
) -> None:
    contender, sent = sender.contender, sender.sent
    name = config.name if config is not None else None
    if config is None:
        results.add("enqueue", contender, sender.rate)
        results.add("enqueue_commands", contender, sum(sender.commands.values()) / sent)
        results.add("process_commands", contender, sum(processing.commands.values()) / sent)
        results.add("redis_cpu", contender, processing.redis_cpu / sent * 1e6)
    results.add(figure_name("process", name), contender, processing.rate)
    cpu = None if processing.worker_cpu is None else processing.worker_cpu / sent * 1e6
    results.add(figure_name("worker_cpu", name), contender, cpu)
    if processing.worker_user_sys is not None:
        user, system = (seconds / sent * 1e6 for seconds in processing.worker_user_sys)
        results.add(figure_name("worker_user", name), contender, user)
        results.add(figure_name("worker_sys", name), contender, system)
    if processing.switches is not None:
        results.add(figure_name("switches", name), contender, sum(processing.switches) / sent)
    if not processing.exactly_once:
        where = f"{contender}{'' if name is None else ', ' + name}, round {round_ + 1}"
        results.violations.append(f"{where}: the jobs did not each run exactly once")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    plan = LAYERS if args.layers else QUICK if args.quick else FULL
    if args.redis:
        # The harness replicates only its own private Redis.
        plan = replace(plan, configs=tuple(config for config in plan.configs if not config.replicas))
    for name in set(os.environ) - set(clean_environment()):
        del os.environ[name]  # every contender runs with default settings
    if args.postgres is not None:
        return pg_main.run(args)
    started, load = time.time(), os.getloadavg()
    server = None if args.redis else PrivateRedis().start()
    try:
        url = args.redis or server.url  # type: ignore[union-attr]
        client = connect(url)
        results = Results(meta={}, contenders=list(layers.CONTENDERS if args.layers else app.CONTENDERS))
        (measure_layers if args.layers else measure)(client, url, plan, results)
        results.meta = document.meta(client, args, plan, started, load)
    except BenchmarkError as e:
        progress(f"benchmark failed: {e}")
        return 2
    finally:
        if server is not None:
            server.stop()
    if args.layers:
        text = layers.section(results, document.layers_meta(results))
        print(text)
        if args.output != "-":
            path = Path(args.output)
            path.write_text(layers.splice(path.read_text() if path.exists() else "", text))
            progress(f"wrote {args.output}")
    else:
        print(tables(results))
        if args.output != "-":
            old = Path(args.output).read_text() if Path(args.output).exists() else ""
            Path(args.output).write_text(pg_document.keep(document.render(results), old))
            progress(f"wrote {args.output}")
    for violation in results.violations:
        progress(f"GUARANTEE BROKEN: {violation}")
    return 1 if results.violations else 0


if __name__ == "__main__":
    sys.exit(main())
