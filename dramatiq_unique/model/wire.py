"""The wire format: every text the package writes for another process to read (a sender's lock read
by a worker, a worker's by an operator, an old release's by a new one).  Deployed keys and records
must stay readable, so nothing here changes shape without a migration; the Lua scripts in
``backends/redis/lua`` write the same texts, and ``tests/test_wire_format.py`` checks they agree.

* Lock keys ``<prefix>:<scope>:{<digest>}:<phase>`` (scope: the actor name, ``%{}():`` and a leading
  ``@`` written ``%XX``), and their companion keys.
* Lock owners: a message id (enqueue lock), or ``<message id>/<token>`` (run lock, one token per run).
* The message options this package stamps (``UNIQUE_*``).
* The enqueue record of a lock holder, and the place in it.

It imports nothing of the package: every side reads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional

# -- Lock keys -------------------------------------------------------------

#: The scope of the keys of actors with ``unique_across_actors``, instead of an actor name.
ANY_ACTOR = "@any"

#: The phases of a lock key: an enqueue lock (owned by a message id) and a run lock.
QUEUE = "queue"
RUN = "run"
PHASES = (QUEUE, RUN)

#: Hex characters in a digest (a truncated SHA-256).
DIGEST_LENGTH = 32

#: A lock key after its prefix and colon.  The scope holds no colon (escaped), so a key splits one
#: way only, whatever its prefix holds.
_KEY = re.compile(rf"(?P<scope>[^:]+):\{{(?P<digest>[0-9a-f]{{{DIGEST_LENGTH}}})\}}:(?P<phase>queue|run)")
_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_LENGTH}}}")
_GLOB_SPECIALS = re.compile(r"[*?\[\]\\]")

#: A run lock key's companions (see the ``*_key`` functions): its waiters (zset of message ids by send
#: order), their encoded bodies (hash), and each message's record of its copies (hash, ``<key>:m:<message id>``).
WAIT_SUFFIX = ":wait"
BODIES_SUFFIX = ":bodies"
MESSAGE_SUFFIX = ":m:"

#: An enqueue lock key's companion under ``on_conflict="replace"``: the messages its sends superseded.
SUPERSEDED_SUFFIX = ":superseded"


class LockKey(NamedTuple):
    """A lock key, in its parts: ``scope`` is the actor name as :func:`escape_actor` writes it (``@any``
    across actors), ``digest`` the 32 hex characters inside the Cluster hash tag, and ``phase``
    :data:`QUEUE` or :data:`RUN`.
    """

    prefix: str
    scope: str
    digest: str
    phase: str

    @property
    def actor(self) -> Optional[str]:
        """The actor name the scope names (:func:`scope_actor`)."""
        return scope_actor(self.scope)


#: What :func:`escape_actor` writes as ``%XX`` (upper-case hex): the escape itself, the hash tag's
#: braces, the parentheses the old format wrote braces as (so its keys read as old), the colon between
#: a key's parts, and a leading ``@`` (so no actor's scope is :data:`ANY_ACTOR`).
_ESCAPED = re.compile(r"[%{}():]|^@")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")


def escape_actor(actor: str) -> str:
    """The scope of ``actor``'s keys: the name, with the characters a key's syntax gives a meaning
    written ``%XX``.  Different names get different scopes; common names are written unchanged.
    """
    return _ESCAPED.sub(lambda found: f"%{ord(found[0]):02X}", actor)


def actor_scope(actor: str) -> str:
    """The scope an operator's actor filter names: :data:`ANY_ACTOR` itself, else the actor's scope."""
    return ANY_ACTOR if actor == ANY_ACTOR else escape_actor(actor)


def scope_actor(scope: str) -> Optional[str]:
    """The actor name a scope names (:data:`ANY_ACTOR` for itself); None for a scope that
    :func:`escape_actor` does not write: an old-format one for a name holding ``{}()%`` or a leading
    ``@``, which may name either of two actors.
    """
    if scope == ANY_ACTOR:
        return ANY_ACTOR
    actor = _ESCAPE.sub(lambda found: chr(int(found[1], 16)), scope)
    return actor if escape_actor(actor) == scope else None


def lock_key(*, prefix: str, scope: str, digest: str, phase: str) -> str:
    """Prefix, actor in clear text, and the digest in a Cluster hash tag (so a lock's keys share a slot)."""
    return f"{prefix}:{scope}:{{{digest}}}:{phase}"


def parse_lock_key(key: str, *, prefix: str) -> Optional[LockKey]:
    """The parts of a lock key under ``prefix``; None for any other key (companion, bad digest, ...)."""
    if not key.startswith(f"{prefix}:"):
        return None
    found = _KEY.fullmatch(key, len(prefix) + 1)
    if found is None:
        return None
    return LockKey(prefix, found["scope"], found["digest"], found["phase"])


def digest_in(text: str) -> Optional[str]:
    """The digest ``text`` names: a digest itself, or a lock key under any prefix; else None."""
    text = text.strip()
    if _DIGEST.fullmatch(text):
        return text
    found = _KEY.search(text)
    return found["digest"] if found else None


def _wildcard(text: str) -> str:
    """``text`` as a glob, each special character matching any one character: Redis and ``fnmatch``
    escape differently, so matches are re-checked with :func:`parse_lock_key`.
    """
    return _GLOB_SPECIALS.sub("?", text)


def lock_key_glob(
    *, prefix: str, scope: Optional[str] = None, digest: Optional[str] = None, phase: Optional[str] = None
) -> str:
    """A ``SCAN`` glob for lock keys under ``prefix``; it may match companion keys too: parse matches."""
    tail = f"{{{digest}}}:*" if digest else "*"
    return f"{_wildcard(prefix)}:{_wildcard(scope) if scope else '*'}:{tail}{f':{phase}' if phase else ''}"


def waiters_key(key: str) -> str:
    return f"{key}{WAIT_SUFFIX}"


def bodies_key(key: str) -> str:
    return f"{key}{BODIES_SUFFIX}"


def message_key(key: str, message_id: str) -> str:
    return f"{key}{MESSAGE_SUFFIX}{message_id}"


def superseded_key(key: str) -> str:
    return f"{key}{SUPERSEDED_SUFFIX}"


def check_key(prefix: str) -> str:
    """The key a liveness check reads: under the prefix, never a lock."""
    return f"{prefix}:!check"


def reaper_key(prefix: str) -> str:
    """The lock that one reaper pass at a time holds."""
    return f"{prefix}:!reaper"


# -- Lock owners -----------------------------------------------------------

#: Between the message id and the token of a run lock owner.
OWNER_SEPARATOR = "/"


class Owner(NamedTuple):
    """A lock owner, in its parts: ``token`` is the execution's (a run lock), None for an enqueue lock."""

    message_id: str
    token: Optional[str] = None


def join_owner(message_id: str, token: Optional[str] = None) -> str:
    """A slot's owner string: the message id, then ``/token`` for a run lock.  An id holding ``/`` does
    not split back (the Lua scripts, too, read the id up to the first ``/``).
    """
    return message_id if token is None else f"{message_id}{OWNER_SEPARATOR}{token}"


def split_owner(owner: str) -> Owner:
    message_id, separator, token = owner.partition(OWNER_SEPARATOR)
    return Owner(message_id, token if separator else None)


def message_id_of(owner: Optional[str]) -> Optional[str]:
    """The message id in a lock owner; None for no owner (or "")."""
    return owner.partition(OWNER_SEPARATOR)[0] if owner else None


# -- Message options -------------------------------------------------------

#: The lock digest, stamped at send; a message carrying it is a re-enqueue, never refused.
UNIQUE_DIGEST = "unique_digest"

#: The send's place among its producer's sends of the same millisecond.
UNIQUE_SEQ = "unique_seq"

#: The lock args JSON, stamped at send under ``record_lock_args`` only.
UNIQUE_LOCK_ARGS = "unique_lock_args"

#: How many times the message was rescheduled: 0 (absent) for the original.
UNIQUE_RESCHEDULES = "unique_reschedules"

#: Which copy of a reschedule this is: ``delay``, ``handoff`` or ``retry``.
UNIQUE_VIA = "unique_via"

#: How many times a delivery waited for the run lock's holder to finish.
UNIQUE_WAITS = "unique_waits"

#: On a refused send's returned copy: the owner whose lock refused it.
UNIQUE_DUPLICATE_OF = "unique_duplicate_of"

#: On a replacing send: the message it superseded.
UNIQUE_REPLACED = "unique_replaced"

#: The actor option: one key across every queue the actor is sent to.
UNIQUE_ACROSS_QUEUES = "unique_across_queues"

#: The actor option: one key across every actor that sets it.
UNIQUE_ACROSS_ACTORS = "unique_across_actors"

#: The message options above, which the package stamps and reads.
MESSAGE_OPTIONS = frozenset(
    {
        UNIQUE_DIGEST,
        UNIQUE_SEQ,
        UNIQUE_LOCK_ARGS,
        UNIQUE_RESCHEDULES,
        UNIQUE_VIA,
        UNIQUE_WAITS,
        UNIQUE_DUPLICATE_OF,
        UNIQUE_REPLACED,
    }
)

#: The most a count option may say: far beyond what any real message reaches.
MAX_COUNT = 1_000_000
_DIGEST = re.compile(f"[0-9a-f]{{{DIGEST_LENGTH}}}")


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT  # bool is an int, and no count


#: What each option a delivery reads must be (a check, its wording): a message may be hand-made.
OPTION_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    UNIQUE_DIGEST: (lambda v: isinstance(v, str) and bool(_DIGEST.fullmatch(v)), f"{DIGEST_LENGTH} hex digits"),
    UNIQUE_SEQ: (_count, f"an int from 0 to {MAX_COUNT}"),
    UNIQUE_LOCK_ARGS: (lambda v: isinstance(v, str) and len(v) <= 65_536, "a string of at most 64 KiB"),
    UNIQUE_RESCHEDULES: (_count, f"an int from 0 to {MAX_COUNT}"),
    UNIQUE_VIA: (lambda v: v in ("", "delay", "handoff", "retry"), "'delay', 'handoff' or 'retry'"),
    UNIQUE_WAITS: (_count, f"an int from 0 to {MAX_COUNT}"),
}


def malformed_options(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The options that this package would not have stamped so: each name and what it must be."""
    return [
        (name, must) for name, (check, must) in OPTION_CHECKS.items() if name in options and not check(options[name])
    ]


# -- Enqueue records -------------------------------------------------------

#: Starts the lock hash's fields other than its holders' (owner string -> deadline in ms).
META_MARK = "!"

#: The meta fields: lock type, lock args JSON (when recorded), last fencing token, newest send
#: (under replace), and how many sends were superseded.
LOCK_FIELD = "!lock"
ARGS_FIELD = "!args"
FENCE_FIELD = "!fence"
CURRENT_FIELD = "!current"
SUPERSEDED_FIELD = "!superseded"


def record_field(owner: str) -> str:
    """The lock hash field holding ``owner``'s :class:`EnqueueRecord`."""
    return f"!m:{owner}"


def join_place(namespace: str, queue: str, redis_id: str) -> str:
    """A :class:`Place` as an :class:`EnqueueRecord` writes it."""
    return f"{namespace}\t{queue}\t{redis_id}"


def _canonical_queue(queue: str) -> str:
    return queue[:-3] if queue.endswith(".DQ") else queue


@dataclass(frozen=True)
class Place:
    """Where a message was published: ``namespace\tqueue\tredis_message_id`` (only the queue off Redis)."""

    namespace: str
    queue: str
    redis_id: str

    @classmethod
    def parse(cls, where: str) -> Optional["Place"]:
        """The place in a record's ``where``; None when none can be looked up (other broker, none)."""
        parts = where.split("\t")
        if len(parts) != 3 or not parts[0] or not parts[2]:
            return None
        return cls(*parts)

    @staticmethod
    def queue_in(where: str) -> str:
        """The queue a ``where`` names, on any broker, without a delay queue's ``.DQ``; "" if none."""
        parts = where.split("\t")
        return _canonical_queue(parts[1]) if len(parts) == 3 else ""

    @property
    def canonical_queue(self) -> str:
        return _canonical_queue(self.queue)


@dataclass(frozen=True)
class EnqueueRecord:
    """What an enqueue lock records about its holder, for operators and the reaper.

    Stored in the lock hash, field ``!m:<owner>``, as ``<taken_at>|<provisional_until>|<where>\\n<before>``:
    two decimal integers (Unix ms, no sign or fraction: Lua writes ``%.0f``), then ``where`` up to the
    newline and ``before`` after it (a place holds no newline).  ``_take.lua`` writes it (a run lock's
    slot ``<taken>|0|\\n``), ``replace.lua`` writes it confirmed, ``confirm.lua`` zeroes the second
    number, and ``reap.lua`` compares it whole to :meth:`encode`'s text.

    Attributes:
      taken_at(int): When the slot was taken, in Unix milliseconds.
      provisional_until(int): Until its publish is confirmed, the Unix ms when the slot lapses; then 0.
      where(str): Where the message was last published, or "".
      before(str): Where it was published before, or "": mid-move it is at one of the two.
    """

    taken_at: int
    provisional_until: int = 0
    where: str = ""
    before: str = ""

    def encode(self) -> str:
        return f"{self.taken_at}|{self.provisional_until}|{self.where}\n{self.before}"

    @classmethod
    def decode(cls, text: str) -> Optional["EnqueueRecord"]:
        """Parse stored text; None when it is not a record."""
        try:
            taken, provisional, places = text.split("|", 2)
            where, _, before = places.partition("\n")
            return cls(int(taken), int(provisional), where, before)
        except ValueError:
            return None

    @property
    def queue(self) -> str:
        """The queue ``where`` names, without a delay queue's ``.DQ``; "" if none."""
        return Place.queue_in(self.where)
