"""The ``dramatiq-unique`` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..dashboard.view import duration, plural, remaining
from ..errors import UniqueError
from ..model.wire import PHASES, RUN

if TYPE_CHECKING:
    from .admin import Lock, LockAdmin


#: The status of a command whose output pipe closed (``... | head``):
#: 128 + SIGPIPE, what a shell reports for a program that signal ended.
CLOSED_PIPE_STATUS = 141


class CommandError(Exception):
    """Ends the command with a one-line message on stderr."""

    def __init__(self, message: str, *, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args.redis, url=args.url)


def _locks_url(args: argparse.Namespace) -> Optional[str]:
    """``--url``, or ``--redis`` (its older name), or ``dramatiq_unique_url``."""
    from ..settings import from_environment

    if args.url and args.redis and args.url != args.redis:
        raise CommandError("--url and --redis name different locks: --redis is another name for --url; give one.")
    return args.url or args.redis or from_environment().url


def _admin(args: argparse.Namespace) -> "LockAdmin":
    """Connect to the locks of :func:`_locks_url` and ``--prefix`` (or its variable); check they answer."""
    from ..backends import from_url
    from ..settings import from_environment, masked
    from .admin import LockAdmin

    url = _locks_url(args)
    if url is None:
        raise CommandError("no lock backend to read locks from: give --url URL or set dramatiq_unique_url.")
    try:
        backend = from_url(url)
    except UniqueError:
        raise  # a bad URL or a missing extra: its own words
    except Exception as e:
        raise CommandError(f"cannot connect to {masked(url)}: {' '.join(str(e).split())}") from None
    admin = LockAdmin(backend, prefix=args.prefix or from_environment().prefix)
    admin.check()
    return admin


# Durations in the dashboard's wording, so that the CLI and the page read alike.


def _remaining(deadline: int) -> str:
    return remaining(deadline - time.time() * 1000)


def _ago(since: Optional[int]) -> str:
    """How long ago ``since`` (Unix ms) was; "?" when not recorded."""
    return "?" if since is None else duration(time.time() * 1000 - since)


def _timestamp(deadline: int) -> str:
    return datetime.fromtimestamp(deadline / 1000, tz=timezone.utc).isoformat(timespec="seconds")


def _print_json(data: Any) -> int:
    print(json.dumps(data, indent=2))
    return 0


def _print_table(rows: list[list[str]], headers: list[str]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    for row in [headers, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _row(lock: "Lock") -> list[str]:
    oldest = min((h.taken_at for h in lock.holders if h.taken_at is not None), default=None)
    # STATE: "provisional" while any holder awaits the confirmation of its publish; "-" for a run lock.
    state = "provisional" if any(h.provisional for h in lock.holders) else "confirmed"
    row = [lock.actor, lock.digest, lock.phase, lock.lock or "?", str(len(lock.holders)), _ago(oldest)]
    run = lock.phase == RUN
    return [*row, _remaining(lock.holders[0].deadline), "-" if run else state, str(len(lock.waiting)) if run else "-"]


def _locks(args: argparse.Namespace) -> int:
    admin = _admin(args)
    locks = list(admin.locks(actor=args.actor, pattern=args.pattern))
    if args.json:
        return _print_json([lock.as_dict() for lock in locks])
    if not locks:
        print(f"No locks under prefix {admin.prefix!r}.")
        return 0
    headers = ["ACTOR", "DIGEST", "PHASE", "LOCK", "HOLDERS", "AGE", "NEXT EXPIRY", "STATE", "WAITING"]
    _print_table([_row(lock) for lock in locks], headers)
    print(f"{plural(len(locks), 'lock')} under prefix {admin.prefix!r}.")
    return 0


def _print_lock(lock: "Lock") -> None:
    fields: list[tuple[str, Any]] = [("key", lock.key), ("actor", lock.actor), ("digest", lock.digest)]
    fields += [("phase", lock.phase), ("lock", lock.lock or "?"), ("fence", lock.fence)]
    fields.append(("lock args", lock.lock_args if lock.lock_args is not None else "(not recorded)"))
    if lock.current is not None:
        fields.append(("current", f"{lock.current}  (superseded {lock.superseded})"))
    for label, value in [*fields, ("holders", len(lock.holders))]:
        print(f"{label:11}{value}")
    for holder in lock.holders:
        print(f"  message {holder.message_id}  owner {holder.owner}")
        if holder.taken_at is not None:
            print(f"    taken   {_timestamp(holder.taken_at)} ({_ago(holder.taken_at)} ago)")
        state = "  provisional: lapses then unless its publish is confirmed" if holder.provisional else ""
        print(f"    expires {_timestamp(holder.deadline)} (in {_remaining(holder.deadline)}){state}")
    if lock.phase == RUN:
        print(f"waiting    {len(lock.waiting)}")
        for waiter in lock.waiting:
            print(f"  message {waiter.message_id}  sent {_timestamp(waiter.sent_at)} ({_ago(waiter.sent_at)} ago)")


def _inspect(args: argparse.Namespace) -> int:
    locks = _admin(args).inspect(args.digest)
    if args.json:
        return _print_json([lock.as_dict() for lock in locks])
    for n, lock in enumerate(locks):
        if n:
            print()
        _print_lock(lock)
    return 0


def _confirm(question: str) -> bool:
    """Ask on stderr, so that stdout stays clean for ``--json``."""
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    if not sys.stdin.isatty():
        print(file=sys.stderr)  # a piped answer is not echoed: end the prompt's line
    return answer.strip().lower() in ("y", "yes")


def _release(args: argparse.Namespace) -> int:
    if sum(x is not None for x in (args.digest, args.actor, args.queue)) != 1:
        raise CommandError("release takes one of a DIGEST, --actor NAME or --queue NAME.", status=2)
    if args.digest is None and (args.holder or args.phase):
        raise CommandError("--holder and --phase apply to a DIGEST, not to --actor or --queue.", status=2)
    admin = _admin(args)
    if args.digest is None:
        return _release_many(admin, args)
    released = admin.release(args.digest, holder=args.holder, phase=args.phase)
    if not released:
        raise CommandError("nothing was released: the holder's slot had expired or been taken meanwhile.")
    if args.json:
        return _print_json({"released": released})
    for item in released:
        key, _, owner = item.partition(" ")
        print(f"Released holder {owner} of {key}." if owner else f"Released {key}.")
    return 0


def _release_many(admin: "LockAdmin", args: argparse.Namespace) -> int:
    """``release --actor NAME`` or ``release --queue NAME``: ask first, unless ``--yes``."""
    if args.actor is not None:
        count, noun, whose = sum(1 for _ in admin.locks(actor=args.actor)), "lock", f"of actor {args.actor!r}"
    else:
        count, noun, whose = len(admin.queue_holders(args.queue)), "enqueue lock holder", f"of queue {args.queue!r}"
    if count and not args.yes and not _confirm(f"Release {plural(count, noun)} {whose}?"):
        raise CommandError("aborted: nothing was released.")
    released = []
    if count:
        released = admin.release_actor(args.actor) if args.actor is not None else admin.release_queue(args.queue)
    if args.json:
        return _print_json({"released": released})
    print(f"Released {plural(len(released), noun)} {whose}.")
    return 0


def _reap(args: argparse.Namespace) -> int:
    from ..settings import REDIS_URL_SCHEMES, masked

    if args.dry_run and args.yes:
        raise CommandError("--dry-run and --yes contradict each other.", status=2)
    admin = _admin(args)
    locks_url = _locks_url(args)
    # The broker's Redis is, by default, the locks' when they are in a Redis.
    url = args.broker_redis or (locks_url if locks_url and locks_url.startswith(REDIS_URL_SCHEMES) else None)
    if url is None:
        raise CommandError("no broker Redis to look messages up in: give --broker-redis URL.")
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        client.ping()
    except Exception as e:
        raise CommandError(f"cannot reach the broker's Redis at {masked(url)}: {' '.join(str(e).split())}") from None
    report = admin.reap(client, release=args.yes, actor=args.actor, min_age=args.min_age, batch=args.batch)
    suspects = report.suspects
    if args.json:
        named = ("key", "actor", "message_id", "lock_args", "queue")
        found = [{**{n: getattr(s, n) for n in named}, "age_ms": s.age, "released": s.released} for s in suspects]
        totals = {"checked": report.checked, "skipped": report.skipped, "unknown": report.unknown, "released": args.yes}
        return _print_json({**totals, "suspects": found})
    if suspects:
        rows = [[s.actor, s.message_id, s.queue, duration(s.age), s.lock_args or "(not recorded)"] for s in suspects]
        _print_table(rows, ["ACTOR", "MESSAGE", "QUEUE", "AGE", "LOCK ARGS"])
    done = sum(1 for s in suspects if s.released) if args.yes else len(suspects)
    what = f"{plural(done, 'enqueue lock')} whose message is in no queue"
    print(f"Released {what}." if args.yes else f"Would release {what} (run with --yes to release them).")
    print(
        f"Looked up {report.checked}; left alone {report.skipped} (provisional, younger than --min-age, "
        f"or until_expired); {report.unknown} with no Redis broker place recorded (RabbitMQ messages cannot "
        "be looked up by id: after a purge use 'release --queue NAME' or 'release --actor NAME')."
    )
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from ..dashboard import Dashboard
    from ..dashboard.server import LOOPBACK_HOSTS, is_loopback, make_server

    named = {name.lower() for name in args.allowed_host or ()}
    if not named and not is_loopback(args.host):
        # Off loopback, an unchecked Host header lets any web page reach it through DNS rebinding.
        raise CommandError(
            f"--host {args.host} is not a loopback address: name the host names that clients reach the "
            "dashboard by with --allowed-host NAME (once per name), and set dramatiq_unique_dashboard_password "
            "or put it behind your own authentication: anyone who reaches it can release locks.",
            status=2,
        )
    admin = _admin(args)
    allowed_hosts = named | (LOOPBACK_HOSTS | {args.host} if is_loopback(args.host) else set())
    dashboard = Dashboard(admin, allowed_hosts=allowed_hosts)
    try:
        server = make_server(dashboard, host=args.host, port=args.port)
    except OSError as e:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{server.server_port}/"
    print(f"Serving the locks under prefix {admin.prefix!r} at {url}", file=sys.stderr)
    if dashboard.protected:
        # Plain HTTP: off this machine, the password crosses the network in clear.
        warning = "The dashboard asks for the password of dramatiq_unique_dashboard_password (any user name)"
        warning += "." if is_loopback(args.host) else "; put it behind HTTPS: over plain HTTP the password is in clear."
    else:
        warning = "The dashboard has no authentication: anyone who reaches it can release locks "
        warning += "(set dramatiq_unique_dashboard_password to ask for a password)."
    print(warning, file=sys.stderr, flush=True)
    with server:
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


class _Refused(argparse.Action):
    """A hidden option other commands take and this one refuses, saying why (not a bare "unrecognized")."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, reason: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        parser.error(f"{option} is not an option of this command: {self.reason}")


def parser() -> argparse.ArgumentParser:
    from ..dashboard.server import DEFAULT_HOST, DEFAULT_PORT

    top = argparse.ArgumentParser(prog="dramatiq-unique", description="Unique jobs and per-key locks for Dramatiq.")
    commands = top.add_subparsers(dest="command", required=True)
    # --url (or --redis) and --prefix: every command that reads locks.
    connection = argparse.ArgumentParser(add_help=False)
    url_help = "where the locks are: redis://, postgresql://... (default: $dramatiq_unique_url)"
    connection.add_argument("--url", metavar="URL", help=url_help)
    connection.add_argument("--redis", metavar="URL", help="another name for --url, kept from before it")
    connection.add_argument("--prefix", help="the prefix of the lock keys (default: $dramatiq_unique_prefix or ours)")
    # --json: the commands whose output is data (not the demo's timeline,
    # nor the dashboard, which serves a page).
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--json", action="store_true", help="print JSON on stdout instead of text")

    def command(name: str, run: Any, help: str, parents: Sequence[argparse.ArgumentParser] = (connection, data)) -> Any:
        sub = commands.add_parser(name, parents=list(parents), help=help)
        sub.set_defaults(run=run)
        return sub.add_argument

    option = command("demo", _demo, "run the serialize-per-resource scenario and print its timeline", ())
    option("--redis", metavar="URL", help="use a RedisBroker, and locks, at URL instead of memory")
    option("--url", metavar="URL", help="keep the locks at URL (redis://, postgresql://...) instead")
    option("--json", action=_Refused, reason="the demo prints a timeline for people to read, not JSON.")
    option = command("locks", _locks, "list the live locks, using SCAN")
    option("--actor", metavar="NAME", help="only the locks of this actor")
    option("--pattern", metavar="GLOB", help="only the keys matching this Redis glob, e.g. '*:sync_*:*'")
    option = command("inspect", _inspect, "show the locks of one digest and their holders")
    option("digest", metavar="DIGEST", help="the 32 hex characters inside the braces of a lock key")
    option = command("release", _release, "release a digest's locks, a holder, or an actor's")
    option("digest", metavar="DIGEST", nargs="?", help="release the locks of this digest")
    option("--holder", metavar="ID", help="release only this holder (message id or owner)")
    option("--phase", choices=PHASES, help="release only the enqueue or the run lock")
    option("--actor", metavar="NAME", help="release every lock of this actor (asks first)")
    queue_help = "release the enqueue locks of the messages published to this queue (asks first)"
    option("--queue", metavar="NAME", help=queue_help)
    option("--yes", action="store_true", help="do not ask before releasing an actor's or queue's locks")
    option = command("reap", _reap, "find (and with --yes release) enqueue locks whose message is in no queue")
    option("--dry-run", action="store_true", help="only list them (the default)")
    option("--yes", action="store_true", help="release them")
    option("--actor", metavar="NAME", help="only the locks of this actor")
    option("--broker-redis", metavar="URL", help="the Redis broker's Redis (default: the locks' Redis)")
    option("--min-age", type=int, default=None, metavar="MS", help="leave younger locks alone (default: 10000)")
    option("--batch", type=int, default=None, metavar="N", help="locks per broker lookup (default: 100)")
    dashboard_help = "serve the lock dashboard (password: $dramatiq_unique_dashboard_password; binds 127.0.0.1)"
    option = command("dashboard", _dashboard, dashboard_help, [connection])
    option("--host", default=DEFAULT_HOST, help=f"the address to listen on (default: {DEFAULT_HOST})")
    option("--port", type=int, default=DEFAULT_PORT, help=f"0: any free port (default: {DEFAULT_PORT})")
    allowed_help = "a host name the Host header may carry (repeat it); required when --host is not a loopback address"
    option("--allowed-host", action="append", metavar="NAME", help=allowed_help)
    json_reason = (
        "the dashboard serves a web page and prints no JSON (its address goes to stderr); "
        "for the locks as JSON run `dramatiq-unique locks --json`, or read the dashboard's /api/locks."
    )
    option("--json", action=_Refused, reason=json_reason)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; when its reader stops (``inspect D --json | head``), end quietly with
    :data:`CLOSED_PIPE_STATUS`, not a ``BrokenPipeError`` traceback.
    """
    try:
        try:
            args = parser().parse_args(argv)
            return int(args.run(args))
        except (CommandError, UniqueError) as e:
            # Backend failures, unknown digests and bad settings: one line, no traceback.
            print(f"dramatiq-unique: {e}", file=sys.stderr)
            return e.status if isinstance(e, CommandError) else 1
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:
        # What is left in the buffer goes nowhere when the interpreter flushes it at exit.
        with contextlib.suppress(OSError, ValueError):  # not a file (a StringIO): nothing to do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE_STATUS


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
