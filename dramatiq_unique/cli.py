"""The ``dramatiq-unique`` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args.redis)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dramatiq-unique", description="Unique jobs and per-key locks for Dramatiq.")
    commands = top.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the serialize-per-resource scenario and print its timeline")
    demo.add_argument("--redis", metavar="URL", help="use a RedisBroker and RedisBackend at URL instead of memory")
    demo.set_defaults(run=_demo)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
