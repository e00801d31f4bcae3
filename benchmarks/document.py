"""``docs/performance.md``: the tables of one run, where and how it
ran, and what the figures mean.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from importlib import metadata
from statistics import median
from typing import Any, Optional

import redis
import redis.utils

from . import layers
from .app import BARE, FLOOR, FLOOR_LOCK, FLOOR_ONE, FLOOR_RAW, RECIPE
from .report import Results, figure_name, number, paired, percentile, tables
from .costs import ENQUEUE_HOOK, HOOKS, LOCKED_SEND, SEND
from .server import version
from .workers import ROOT, THREADS


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _commit() -> str:
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain")
    except OSError:
        return "unknown"
    return f"{head}{' with uncommitted changes' if dirty else ''}" if head else "unknown"


def _git(*args: str) -> str:
    # Read-only queries: the harness never changes the tree.
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


#: What a plan with the throughput layer's rounds adds to the page's plan line.
LAYER_PLAN = "; beside them, the throughput layer's three variants, at the defaults and at prefetch 64"


def meta(
    client: redis.Redis, args: argparse.Namespace, plan: Any, started: float, load: tuple[float, ...]
) -> dict[str, str]:
    """Where, when and with what the run measured."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "duration": f"{time.time() - started:.0f} s",
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "load": f"1-minute load average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
        "versions": (f"Python {platform.python_version()}, dramatiq {metadata.version('dramatiq')}, "
                     f"redis-py {metadata.version('redis')}, redis-server {version(client)}, "
                     f"dramatiq-unique {metadata.version('dramatiq-unique')} at {_commit()}"),
        "redis": (f"{args.redis} (given with --redis; its other clients count in the commands)" if args.redis
                  else "a private redis-server the harness started"),
        "plan": (f"{plan.rounds} rounds of {plan.sent} jobs per contender, sent in turns of {plan.chunk}, "
                 "in each of its configurations" if getattr(args, "layers", False) else
                 f"{'--quick' if args.quick else 'full'}: {plan.rounds} rounds of {plan.sent} jobs per contender "
                 f"(bare Dramatiq, `while_executing` and the three floors: {plan.every_config_round} in every "
                 "configuration, the default included"
                 f"{LAYER_PLAN if plan.layers else ''}), "
                 f"sent in turns of {plan.chunk}; round trips counted over {plan.audit} jobs; "
                 f"makespans {', '.join(f'N={jobs} × {rounds}' for jobs, rounds in plan.makespans)}; "
                 f"footprint of {plan.locks} held locks; {plan.calls} single calls of each kind"),
    }


def layers_meta(results: Results) -> str:
    """Where and when a ``--layers`` run measured, for its section alone."""
    m = results.meta
    return (f"\nWritten by `python -m benchmarks --layers`, apart from the rest of the page: {m['date']}, "
            f"{m['duration']}; {m['load']}; dramatiq-unique at {_commit()}; {m['plan']}.\n")


def render(results: Results) -> str:
    """The whole document."""
    m = results.meta
    return f"""# Performance

{summary(results)}

Written by `python -m benchmarks` (see the README); do not edit by hand, run it again.

- **When:** {m['date']}, {m['duration']}
- **Machine:** {m['machine']}; {m['load']}
- **Versions:** {m['versions']}
- **Redis:** {m['redis']}
- **Plan:** {m['plan']}

## How it measures

Each contender is a `RedisBroker` app with the same no-op actor
`job(key, seq)`, run by one real `dramatiq` worker process with
{THREADS} threads (`python -m dramatiq benchmarks.worker:broker -p 1 -t {THREADS}`):

- **bare Dramatiq**: no middleware of ours;
- **UniqueMiddleware `<lock>`**: every lock type, default settings, `lock_args=["key"]`;
- **ConcurrentRateLimiter recipe**: `with ConcurrentRateLimiter(RedisBackend(), key, limit=1).acquire():`
  around the body;
- **floor**: not a contender but the yardstick: bare Dramatiq plus one `PING` per lock step
  (one in `before_enqueue`, one in `before_process_message`, one in `after_process_message`),
  which is what the round trips alone cost on this machine;
- **floor (1 PING per job)**: bare Dramatiq plus one `PING` in `before_process_message`: the cost
  of a lock that makes one round trip on the worker thread;
- **floor (1 PING per job, bare socket)**: the same `PING` written and read on a socket of each
  worker thread's own, with no client library in the way (redis-py only connects it): what a round
  trip on the worker thread costs with no client work at all.

Besides Dramatiq's defaults (prefetch 16 for 8 threads, a no-op job), bare Dramatiq,
`while_executing` and the three floors are also run with `dramatiq_queue_prefetch=64` (where bare
Dramatiq is CPU-bound), with a job that sleeps 1 ms, and with a job that spins for 1 ms of its
thread's CPU, in every round.  These five run in more rounds than the other contenders (the plan
above), at the defaults too: their targets compare rates a few percent apart.  The **release
latency** is the time from the end of a job (a middleware after ours) to the run lock's `released`
event.  It is measured in one more
`while_executing` run per configuration, after the rounds: recording it subscribes a listener to
the lock events, and the middleware builds an event only for a listener, so the rate runs have none.

Every job has its own key except in the makespan runs.  In each round
the driver first sends every contender's jobs from one thread, taking
turns of a few jobs so that load from elsewhere hits each contender
alike (the **enqueue rate**), then starts one worker per contender in
turn on its full queue (the **processing rate**, from the first job's
start to the last job's end).  The order of contenders rotates from
round to round.  Ratios are taken within a round and the tables show
their median, with the lowest and highest round in brackets.  Against
the floors, `while_executing` is divided by each floor within each
round, and the median of those ratios comes with a distribution-free
interval (order statistics that cover the true median with the stated
confidence): a ratio whose interval holds 1 is level with that floor
as far as this run can tell.  A fixed target that the bare-socket floor
of the same rounds also misses is reported as such, and as missed level
with that floor where `while_executing` is within 5% of it (the median
of the ratios at least 0.95) and its interval holds 1.

Commands per message are `INFO commandstats` deltas and include the
commands run inside Lua scripts.  Round trips are counted in the
clients (one redis-py `send_packed_command` is one round trip, a whole
pipeline included) over a separate, untimed run.  Worker CPU is the
worker process's CPU time from its first job's start to its last job's
end, and its context switches (voluntary and involuntary, every thread's)
are counted over the same span; Redis CPU is the server's over the processing phase.  Single calls
(a bare send, a `PING`, each lock script) are timed from one driver
thread in turns, and the middleware's own Python with a backend that
answers at once.  The renewal run holds {THREADS} long jobs at a time
under a short lease and counts the renewal round trips; the footprint
holds many locks through the middleware's real code path and reads
`MEMORY USAGE` of each key.

{tables(results)}

{layers.section(results)}
{notes(results)}
"""


def summary(results: Results) -> str:
    """The page's opening, five lines at most: what the lock costs."""
    def ratio(config: str, contender: str = "while_executing", against: str = BARE) -> str:
        return number(results.ratio(figure_name("process", config), contender, against), 2)

    return (f"**In short:** a `while_executing` lock processes {ratio('default')} × bare Dramatiq's rate at the "
            f"defaults, and {ratio('prefetch 64')} × at prefetch 64;\n"
            f"with a 1 ms job, {ratio('1 ms sleep job')} × (sleeping) and {ratio('1 ms CPU job')} × (on the CPU), "
            f"against {ratio('1 ms sleep job', FLOOR_LOCK)} and {ratio('1 ms CPU job', FLOOR_LOCK)} for the lock "
            f"floor, the least any client of its scripts can cost;\n"
            f"an `until_executed` send enqueues at {number(results.ratio('enqueue', 'until_executed', BARE), 2)} × "
            f"bare Dramatiq's rate;\n"
            f"with one replica and `min_replicas=1`, {ratio(REPLICATED)} × bare Dramatiq's rate on the same "
            f"replicated Redis.  The rest of the page says how that was measured, and why.")


def notes(results: Results) -> str:
    """What the figures mean, with the run's own numbers."""
    sections = [_noise(results), _processing(results), _configurations(results), _failover(results), _release(results),
                _enqueue(results), _recipe(results), _round_trips(results), _footprint(results), _makespan(results),
                _not_done(results), _guarantees(results), _closing(results)]
    return "## Notes\n\n" + "\n\n".join(section for section in sections if section)


def _noise(results: Results) -> str:
    bare = results.samples["process"].get(BARE, [])
    swing = max(bare) / min(bare) if bare else float("nan")
    return (f"**Noise.** The machine was shared with other work during the run ({results.meta['load']}). "
            f"The bare processing rate alone moved by {swing:.1f}× between rounds, so absolute rates say "
            "little; the ratios are taken within one round, and the brackets show their lowest and highest "
            "round. Read the ratios, and rerun the harness before trusting any single figure.")


def _cost(results: Results, name: str, field: str = "wall") -> float:
    value = getattr(results.cost(name), field, None)
    return float("nan") if value is None else float(value)


#: The share of one core above which bare Dramatiq counts as CPU-bound
#: (the GIL lets a worker process use one).
CPU_BOUND = 0.85

#: How the redis-py client parses, when hiredis is missing.
PURE_PYTHON = ", in pure Python (hiredis is not installed)"


def _ratio(results: Results, config: str, contender: str) -> Optional[float]:
    return results.ratio(figure_name("process", config), contender, BARE)


def _processing(results: Results) -> str:
    mine, one, two, raw = (_ratio(results, "default", c) for c in ("while_executing", FLOOR_ONE, FLOOR, FLOOR_RAW))
    if mine is None or one is None or two is None or raw is None:
        return ""
    cpu = {c: number(results.median("worker_cpu", c)) for c in (BARE, FLOOR_ONE, "while_executing")}
    return (f"**Processing with `while_executing`: {mine:.2f} × bare (target 0.95).** A job costs its worker "
            "thread at most one round trip, `start.lua`, and often a share of one: the starts of worker threads "
            "that arrive while one is in flight go out together in the next round trip (group commit), and the "
            "releases of jobs that have ended ride in front of it (see the round trips below). Each call is an "
            "`EVALSHA` packed once, sent on a connection of a small private pool that mirrors the client's with "
            "redis-py's public `send_packed_command` and read back with its `read_response` (RESP2 or RESP3), "
            "bypassing redis-py's `Script`, pool and command machinery; no private state of redis-py is used. "
            "Every system call on a worker thread lets another take the GIL. A lock that makes one round trip "
            f"of its own per job through redis-py is bounded by the one-`PING` floor: {one:.2f} × bare in the "
            f"same rounds (two `PING`s: {two:.2f}); `while_executing` reached {mine / one:.0%} of it. The same "
            f"round trip with no client work at all, on a bare socket, measured {raw:.2f}. Single calls from one "
            f"thread: run-lock acquire {_cost(results, 'run lock: acquire'):.0f} µs, `PING` through redis-py "
            f"{_cost(results, 'PING'):.0f} µs{'' if redis.utils.HIREDIS_AVAILABLE else PURE_PYTHON}. Worker CPU per "
            f"job: bare {cpu[BARE]} µs, one `PING` {cpu[FLOOR_ONE]} µs, `while_executing` {cpu['while_executing']} "
            f"µs, of which the middleware's own Python is {_cost(results, HOOKS):.0f} µs. {_default_bound(results)}")


def _default_bound(results: Results) -> str:
    """What bounds bare Dramatiq at default prefetch on this machine: its
    prefetch window and poll backoff, or (a slow machine) the GIL.
    """
    busy = _busy(results, "default")
    if busy is not None and busy >= CPU_BOUND:
        return (f"On this machine bare Dramatiq is CPU-bound even at default prefetch (its worker keeps "
                f"{busy:.0%} of a core busy, and the GIL lets it use one): the ratio follows the CPU a job spends "
                "holding the GIL, as at prefetch 64 below.")
    return ("At default prefetch bare Dramatiq waits on its prefetch window, its poll backoff and its consumer "
            "thread's one ack round trip per message, which competes for the GIL with every other thread of the "
            "process: the ratio there moves with the machine's load more than with the lock.")


def _busy(results: Results, config: str) -> Optional[float]:
    """The share of one core that bare Dramatiq's worker kept busy."""
    rate = results.median(figure_name("process", config), BARE)
    cpu = results.median(figure_name("worker_cpu", config), BARE)
    return None if rate is None or cpu is None else rate * cpu / 1e6


#: The configuration of failover protection (benchmarks.runs.MIN_REPLICAS_1).
REPLICATED = "one replica, min_replicas=1"


def _failover(results: Results) -> str:
    replicated, default = _ratio(results, REPLICATED, "while_executing"), _ratio(results, "default", "while_executing")
    if replicated is None or default is None:
        return ""
    cpu = [number(results.median(figure_name("worker_cpu", REPLICATED), c)) for c in (BARE, "while_executing")]
    return (f"**Failover protection.** With one replica attached to the Redis for its rounds, and "
            f"`dramatiq_unique_min_replicas=1`, so that every run lock waits, in the same round trip, for the replica "
            f"to acknowledge the take (`WAIT 1 100` after the script), `while_executing` processed {replicated:.2f} × "
            f"bare Dramatiq's rate on the same replicated Redis (bare Dramatiq's broker writes are replicated too), "
            f"against {default:.2f} × at the defaults without a replica; worker CPU per job {cpu[0]} µs bare, "
            f"{cpu[1]} µs locked. See `docs/reliability.md`, \"Failover\".")


def _configurations(results: Results) -> str:
    rows = []
    for config in ("prefetch 64", "1 ms sleep job", "1 ms CPU job"):
        mine, one, raw, lock = (_ratio(results, config, c) for c in ("while_executing", FLOOR_ONE, FLOOR_RAW,
                                                                       FLOOR_LOCK))
        if mine is None or one is None or raw is None or lock is None:
            continue
        cpu = [number(results.median(figure_name("worker_cpu", config), c)) for c in (BARE, "while_executing",
                                                                                      FLOOR_LOCK)]
        rows.append(f"{config}: {mine:.2f} × bare against floors of {one:.2f} (one `PING`), {raw:.2f} (on a "
                    f"bare socket) and {lock:.2f} (the lock floor); worker CPU per job {cpu[0]} µs bare, {cpu[1]} "
                    f"µs locked, {cpu[2]} µs at the lock floor")
    if not rows:
        return ""
    return ("**Other configurations.** " + "; ".join(rows) + ". With prefetch 64 bare Dramatiq is CPU-bound, and "
            "what bounds the rate is the CPU a job spends holding the GIL. " + _against_floor(results) + " Group "
            "commit shares round trips between worker threads, which saves system calls and context switches "
            "(the table above counts them), but the lock's own cost is the middleware's Python (its hooks, "
            "building the calls and reading their replies, reporting the release), which holds the GIL. With a "
            "sleeping job there are fewer overlapping starts to group; with a CPU job the GIL "
            "serialises everything, the round trips included." + _floors_below_targets(results))


def _against_floor(results: Results) -> str:
    """How ``while_executing`` at prefetch 64 compares with the one-PING
    floor: rate, CPU per job, and how each splits its CPU.
    """
    config = "prefetch 64"
    mine, one = _ratio(results, config, "while_executing"), _ratio(results, config, FLOOR_ONE)
    cpu = [results.median(figure_name("worker_cpu", config), c) for c in ("while_executing", FLOOR_ONE)]
    if mine is None or not one or cpu[0] is None or not cpu[1]:
        return ""
    return (f"There `while_executing` ran at {mine / one:.0%} of the one-`PING` floor's rate, with "
            f"{cpu[0] / cpu[1]:.0%} of its CPU per job{_user_sys(results, config)}.")


#: The configurations whose target is a fixed ratio, and that ratio.
FIXED_TARGETS = (("default", 0.95), ("1 ms sleep job", 0.95), ("1 ms CPU job", 0.90))


def _floors_below_targets(results: Results) -> str:
    """Where a floor of this run is itself below a fixed target: the
    bare-socket floor (no lock kept in Redis can pass it), the lock floor
    (no client of this lock's scripts can), or only the redis-py one
    (only a lock with less client work than a PING can).
    """
    below: dict[str, list[str]] = {kind: [] for kind in _BELOW}
    for config, target in FIXED_TARGETS:
        one, raw, lock = (_ratio(results, config, floor) for floor in (FLOOR_ONE, FLOOR_RAW, FLOOR_LOCK))
        if raw is None or one is None or lock is None:
            continue
        if raw < target:
            below["bare socket"].append(f"{config}: {raw:.2f} against a target of {target:.2f}; `while_executing` "
                                        f"÷ that floor {paired(results, config, FLOOR_RAW)}")
        elif lock < target:
            below["lock"].append(f"{config}: the lock floor {lock:.2f}, the bare-socket one {raw:.2f}, against a "
                                 f"target of {target:.2f}; `while_executing` ÷ the lock floor "
                                 f"{paired(results, config, FLOOR_LOCK)}")
        elif one < target:
            below["redis-py"].append(f"{config}: one `PING` through redis-py {one:.2f}, on a bare socket {raw:.2f}, "
                                     f"against a target of {target:.2f}; `while_executing` ÷ the redis-py floor "
                                     f"{paired(results, config, FLOOR_ONE)}")
    text = "".join(opening + "; ".join(below[kind]) + closing
                   for kind, (opening, closing) in _BELOW.items() if below[kind])
    return text + _lock_floor_at_prefetch(results)


#: What a floor below a target says, by floor: the words before the
#: configurations it is below in, and the words after them.
_BELOW = {
    "bare socket": (
        " In this run the bare-socket floor itself is below a target (",
        "). A run lock must be held before its job starts, so every job waits on its worker thread for at least one "
        "round trip to Redis, and the bare-socket floor is that wait with no client work at all: no lock kept in "
        "Redis runs these jobs faster, whatever its client, and sharing round trips between threads (group commit) "
        "shares their CPU, not the wait. Only a lock taken before the job is due to start, while the message waits "
        "in the worker's queue, would pass it, and that lock would be held while the job is not executing, which "
        "`while_executing` promises it is not.",
    ),
    "lock": (
        " Where the lock floor is below a target (",
        "), no client of this lock's scripts passes it: the lock floor is the one round trip a run lock cannot do "
        "without, `start.lua` (claim the delivered copy, take the slot, fence) with the thread's last `release.lua` "
        "in the same write, packed and read in C on a bare socket, and no other work at all (no group commit, "
        "lease, event or state). The bare-socket `PING` above it differs only in what Redis runs before it "
        "answers: a cheaper script would need to drop the claim, which keeps a rescheduled message's two copies "
        "from both running, or the fence.",
    ),
    "redis-py": (
        " Where only the redis-py floor is below a target (",
        "), the target is within reach of a lock whose work on the worker, its round trip aside, costs less than a "
        "redis-py `PING`'s.",
    ),
}


def _lock_floor_at_prefetch(results: Results, config: str = "prefetch 64") -> str:
    """How far the lock floor is from the one-PING floor where that floor
    is the target, ``while_executing`` from the lock floor, and which of
    the two stands between the lock and the target.
    """
    lock_over_one = results.against(config, FLOOR_LOCK, FLOOR_ONE)
    if not lock_over_one or _ratio(results, config, "while_executing") is None:
        return ""
    between = ("its client work beyond that one round trip" if median(lock_over_one) >= 1.0 else
               "the lock floor itself, below the target: no client of these scripts reaches it")
    return (f" At {config}, where the target is the one-`PING` floor, the lock floor ran at "
            f"{paired(results, config, FLOOR_ONE, FLOOR_LOCK)} of that floor's rate within each round and "
            f"`while_executing` at {paired(results, config, FLOOR_LOCK)} of the lock floor's: what stands between "
            f"the lock and the target is {between}.")


def _user_sys(results: Results, config: str) -> str:
    """`` (user / system µs per job: ...)`` for bare, one PING and the lock, or nothing."""
    parts = []
    for contender, label in ((BARE, "bare"), (FLOOR_ONE, "one `PING`"), ("while_executing", "`while_executing`")):
        user = results.median(figure_name("worker_user", config), contender)
        system = results.median(figure_name("worker_sys", config), contender)
        if user is None or system is None:
            return ""
        parts.append(f"{label} {user:.0f} / {system:.0f}")
    return f" (user / system CPU µs per job: {', '.join(parts)})"


def _release(results: Results) -> str:
    latencies = results.latencies.get(("default", "while_executing"), [])
    if not latencies:
        return ""
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    return (f"**Release in the background.** A run lock is released {p50 * 1000:.2f} ms after its job ends at the "  # type: ignore[operator]
            f"median and {p99 * 1000:.2f} ms at the 99th percentile (default configuration; the table above has "  # type: ignore[operator]
            "the others). A worker thread queues its release and moves on; the next run lock call of any worker "
            "thread of the process carries every release pending then, in front of its own call, and the releaser "
            "thread sends what no call carried within 2 ms. A release is sent once, by whichever thread takes it "
            "off the list first, and `release.lua` checks the owner: never twice, never as a non-owner. The "
            "releaser drains on worker shutdown and reports a batch that waits more than a second for Redis (ERROR "
            "log, `backend_error` per lock) without holding up any worker thread. The message is acked before its "
            "run lock is released: a process that dies in between leaves the key held until its lease expires "
            "(60 s by default), as any crash of a holder does.")


def _enqueue(results: Results) -> str:
    mine, floor = results.ratio("enqueue", "until_executed", BARE), results.ratio("enqueue", FLOOR, BARE)
    if mine is None or floor is None:
        return ""
    send, locked, acquire, hook = (_cost(results, name) for name in (SEND, LOCKED_SEND, "enqueue lock: acquire",
                                                                       ENQUEUE_HOOK))
    return (f"**Enqueue with `until_executed`: {mine:.2f} × bare (target 0.70).** On the Redis broker's own Redis "
            "a new send makes one round trip, as bare Dramatiq does: send.lua takes the lock, confirmed at once, and "
            "runs the broker's own dispatch.lua in the same script (the send fast path; a lock in another Redis, "
            "RabbitMQ, a replacing actor or a later `before_enqueue` take the two-step path: a provisional lock, "
            "then the enqueue). From one thread a bare send takes "
            f"{send:.0f} µs and a locked one {locked:.0f} µs ({send / locked:.2f} ×); acquire.lua alone costs "
            f"{acquire:.0f} µs, and the middleware's own Python at enqueue (digest of the arguments, key, event) "
            f"{hook:.0f} µs. Bare Dramatiq plus one `PING` per send, the floor of a two-step send, measured "
            f"{floor:.2f}. `while_executing` takes no lock at enqueue "
            f"({number(results.ratio('enqueue', 'while_executing', BARE), 2)} × bare).")


def _recipe(results: Results) -> str:
    ratio = results.ratio("process", "while_executing", RECIPE)
    if ratio is None:
        return ""
    cpu = {c: number(results.median("worker_cpu", c)) for c in (RECIPE, "while_executing")}
    return (f"**Against the `ConcurrentRateLimiter` recipe: {ratio:.2f} × its processing rate.** The recipe makes "
            "four round trips per job (`SET NX` to take the mutex; `WATCH`, `GET` and `MULTI/SET/EXEC` to release "
            "it) where `while_executing` makes one at most, shared under load, and its worker spends "
            f"{cpu[RECIPE]} µs of CPU per job against "
            f"{cpu['while_executing']}. It is not a correct mutex either: the release is a decrement that checks no "
            "owner, so a holder that outlived the 15-minute TTL frees the slot of the next one; a crashed holder "
            "blocks its key for those 15 minutes (a run lock of ours for one 60 s lease); every conflict is a "
            "failure that goes through Retries, with its 15 s minimum backoff, and counts against "
            "`max_retries`; and its counter key stays behind for 15 minutes after every release.")


def _round_trips(results: Results) -> str:
    on_worker = results.trips_per_message("while_executing", "worker", ("lock",))
    total = results.trips_per_message("while_executing", "process", ("lock",))
    text = (f"**Round trips.** `while_executing` made {number(on_worker, 2)} lock round trips per job on the worker "
            f"threads ({number(total, 2)} in all, with the releaser thread's): "
            f"{results.lock_trips('while_executing', 'worker')} on the worker threads, where `(grouped)` is a round "
            "trip shared by the starts of several worker threads and `+releases` one that carried the releases of "
            "ended jobs. There is no renewal: the jobs are far shorter than lease/3 (20 s). ")
    r = results.renewals
    if r is not None:
        text += (f"In the renewal run, {r.jobs} jobs of {r.seconds:.1f} s under a {r.lease} ms lease needed "
                 f"{r.extends} renewals, which went out in {r.round_trips} round trips: one thread per process "
                 "renews, with the first lease that falls due, every lease due within half an interval, in one "
                 "pipeline, so that the leases of a process align. ")
    return text + ("`until_and_while_executing` makes two lock round trips per job: `start.lua` claims the copy, "
                   "takes the run lock and, only when it got it, releases the enqueue lock (both keys share the "
                   "digest's hash tag), and the background release frees the run lock.")


def _footprint(results: Results) -> str:
    ours = [f for f in results.footprints if f.contender != RECIPE]
    if not ours:
        return ""
    return (f"**Footprint.** Each held lock is one Redis hash of {min(f.bytes for f in ours):.0f}–"
            f"{max(f.bytes for f in ours):.0f} bytes (`MEMORY USAGE`), deleted with its last holder. A key that "
            "messages are waiting for (the `reschedule` strategy) also has `<key>:wait` and `<key>:bodies` while "
            "they wait, and a record `<key>:m:<message id>` per rescheduled message. `until_expired` keeps its key "
            "until `lock_ttl` by design.")


def _makespan(results: Results) -> str:
    runs = {jobs: run_list for jobs, run_list in results.makespans.items() if run_list}
    if not runs:
        return ""
    lines = []
    for jobs, run_list in sorted(runs.items()):
        spans = [run.makespan for run in run_list]
        gaps = [gap * 1000 for run in run_list for gap in run.handoffs]
        lines.append(f"N={jobs}: median {median(spans):.2f} s against a serial ideal of "
                     f"{jobs * run_list[0].seconds:.1f} s, hand-offs {median(gaps):.0f} ms median and "
                     f"{max(gaps):.0f} ms at most")
    return ("**Makespan.** When a holder's run lock is released, `release.lua` pops the longest waiter and the "
            "releaser thread enqueues it at once; its delayed copy stays the safety net, and `claim` skips whichever "
            "copy arrives second. " + "; ".join(lines) + ". Dramatiq's Redis consumer polls an empty queue with a "
            "backoff of 5·2^k ms (jittered, capped at `worker_timeout`, 1 s), so a waiter handed a key after a 100 ms "
            "job would wait 40–160 ms for the poll; after a hand-off on one of its queues, the process caps that "
            "backoff at 5 ms for 5 s (only the consumer's cap changes, and only on the Redis broker). The first "
            "hand-off of a run still meets the long backoff (the longest hand-off seen). Longer runs also reschedule "
            "again when safety-net copies come back after 4–6 s and meet the lock held (the reschedules per job "
            "column).")


def _not_done(results: Results) -> str:
    return ("**Group commit.** The first worker thread to find no start in flight leads: it sends its own call and "
            "every call queued meanwhile in one pipeline, hands each caller its own reply, and wakes the first "
            "caller queued since to lead the next round trip. A waiting worker thread blocks once, on a lock of "
            "its own, instead of on a socket, which saves the process GIL hand-overs under load; alone, a call "
            "leads at once. A waiter gives up after twice the socket timeout plus a second, withdrawing its call "
            "if it was not sent yet; an interrupted waiter (a time limit) passes on a lead it was handed. Enqueue "
            "locks, replace, renewals and the reaper keep their own direct calls.")


#: The "now" column of issue 12's target table: the figures before it.
_BEFORE = {
    "default": "0.66–0.72", "prefetch 64": "0.36–0.39", "sleep/cpu": "0.79 / 0.80", "enqueue": "0.46–0.49",
    "worker trips": "2", "uaw trips": "3", "makespan": "1.20–1.37 s / 13.8–14.1 s",
}


def _closing(results: Results) -> str:
    def ratio(config: str, contender: str = "while_executing") -> str:
        return number(_ratio(results, config, contender), 2)

    spans = {jobs: [run.makespan for run in runs] for jobs, runs in results.makespans.items() if runs}
    makespan = " / ".join(f"{median(spans[jobs]):.2f} s" if jobs in spans else "n/a" for jobs in (10, 100))
    def floors(config: str) -> str:
        return (f"1 PING: {ratio(config, FLOOR_ONE)}, bare socket: {ratio(config, FLOOR_RAW)}, "
                f"lock floor: {ratio(config, FLOOR_LOCK)}")

    rows = [
        ["processing, `while_executing`, default prefetch", _BEFORE["default"], "≥ 0.95",
         f"{ratio('default')} ({floors('default')})"],
        ["processing, `while_executing`, prefetch 64", _BEFORE["prefetch 64"], "≥ the one-PING floor",
         f"{ratio('prefetch 64')} (1 PING: {ratio('prefetch 64', FLOOR_ONE)}, lock floor: "
         f"{ratio('prefetch 64', FLOOR_LOCK)}; ÷ the 1-PING floor within each round "
         f"{paired(results, 'prefetch 64', FLOOR_ONE)})"],
        ["processing, 1 ms sleep job / 1 ms CPU job", _BEFORE["sleep/cpu"], "≥ 0.95 / ≥ 0.90",
         f"{ratio('1 ms sleep job')} ({floors('1 ms sleep job')}) / {ratio('1 ms CPU job')} "
         f"({floors('1 ms CPU job')})"],
        ["enqueue, `until_executed`, lock in the broker's Redis", _BEFORE["enqueue"], "≥ 0.70",
         number(results.ratio("enqueue", "until_executed", BARE), 2)],
        ["round trips on the worker thread per `while_executing` job", _BEFORE["worker trips"], "1",
         number(results.trips_per_message("while_executing", "worker", ("lock",)), 2)],
        ["lock round trips per `until_and_while_executing` job", _BEFORE["uaw trips"], "2",
         number(results.trips_per_message("until_and_while_executing", "process", ("lock",)), 2)],
        ["10 / 100 same-key 100 ms jobs", _BEFORE["makespan"], "≤ 1.2 s / ≤ 11 s", makespan],
    ]
    header = "| figure | before (issue 12) | target | this run |\n|---|---|---|---|\n"
    return ("**Issue 12's targets, with this run's figures** (the verdicts are in the Targets table above; the "
            "ratios are medians of per-round ratios, as everywhere on this page):\n\n" + header
            + "\n".join("| " + " | ".join(row) + " |" for row in rows))


def _guarantees(results: Results) -> str:
    if results.violations:
        return "**Guarantees broken in this run:** " + "; ".join(results.violations) + "."
    return ("**Guarantees.** In every run each job ran exactly once, including after the makespan runs had waited "
            "for every safety-net copy to come back and be skipped, and no two runs of one key overlapped.")
