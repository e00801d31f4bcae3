"""Tables, target verdicts and ``docs/performance.md`` from one run.

Every comparison is a median over rounds of a ratio taken within one
round, so that slow and fast stretches of a shared machine cancel out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from math import comb
from statistics import median
from typing import Optional

from . import trips
from .app import BARE, FLOOR, FLOOR_LOCK, FLOOR_ONE, FLOOR_RAW, RECIPE
from .workers import THREADS
from .costs import CallCost
from .footprint import Footprint
from .serial import MakespanRun, Renewals
from .throughput import Processing

#: Figures sampled once per contender per round.
FIGURES = ("enqueue", "process", "enqueue_commands", "process_commands", "worker_cpu", "redis_cpu")

#: The makespan targets: same-key jobs of 100 ms -> seconds from the first start to the last end.
MAKESPAN_LIMITS = {10: 1.2, 100: 11.0}

#: The contenders measured in the configurations beside the default.
CONFIG_CONTENDERS = (BARE, "while_executing", FLOOR_ONE, FLOOR_RAW, FLOOR_LOCK)

#: The floors a lock is held to: one PING through redis-py, one on a
#: bare socket, and this lock's own scripts on a bare socket.
FLOORS = (FLOOR_ONE, FLOOR_RAW, FLOOR_LOCK)

#: How sure the interval around a median of per-round ratios is.
CONFIDENCE = 0.9

#: The configurations, in the order of the tables.
CONFIGS = ("default", "prefetch 64", "1 ms sleep job", "1 ms CPU job", "one replica, min_replicas=1")


def figure_name(figure: str, config: Optional[str]) -> str:
    """The name a figure is sampled under in one configuration."""
    return figure if config in (None, "default") else f"{figure}@{config}"


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> Optional[tuple[float, float]]:
    """A distribution-free interval around the median of ``values``:
    the pair of order statistics furthest in from each end that still
    covers the true median with at least ``confidence``
    (binomial, p = 1/2); the whole range when none does.
    """
    ordered, n = sorted(values), len(values)
    if not n:
        return None
    k = 1
    while k < n / 2 and 1 - 2 * sum(comb(n, i) for i in range(k + 1)) / 2**n >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k]


def percentile(values: list[float], fraction: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@dataclass
class Results:
    """Everything one run measured."""

    meta: dict[str, str]
    contenders: list[str]
    samples: dict[str, dict[str, list[float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    audit: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    makespans: dict[int, list[MakespanRun]] = field(default_factory=lambda: defaultdict(list))
    footprints: list[Footprint] = field(default_factory=list)
    costs: list[CallCost] = field(default_factory=list)
    renewals: Optional[Renewals] = None
    violations: list[str] = field(default_factory=list)
    #: Added release latencies in seconds, by (configuration, contender).
    latencies: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, figure: str, contender: str, value: Optional[float]) -> None:
        if value is not None:
            self.samples[figure][contender].append(value)

    def add_audit(self, contender: str, sent: int, sending: dict[str, int], processing: Processing) -> None:
        self.audit[contender] = {
            "enqueue": {name: n / sent for name, n in sending.items()},
            "process": {name: n / sent for name, n in processing.trips.items()},
            "worker": {name: n / sent for name, n in processing.worker_trips.items()},
        }

    def median(self, figure: str, contender: str) -> Optional[float]:
        values = self.samples[figure].get(contender)
        return median(values) if values else None

    def ratios(self, figure: str, contender: str, base: str) -> list[float]:
        """Per-round ratios of ``contender`` to ``base``."""
        mine, theirs = self.samples[figure].get(contender, []), self.samples[figure].get(base, [])
        return [a / b for a, b in zip(mine, theirs) if b]

    def ratio(self, figure: str, contender: str, base: str) -> Optional[float]:
        values = self.ratios(figure, contender, base)
        return median(values) if values else None

    def against(self, config: str, contender: str, floor: str) -> list[float]:
        """Per-round processing rates of ``contender`` over ``floor``'s in
        ``config``: paired within each round, so that bare Dramatiq's own
        swings between rounds drop out.
        """
        return self.ratios(figure_name("process", config), contender, floor)

    def trips_per_message(self, contender: str, phase: str, owners: tuple[str, ...] = ()) -> Optional[float]:
        counted = self.audit.get(contender, {}).get(phase)
        if counted is None:
            return None
        return sum(n for name, n in counted.items() if not owners or trips.owner(name) in owners)

    def lock_trips(self, contender: str, phase: str) -> str:
        """Lock round trips per message by script; a pipeline of N
        calls of one script (``release x8``) counts as one, under
        ``release (batched)``.
        """
        counted = self.audit.get(contender, {}).get(phase, {})
        mine: dict[str, float] = defaultdict(float)
        for name, n in counted.items():
            if trips.owner(name) in ("lock", "mutex", "lock+broker"):
                base, batched, _ = name.partition(" x")
                mine[base.removeprefix("lock:") + (" (batched)" if batched else "")] += n
        return ", ".join(f"{name} {n:.2f}" for name, n in sorted(mine.items())) or "none"

    def cost(self, name: str) -> Optional[CallCost]:
        return next((cost for cost in self.costs if cost.name == name), None)


def number(value: Optional[float], digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if values else "n/a"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def throughput_table(results: Results) -> str:
    rows = []
    for contender in results.contenders:
        row = [_name(contender)]
        for figure in ("enqueue", "process"):
            ratio = results.ratios(figure, contender, BARE)
            median_ratio = number(results.ratio(figure, contender, BARE), 2)
            row += [number(results.median(figure, contender)), f"{median_ratio} ({_spread(ratio)})"]
        rows.append(row)
    return _table(["contender", "enqueue msg/s", "× bare (min–max)", "processing msg/s", "× bare (min–max)"], rows)


def config_table(results: Results) -> str:
    rows = []
    for config in CONFIGS:
        for contender in CONFIG_CONTENDERS:
            process, cpu = figure_name("process", config), figure_name("worker_cpu", config)
            switches = figure_name("switches", config)
            if not results.samples[process].get(contender):
                continue
            latencies = results.latencies.get((config, contender), [])
            p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
            rows.append([
                config, _name(contender), number(results.median(process, contender)),
                f"{number(results.ratio(process, contender, BARE), 2)} "
                f"({_spread(results.ratios(process, contender, BARE))})",
                number(results.median(cpu, contender)), number(results.median(switches, contender), 1),
                "n/a" if p50 is None else f"{p50 * 1000:.2f} / {p99 * 1000:.2f}",  # type: ignore[operator]
            ])
    return _table(["configuration", "contender", "processing msg/s", "× bare (min–max)", "worker CPU µs/job",
                   "context switches/job", "release latency ms p50 / p99"], rows)


def floors_table(results: Results) -> str:
    rows = []
    for config in CONFIGS:
        process = figure_name("process", config)
        if not all(results.samples[process].get(floor) for floor in FLOORS):
            continue
        to_bare = [(results.ratio(process, floor, BARE), results.ratios(process, floor, BARE)) for floor in FLOORS]
        rows.append([config, *(paired(results, config, floor) for floor in FLOORS),
                     *(f"{number(ratio, 2)} ({_spread(ratios)})" for ratio, ratios in to_bare)])
    return _table(["configuration", "`while_executing` ÷ 1-PING floor", "`while_executing` ÷ bare-socket floor",
                   "`while_executing` ÷ lock floor", "1-PING floor × bare (min–max)",
                   "bare-socket floor × bare (min–max)", "lock floor × bare (min–max)"], rows)


#: Contenders whose per-job round trip goes out on a bare socket, past
#: the redis-py layer the round trips are counted in.
UNCOUNTED = (FLOOR_RAW, FLOOR_LOCK)


def _processing_trips(results: Results, contender: str) -> list[str]:
    if contender in UNCOUNTED:
        return ["not counted (bare socket)"] * 4
    return [number(results.trips_per_message(contender, "process"), 2),
            number(results.trips_per_message(contender, "process", ("lock", "mutex")), 2),
            number(results.trips_per_message(contender, "worker", ("lock", "mutex")), 2),
            results.lock_trips(contender, "process")]


def redis_table(results: Results) -> str:
    rows = []
    for contender in results.contenders:
        trips, lock_trips, on_worker, by_script = _processing_trips(results, contender)
        rows.append([
            _name(contender),
            number(results.median("enqueue_commands", contender), 2),
            number(results.median("process_commands", contender), 2),
            number(results.trips_per_message(contender, "enqueue"), 2),
            trips,
            number(results.trips_per_message(contender, "enqueue", ("lock", "mutex", "lock+broker")), 2),
            lock_trips,
            on_worker,
            by_script,
            number(results.median("worker_cpu", contender)),
            number(results.median("redis_cpu", contender)),
        ])
    header = ["contender", "commands/msg enqueue", "commands/msg processing", "round trips/msg enqueue",
              "round trips/msg processing", "lock round trips/msg enqueue", "lock round trips/msg processing",
              "of which on the worker thread", "lock round trips by script", "worker CPU µs/msg", "Redis CPU µs/msg"]
    return _table(header, rows)


def footprint_table(results: Results) -> str:
    rows = [[_name(f.contender), f.phase, f"{f.keys:.2f}", number(f.bytes), f"{f.keys_left:.2f}"]
            for f in results.footprints]
    return _table(["contender", "phase", "keys per held lock", "bytes per held lock (MEMORY USAGE)",
                   "keys left per lock after release"], rows)


def makespan_table(results: Results) -> str:
    rows = []
    for jobs, runs in sorted(results.makespans.items()):
        spans = [run.makespan for run in runs]
        handoffs = [gap for run in runs for gap in run.handoffs]
        rows.append([
            str(jobs), str(len(runs)), f"{median(spans):.2f}", f"{min(spans):.2f}", f"{max(spans):.2f}",
            f"{jobs * runs[0].seconds:.1f}", f"{median(handoffs) * 1000:.0f}", f"{max(handoffs) * 1000:.0f}",
            f"{median(run.rescheduled / jobs for run in runs):.1f}",
            "yes" if all(run.exactly_once for run in runs) else "NO",
            str(sum(run.overlaps for run in runs)),
        ])
    header = ["jobs", "rounds", "makespan s (median)", "min", "max", "serial ideal s", "hand-off ms (median)",
              "hand-off ms (max)", "reschedules per job", "each ran exactly once", "overlapping runs"]
    return _table(header, rows)


def renewal_table(results: Results) -> str:
    r = results.renewals
    if r is None:
        return "not measured"
    return _table(["jobs", "job s", "lease ms", "renewals", "round trips", "renewals per round trip"],
                  [[str(r.jobs), f"{r.seconds:.1f}", str(r.lease), str(r.extends), str(r.round_trips),
                    number(r.extends / r.round_trips if r.round_trips else None, 1)]])


def cost_table(results: Results) -> str:
    rows = [[cost.name, number(cost.wall), number(cost.server, 1)] for cost in results.costs]
    return _table(["call", "µs per call, one thread (median of turns)", "server µs per call"], rows)


#: A verdict: the target was met; missed where a floor of the same
#: rounds misses it too (the bare-socket floor, else the lock floor),
#: with the lock level with that floor or not; or missed.
MET, NOT_MET = "met", "**not met**"
AT_FLOOR = "not met: level with the bare-socket floor, which misses it too"
FLOOR_MISSES = "**not met**; the bare-socket floor misses it too"
AT_LOCK_FLOOR = "not met: level with the lock floor, which misses it too"
LOCK_FLOOR_MISSES = "**not met**; the lock floor misses it too"

#: Per floor that may miss a target, the verdicts when it does: the lock
#: level with it, or not.
MISSED_BY = {FLOOR_RAW: (AT_FLOOR, FLOOR_MISSES), FLOOR_LOCK: (AT_LOCK_FLOOR, LOCK_FLOOR_MISSES)}

#: How close to a floor, as a median of per-round ratios, a lock must be
#: (its interval reaching 1 as well) to count as level with it.
LEVEL = 0.95


@dataclass
class Verdict:
    target: str
    measured: str
    met: Optional[str]


def _state(met: Optional[bool]) -> Optional[str]:
    return None if met is None else MET if met else NOT_MET


def paired(results: Results, config: str, floor: str, contender: str = "while_executing") -> str:
    """``contender`` over ``floor`` within the rounds of ``config``: median
    and interval, e.g. ``1.02 (0.97–1.06)``.
    """
    values = results.against(config, contender, floor)
    interval = median_interval(values)
    if interval is None:
        return "n/a"
    return f"{median(values):.2f} ({interval[0]:.2f}–{interval[1]:.2f})"


def _level(values: list[float]) -> bool:
    """Whether per-round ratios to a floor say the lock is level with it:
    a median of at least :data:`LEVEL` and an interval that reaches 1.
    """
    interval = median_interval(values)
    return interval is not None and median(values) >= LEVEL and interval[1] >= 1.0


def _fixed_target(results: Results, config: str, target: float) -> Verdict:
    """A target of a fixed ratio to bare: met; or missed where a floor
    of the same rounds misses it too, the bare-socket floor first (it
    has the least work), the lock level with that floor or not; or
    missed.
    """
    process = figure_name("process", config)
    mine, one, raw, lock = (results.ratio(process, contender, BARE) for contender in ("while_executing", *FLOORS))
    measured = (f"{number(mine, 2)} × bare (1 PING: {number(one, 2)} ×, bare socket: {number(raw, 2)} ×, "
                f"lock floor: {number(lock, 2)} ×); ÷ bare-socket floor within each round "
                f"{paired(results, config, FLOOR_RAW)}, ÷ lock floor {paired(results, config, FLOOR_LOCK)}")
    met = _state(_at_least(mine, target))
    for floor, ratio in ((FLOOR_RAW, raw), (FLOOR_LOCK, lock)):
        if met == NOT_MET and ratio is not None and ratio < target:
            level, misses = MISSED_BY[floor]
            met = level if _level(results.against(config, "while_executing", floor)) else misses
    label = "default prefetch" if config == "default" else config
    return Verdict(f"processing, `while_executing`, {label} ≥ {target:.2f} × bare", measured, met)


def _floor_target(results: Results, config: str = "prefetch 64") -> Verdict:
    """The target of the one-PING floor: met when the lock's median
    per-round ratio to that floor is at least 1; missed where the lock
    floor is below it too, the lock level with the lock floor or not;
    or missed.
    """
    mine, one, lock = (results.ratio(figure_name("process", config), contender, BARE)
                       for contender in ("while_executing", FLOOR_ONE, FLOOR_LOCK))
    over_floor = results.against(config, "while_executing", FLOOR_ONE)
    lock_over_floor = results.against(config, FLOOR_LOCK, FLOOR_ONE)
    measured = (f"{number(mine, 2)} × bare (1 PING: {number(one, 2)} ×, lock floor: {number(lock, 2)} ×); "
                f"÷ floor within each round {paired(results, config, FLOOR_ONE)}, ÷ lock floor "
                f"{paired(results, config, FLOOR_LOCK)}; lock floor ÷ floor "
                f"{paired(results, config, FLOOR_ONE, FLOOR_LOCK)}")
    met = _state(None if not over_floor else median(over_floor) >= 1.0)
    if met == NOT_MET and lock_over_floor and median(lock_over_floor) < 1.0:
        level, misses = MISSED_BY[FLOOR_LOCK]
        met = level if _level(results.against(config, "while_executing", FLOOR_LOCK)) else misses
    return Verdict(f"processing, `while_executing`, {config} ≥ the one-PING floor of the same run", measured, met)


def verdicts(results: Results) -> list[Verdict]:
    def ratio(config: str, contender: str = "while_executing") -> Optional[float]:
        return results.ratio(figure_name("process", config), contender, BARE)

    enqueue = results.ratio("enqueue", "until_executed", BARE)
    recipe = results.ratio("process", "while_executing", RECIPE)
    on_worker = results.trips_per_message("while_executing", "worker", ("lock",))
    both = results.trips_per_message("until_and_while_executing", "process", ("lock",))
    keys = [f.keys for f in results.footprints if f.contender != RECIPE]
    renewals = results.renewals
    batched = None if renewals is None or not renewals.round_trips else renewals.extends / renewals.round_trips
    verdicts = [
        _fixed_target(results, "default", 0.95),
        _floor_target(results),
        _fixed_target(results, "1 ms sleep job", 0.95),
        _fixed_target(results, "1 ms CPU job", 0.90),
        Verdict("enqueue, `until_executed`, lock in the broker's Redis ≥ 0.70 × bare",
                f"{number(enqueue, 2)} × bare (1 PING: {number(results.ratio('enqueue', FLOOR, BARE), 2)} ×)",
                _state(_at_least(enqueue, 0.70))),
        Verdict("1 lock round trip on the worker thread per `while_executing` job",
                f"{number(on_worker, 2)} ({results.lock_trips('while_executing', 'worker')})",
                _state(None if on_worker is None else round(on_worker, 2) <= 1.0)),
        Verdict("2 lock round trips per `until_and_while_executing` job",
                f"{number(both, 2)} ({results.lock_trips('until_and_while_executing', 'process')})",
                _state(None if both is None else round(both, 2) <= 2.0)),
    ]
    for jobs, limit in MAKESPAN_LIMITS.items():
        spans = [run.makespan for run in results.makespans.get(jobs, [])]
        verdicts.append(Verdict(
            f"{jobs} same-key jobs of 100 ms within {limit:g} s of the first start",
            f"median {number(median(spans) if spans else None, 2)} s, max {number(max(spans) if spans else None, 2)} s",
            _state(None if not spans else median(spans) <= limit)))
    return verdicts + [
        Verdict("at least as fast as the `ConcurrentRateLimiter` recipe (processing)",
                f"{number(recipe, 2)} × the recipe", _state(_at_least(recipe, 1.0))),
        Verdict(f"renewals batched per process, not one per lock ({THREADS} leases at once)",
                f"{number(batched, 1)} renewals per round trip",
                _state(None if batched is None else batched >= THREADS / 2)),
        Verdict("one key per held lock", f"{number(max(keys) if keys else None, 2)} keys at most",
                _state(None if not keys else max(keys) <= 1.0)),
    ]


def _at_least(value: Optional[float], limit: float) -> Optional[bool]:
    return None if value is None else value >= limit


def verdict_table(results: Results) -> str:
    return _table(["target", "measured (median of per-round ratios)", "verdict"],
                  [[v.target, v.measured, v.met or "not measured"] for v in verdicts(results)])


def _name(contender: str) -> str:
    names = {BARE: "bare Dramatiq", RECIPE: "ConcurrentRateLimiter recipe", FLOOR: "floor (bare + PINGs)",
             FLOOR_ONE: "floor (bare + 1 PING per job)", FLOOR_RAW: "floor (bare + 1 PING per job, bare socket)",
             FLOOR_LOCK: "lock floor (bare + `start.lua` per job, release riding, bare socket)"}
    return names.get(contender, f"UniqueMiddleware `{contender}`")


def tables(results: Results) -> str:
    """Every table, as Markdown."""
    return "\n\n".join([
        "### Targets\n\n" + verdict_table(results),
        "### Throughput\n\n" + throughput_table(results),
        "### Configurations: worker and job\n\n" + config_table(results),
        f"### Against the floors, within each round (median, {CONFIDENCE:.0%} interval)\n\n" + floors_table(results),
        "### Redis work per message\n\n" + redis_table(results),
        "### Lease renewals of long jobs\n\n" + renewal_table(results),
        "### Footprint of held locks\n\n" + footprint_table(results),
        "### Makespan of same-key jobs (`while_executing`, default settings)\n\n" + makespan_table(results),
        "### What one call costs\n\n" + cost_table(results),
    ])
