"""The ``dramatiq-unique`` command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .errors import UniqueError

if TYPE_CHECKING:
    from .admin import Lock, LockAdmin


class CommandError(Exception):
    """Ends the command with a one-line message on stderr."""

    def __init__(self, message: str, *, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args.redis)


# Lock administration ----------------------------------------------


def _admin(args: argparse.Namespace) -> "LockAdmin":
    """Connect to the locks named by ``--redis`` and ``--prefix``, or by
    the ``dramatiq_unique_*`` environment variables, and check that the
    backend answers.
    """
    from .admin import LockAdmin
    from .settings import from_environment

    settings = from_environment()
    url = args.redis or settings.redis_url
    if url is None:
        raise CommandError("no Redis to read locks from: give --redis URL or set dramatiq_unique_redis_url.")
    try:
        from .backends.redis import RedisBackend
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "redis":
            raise
        raise CommandError(
            "the lock commands need redis-py, which comes with the redis extra: "
            "run `pip install 'dramatiq-unique[redis]'`."
        ) from None
    try:
        backend = RedisBackend(url=url, socket_connect_timeout=5, socket_timeout=30)
    except Exception as e:
        raise CommandError(f"cannot connect to {url}: {' '.join(str(e).split())}") from None
    admin = LockAdmin(backend, prefix=args.prefix or settings.prefix)
    admin.check()
    return admin


def _remaining(deadline: int) -> str:
    seconds = (deadline - time.time() * 1000) / 1000
    return _duration(seconds) if seconds > 0 else "expired"


def _ago(since: int) -> str:
    return _duration(max(0.0, (time.time() * 1000 - since) / 1000))


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60):02d} s"
    hours = minutes // 60
    return f"{hours} h {minutes % 60:02d} min" if hours < 48 else f"{hours // 24} d {hours % 24} h"


def _timestamp(deadline: int) -> str:
    return datetime.fromtimestamp(deadline / 1000, tz=timezone.utc).isoformat(timespec="seconds")


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def _print_table(rows: list[list[str]], headers: list[str]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    for row in [headers, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _row(lock: "Lock") -> list[str]:
    soonest = _remaining(lock.holders[0].deadline)
    waiting = str(len(lock.waiting)) if lock.phase == "run" else "-"
    return [lock.actor, lock.digest, lock.phase, lock.lock or "?", str(len(lock.holders)), soonest, waiting]


def _locks(args: argparse.Namespace) -> int:
    admin = _admin(args)
    locks = list(admin.locks(actor=args.actor, pattern=args.pattern))
    if args.json:
        _print_json([lock.as_dict() for lock in locks])
        return 0
    if not locks:
        print(f"No locks under prefix {admin.prefix!r}.")
        return 0
    headers = ["ACTOR", "DIGEST", "PHASE", "LOCK", "HOLDERS", "NEXT EXPIRY", "WAITING"]
    _print_table([_row(lock) for lock in locks], headers)
    print(f"{len(locks)} lock{'s' if len(locks) != 1 else ''} under prefix {admin.prefix!r}.")
    return 0


def _print_lock(lock: "Lock") -> None:
    print(f"key        {lock.key}")
    print(f"actor      {lock.actor}")
    print(f"digest     {lock.digest}")
    print(f"phase      {lock.phase}")
    print(f"lock       {lock.lock or '?'}")
    print(f"fence      {lock.fence}")
    print(f"lock args  {lock.lock_args if lock.lock_args is not None else '(not recorded)'}")
    if lock.current is not None:
        print(f"current    {lock.current}  (superseded {lock.superseded})")
    print(f"holders    {len(lock.holders)}")
    for holder in lock.holders:
        print(f"  message {holder.message_id}  owner {holder.owner}")
        print(f"    expires {_timestamp(holder.deadline)} (in {_remaining(holder.deadline)})")
    if lock.phase == "run":
        print(f"waiting    {len(lock.waiting)}")
        for waiter in lock.waiting:
            print(f"  message {waiter.message_id}  sent {_timestamp(waiter.order)} ({_ago(waiter.order)} ago)")


def _inspect(args: argparse.Namespace) -> int:
    locks = _admin(args).inspect(args.digest)
    if args.json:
        _print_json([lock.as_dict() for lock in locks])
        return 0
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
    if (args.digest is None) == (args.actor is None):
        raise CommandError("release takes either a DIGEST or --actor NAME.", status=2)
    if args.actor is not None and (args.holder or args.phase):
        raise CommandError("--holder and --phase apply to a DIGEST, not to --actor.", status=2)
    admin = _admin(args)
    if args.actor is not None:
        return _release_actor(admin, args)
    released = admin.release(args.digest, holder=args.holder, phase=args.phase)
    if not released:
        raise CommandError("nothing was released: the holder's slot had expired or been taken meanwhile.")
    if args.json:
        _print_json({"released": released})
        return 0
    for item in released:
        key, _, owner = item.partition(" ")
        print(f"Released holder {owner} of {key}." if owner else f"Released {key}.")
    return 0


def _release_actor(admin: "LockAdmin", args: argparse.Namespace) -> int:
    count = sum(1 for _ in admin.locks(actor=args.actor))
    question = f"Release {count} lock{'s' if count != 1 else ''} of actor {args.actor!r}?"
    if count and not args.yes and not _confirm(question):
        raise CommandError("aborted: nothing was released.")
    released = admin.release_actor(args.actor) if count else []
    if args.json:
        _print_json({"released": released})
    else:
        print(f"Released {len(released)} lock{'s' if len(released) != 1 else ''} of actor {args.actor!r}.")
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from .dashboard import Dashboard
    from .dashboard.server import LOOPBACK_HOSTS, is_loopback, make_server

    admin = _admin(args)
    allowed_hosts = LOOPBACK_HOSTS | {args.host} if is_loopback(args.host) else None
    try:
        server = make_server(Dashboard(admin, allowed_hosts=allowed_hosts), host=args.host, port=args.port)
    except OSError as e:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{server.server_port}/"
    if args.json:
        _print_json({"url": url, "prefix": admin.prefix})
    print(f"Serving the locks under prefix {admin.prefix!r} at {url}", file=sys.stderr)
    print("The dashboard has no authentication: anyone who reaches it can release locks.", file=sys.stderr, flush=True)
    with server:
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


def _connection_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--redis", metavar="URL", help="the Redis of the locks (default: $dramatiq_unique_redis_url)")
    options.add_argument("--prefix", help="the prefix of the lock keys (default: $dramatiq_unique_prefix or ours)")
    options.add_argument("--json", action="store_true", help="print JSON instead of text")
    return options


def _add_admin_commands(commands: Any) -> None:
    from .dashboard.server import DEFAULT_HOST, DEFAULT_PORT

    common = [_connection_options()]
    locks = commands.add_parser("locks", parents=common, help="list the live locks, using SCAN")
    locks.add_argument("--actor", metavar="NAME", help="only the locks of this actor")
    locks.add_argument("--pattern", metavar="GLOB", help="only the keys matching this Redis glob, e.g. '*:sync_*:*'")
    locks.set_defaults(run=_locks)
    inspect = commands.add_parser("inspect", parents=common, help="show the locks of one digest and their holders")
    inspect.add_argument("digest", metavar="DIGEST", help="the 32 hex characters inside the braces of a lock key")
    inspect.set_defaults(run=_inspect)
    release = commands.add_parser("release", parents=common, help="release a digest's locks, a holder, or an actor's")
    release.add_argument("digest", metavar="DIGEST", nargs="?", help="release the locks of this digest")
    release.add_argument("--holder", metavar="ID", help="release only this holder (message id or owner)")
    release.add_argument("--phase", choices=("queue", "run"), help="release only the enqueue or the run lock")
    release.add_argument("--actor", metavar="NAME", help="release every lock of this actor (asks first)")
    release.add_argument("--yes", action="store_true", help="do not ask before releasing an actor's locks")
    release.set_defaults(run=_release)
    dashboard = commands.add_parser(
        "dashboard", parents=common, help="serve the lock dashboard (no authentication: binds 127.0.0.1 by default)"
    )
    dashboard.add_argument("--host", default=DEFAULT_HOST, help=f"the address to listen on (default: {DEFAULT_HOST})")
    dashboard.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"0: any free port (default: {DEFAULT_PORT})")
    dashboard.set_defaults(run=_dashboard)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dramatiq-unique", description="Unique jobs and per-key locks for Dramatiq.")
    commands = top.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the serialize-per-resource scenario and print its timeline")
    demo.add_argument("--redis", metavar="URL", help="use a RedisBroker and RedisBackend at URL instead of memory")
    demo.set_defaults(run=_demo)
    _add_admin_commands(commands)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.run(args))
    except CommandError as e:
        print(f"dramatiq-unique: {e}", file=sys.stderr)
        return e.status
    except UniqueError as e:
        # Backend failures, unknown digests and bad settings: one line, no traceback.
        print(f"dramatiq-unique: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
