"""What a lock is and what an actor's lock options mean: lock types and conflict strategies as data,
each actor's options, validated when it is declared, and the digest each message gets.

Each lock type is one row of :data:`LOCK_TYPES` (a queue lock at enqueue? a run lock around the
actor? when is the queue lock released?), which the middleware reads: no class per lock type.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Sequence, Union

from dramatiq.common import q_name
from dramatiq.logging import get_logger

from ..errors import ConfigurationError
from ..settings import MAX_DURATION, is_duration
from .wire import ANY_ACTOR, DIGEST_LENGTH, UNIQUE_ACROSS_ACTORS, UNIQUE_ACROSS_QUEUES, escape_actor

if TYPE_CHECKING:
    from dramatiq import Actor

#: When a queue lock is released: just before the actor runs, after it finished for good, or at expiry.
QueueRelease = Literal["run_start", "run_end", "expiry"]


@dataclass(frozen=True)
class LockType:
    """One row of the lock table."""

    name: str
    queue_lock: bool
    run_lock: bool
    queue_release: Optional[QueueRelease]

    @property
    def sides(self) -> tuple[str, ...]:
        """The conflict sides this lock type has."""
        return tuple(side for side, has in (("client", self.queue_lock), ("server", self.run_lock)) if has)


LOCK_TYPES: Mapping[str, LockType] = {
    lock.name: lock
    for lock in (
        LockType("until_executing", queue_lock=True, run_lock=False, queue_release="run_start"),
        LockType("until_executed", queue_lock=True, run_lock=False, queue_release="run_end"),
        LockType("until_expired", queue_lock=True, run_lock=False, queue_release="expiry"),
        LockType("while_executing", queue_lock=False, run_lock=True, queue_release=None),
        LockType("until_and_while_executing", queue_lock=True, run_lock=True, queue_release="run_start"),
    )
}

#: Valid strategies per side, the default first.  Client ``replace``: a new send supersedes the holder.
STRATEGIES: Mapping[str, tuple[str, ...]] = {
    "client": ("log", "raise", "replace"),
    "server": ("reschedule", "log", "raise", "reject"),
}

OnConflict = Union[str, Mapping[str, str]]


def lock_type(name: object) -> LockType:
    """Look a lock type up by name; an unknown one raises a ConfigurationError listing the valid names."""
    if not isinstance(name, str) or name not in LOCK_TYPES:
        raise ConfigurationError(f"lock={name!r} is not a lock type. Valid choices: {', '.join(LOCK_TYPES)}.")
    return LOCK_TYPES[name]


def strategies(lock: LockType, on_conflict: Optional[OnConflict]) -> dict[str, str]:
    """Resolve ``on_conflict`` into one strategy per side of ``lock``.

    A plain name applies to every side the lock type has, so must be valid on each, except
    ``"replace"`` (client only); a ``{"client": ..., "server": ...}`` mapping names sides explicitly.
    An unknown name or side raises a ConfigurationError listing the valid choices.
    """
    chosen = {side: STRATEGIES[side][0] for side in lock.sides}
    if on_conflict is None:
        return chosen
    if on_conflict == "replace" and not lock.queue_lock:
        raise ConfigurationError(
            f"on_conflict='replace' needs a lock type with an enqueue lock "
            f"({', '.join(n for n, t in LOCK_TYPES.items() if t.queue_lock)}), not lock={lock.name!r}."
        )
    if on_conflict == "replace":
        # Only the client side can replace; the server side keeps its default.
        given = {"client": "replace"}
    elif isinstance(on_conflict, str):
        given = {side: on_conflict for side in lock.sides}
    elif isinstance(on_conflict, Mapping):
        given = dict(on_conflict)
    else:
        raise ConfigurationError(
            f"on_conflict={on_conflict!r} is invalid: expected a strategy name or {{'client': ..., 'server': ...}}."
        )
    for side, name in given.items():
        if side not in lock.sides:
            raise ConfigurationError(
                f"on_conflict side {side!r} does not apply to lock={lock.name!r}. "
                f"Valid sides: {', '.join(lock.sides)}."
            )
        if name not in STRATEGIES[side]:
            raise ConfigurationError(
                f"on_conflict={name!r} is not a {side} strategy for lock={lock.name!r}. "
                f"Valid {side} choices: {', '.join(STRATEGIES[side])}"
                + (". Give one per side as {'client': ..., 'server': ...}." if len(lock.sides) > 1 else ".")
            )
        chosen[side] = name
    return chosen


#: The actor options this package declares.
ACTOR_OPTIONS = frozenset(
    {
        "lock",
        "on_conflict",
        "lock_args",
        "lock_args_method",
        "lock_ttl",
        "lock_limit",
        UNIQUE_ACROSS_QUEUES,
        UNIQUE_ACROSS_ACTORS,
        "reschedule_delay",
        "debounce",
        "debounce_max",
    }
)

#: The lock type ``debounce`` implies when the actor sets no ``lock``.
DEBOUNCE_LOCK = "until_executing"

#: Bumped whenever the digest's inputs change shape, so old and new digests never collide.
DIGEST_VERSION = 1

logger = get_logger(__name__)


@dataclass(frozen=True)
class ActorSpec:
    """The resolved lock options of one actor."""

    actor_name: str
    queue_name: str
    lock: LockType
    client: Optional[str]
    server: Optional[str]
    lock_args: Optional[tuple[str, ...]]
    lock_args_method: Optional[Callable[..., Any]]
    signature: Optional[inspect.Signature]
    lock_ttl: Optional[int]
    lock_limit: int
    across_queues: bool
    across_actors: bool
    reschedule_delay: Optional[int]
    debounce: Optional[int] = None
    debounce_max: Optional[int] = None

    @cached_property  # read for every lock key: worked out once
    def scope(self) -> str:
        """The clear-text actor part of this actor's lock keys."""
        if self.across_actors:
            return ANY_ACTOR
        return escape_actor(self.actor_name)

    def digest(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The digest of one send: a hash of actor name, queue name and canonical JSON of the lock args;
        a ConfigurationError when the arguments do not fit the signature, or the lock args are not JSON.
        """
        material = [
            DIGEST_VERSION,
            None if self.across_actors else self.actor_name,
            None if self.across_queues else q_name(self.queue_name),
            self.key_material(args, kwargs),
        ]
        text = self.canonical(material)
        digest = hashlib.sha256(text.encode()).hexdigest()[:DIGEST_LENGTH]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Digest %s of %s is made of %s.", digest, self.actor_name, text)
        return digest

    def key_material(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """The values the key is made of, before hashing."""
        if self.lock_args_method is not None:
            try:
                return self.lock_args_method(*args, **kwargs)
            except Exception as e:
                raise ConfigurationError(f"lock_args_method of actor {self.actor_name!r} failed: {e!r}") from e
        if self.signature is None:
            return [list(args), dict(kwargs)]
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ConfigurationError(f"Arguments do not match actor {self.actor_name!r}: {e}.") from None
        bound.apply_defaults()
        if self.lock_args is None:
            return dict(bound.arguments)
        return {name: bound.arguments[name] for name in self.lock_args}

    def canonical(self, material: Any) -> str:
        """Sorted-key, compact JSON that refuses anything JSON cannot round-trip exactly."""
        try:
            text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            _require_str_keys(material)
            text.encode()  # a lone surrogate is not text JSON carries exactly
            return text
        except Exception as e:
            # Anything, even from a custom container: Dramatiq swallows all but MiddlewareErrors, sending unlocked.
            raise ConfigurationError(
                f"Lock args of actor {self.actor_name!r} must be JSON-serialisable "
                f"(str, int, float, bool, None, lists and dicts with str keys): {e}."
            ) from None


def _require_str_keys(value: Any) -> None:
    """Raise TypeError for a non-str dict key: JSON makes ``1``, ``True``, ``None`` strings, merging distinct keys."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"dict key {key!r} is not a str")
            _require_str_keys(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _require_str_keys(item)


def _signature(fn: Callable[..., Any]) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _optional(options: Mapping[str, Any], name: str, check: Callable[[Any], bool], expected: str) -> Any:
    value = options.get(name)
    if value is not None and not check(value):
        raise ConfigurationError(f"{name}={value!r} is invalid: expected {expected}.")
    return value


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _duration(options: Mapping[str, Any], name: str, minimum: int) -> Optional[int]:
    """The option ``name``: None, or whole ms from ``minimum`` up to :data:`~..settings.MAX_DURATION`."""
    expected = "a positive whole number of milliseconds" if minimum else "a whole number of milliseconds, 0 or more"
    duration: Optional[int] = _optional(
        options, name, lambda v: is_duration(v, minimum), f"{expected}, at most {MAX_DURATION}"
    )
    return duration


def _lock_args(options: Mapping[str, Any], signature: Optional[inspect.Signature]) -> Optional[tuple[str, ...]]:
    names = options.get("lock_args")
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigurationError(f"lock_args={names!r} is invalid: expected a list of parameter names.")
    known = set(signature.parameters) if signature is not None else set()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigurationError(
            f"lock_args names {', '.join(map(repr, unknown))}, which the actor does not take. "
            f"Valid choices: {', '.join(sorted(known)) or 'none'}."
        )
    return tuple(names)


def actor_spec(actor: "Actor[Any, Any]") -> Optional[ActorSpec]:
    """Validate an actor's lock options: its :class:`ActorSpec`, or None when it takes no lock.  Any
    invalid option raises a ConfigurationError naming the actor and the valid choices.
    """
    try:
        return _actor_spec(actor)
    except ConfigurationError as e:
        raise ConfigurationError(f"Actor {actor.actor_name!r}: {e}") from None


def _actor_spec(actor: "Actor[Any, Any]") -> Optional[ActorSpec]:
    options = actor.options
    if options.get("lock") is None and options.get("debounce") is not None:
        options = {**options, "lock": DEBOUNCE_LOCK}
    if options.get("lock") is None:
        stray = sorted(ACTOR_OPTIONS & {k for k, v in options.items() if v is not None})
        if stray:
            raise ConfigurationError(f"it sets {', '.join(stray)} but no lock=.")
        return None
    lock = lock_type(options["lock"])
    sides = strategies(lock, _on_conflict(options, lock))
    debounce, debounce_max = _debounce(options)
    if sides.get("client") == "replace" and options.get("lock_limit") not in (None, 1):
        raise ConfigurationError(
            f"lock_limit={options['lock_limit']!r} does not go with on_conflict='replace': "
            "a replacing send supersedes the one holder of its key, so lock_limit must be 1."
        )
    signature = _signature(actor.fn)
    if options.get("lock_args") is not None and options.get("lock_args_method") is not None:
        raise ConfigurationError("Give either lock_args or lock_args_method, not both.")
    if options.get("reschedule_delay") is not None and sides.get("server") != "reschedule":
        raise ConfigurationError("reschedule_delay only applies with the server strategy 'reschedule'.")
    if options.get("lock_ttl") is not None and not lock.queue_lock:
        raise ConfigurationError(
            f"lock_ttl only applies to lock types with an enqueue lock, not lock={lock.name!r}: "
            "a run lock lives as long as its lease (dramatiq_unique_lease)."
        )
    is_bool = lambda v: isinstance(v, bool)  # noqa: E731
    return ActorSpec(
        actor_name=actor.actor_name,
        queue_name=actor.queue_name,
        lock=lock,
        client=sides.get("client"),
        server=sides.get("server"),
        lock_args=_lock_args(options, signature),
        lock_args_method=_optional(options, "lock_args_method", callable, "a callable"),
        signature=signature,
        lock_ttl=_duration(options, "lock_ttl", 1),
        lock_limit=_optional(options, "lock_limit", lambda v: _is_int(v, 1), "a whole number, 1 or more") or 1,
        across_queues=bool(_optional(options, UNIQUE_ACROSS_QUEUES, is_bool, "True or False")),
        across_actors=bool(_optional(options, UNIQUE_ACROSS_ACTORS, is_bool, "True or False")),
        reschedule_delay=_duration(options, "reschedule_delay", 0),
        debounce=debounce,
        debounce_max=debounce_max,
    )


def _on_conflict(options: Mapping[str, Any], lock: LockType) -> Any:
    """``on_conflict``, with the client ``replace`` that ``debounce`` implies (any other is an error)."""
    on_conflict = options.get("on_conflict")
    if options.get("debounce") is None:
        return on_conflict
    if not lock.queue_lock:
        raise ConfigurationError(
            f"debounce needs a lock type with an enqueue lock, not lock={lock.name!r}: "
            f"leave lock= out (debounce implies lock={DEBOUNCE_LOCK!r}) or use until_and_while_executing."
        )
    if on_conflict is None:
        return {"client": "replace"}
    if isinstance(on_conflict, str):
        if on_conflict != "replace":
            raise ConfigurationError(
                f"debounce works by replacing, so on_conflict={on_conflict!r} cannot go with it: "
                "leave it out, or give the server side alone, e.g. {'server': 'reschedule'}."
            )
        return on_conflict
    if isinstance(on_conflict, Mapping) and on_conflict.get("client", "replace") != "replace":
        raise ConfigurationError(
            f"debounce works by replacing, so the client strategy {on_conflict['client']!r} cannot go with it: "
            "leave the client side out."
        )
    if isinstance(on_conflict, Mapping):
        return {**on_conflict, "client": "replace"}
    return on_conflict  # not a name or a mapping: strategies() says why


def _debounce(options: Mapping[str, Any]) -> tuple[Optional[int], Optional[int]]:
    debounce, debounce_max = _duration(options, "debounce", 1), _duration(options, "debounce_max", 1)
    if debounce_max is not None and debounce is None:
        raise ConfigurationError("debounce_max only applies with debounce=.")
    if debounce_max is not None and debounce is not None and debounce_max < debounce:
        raise ConfigurationError(f"debounce_max={debounce_max} is shorter than debounce={debounce}.")
    return debounce, debounce_max
