"""The lock rules run on rows, each a key's :class:`~..keystate.KeyState`
in JSON: :func:`apply` loads the locked rows into a :class:`~..rules.LockRules`
at the server's clock, runs the verb, and says what to write back, so
the rules of the claim are the in-memory backend's.  The encoding follows
the type hints, so a new field is stored with no change here.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import typing
from typing import Any, Callable, NamedTuple, Optional, Sequence, TypeVar, Union

from .. import keystate as keystate_module
from ..keystate import KeyState
from ..rules import LockRules

T = TypeVar("T")

#: How long, in ms, a key holding nothing keeps its last fence before the
#: sweep deletes its row (a later fence grows from the server's microseconds).
DEFAULT_FENCE_MEMORY = 3_600_000

#: A row: key, state (JSON text), clock (server Unix microseconds, as text).
Row = Sequence[Optional[str]]

#: The fields of :class:`~..keystate.KeyState` but the records and fence.
_PARTS = ("entry", "waiters", "superseded")


@functools.lru_cache(maxsize=None)
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(keystate_module))


def _dataclass_of(hint: Any) -> Any:
    """The dataclass of a hint ``Optional[X]`` or ``dict[str, X]``."""
    return next(arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg))


Codec = Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


@functools.lru_cache(maxsize=None)
def _codec(hint: Any, store: bool) -> Codec:
    """The function that turns a ``hint`` value into JSON data (``store``) or
    back, made once per type and way; side by side, so each inverts the other.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        inner = _codec(next(arg for arg in args if arg is not type(None)), store)
        return lambda value: None if value is None else inner(value)
    if dataclasses.is_dataclass(hint):
        return encode_dataclass if store else functools.partial(decode_dataclass, cls=hint)
    if hint is bytes:
        return (lambda value: base64.b64encode(value).decode()) if store else base64.b64decode
    items = [_codec(arg, store) for arg in args]
    if origin is dict:
        return lambda value: {key: items[1](element) for key, element in value.items()}
    if origin in (set, frozenset):
        # Stored sorted, so that one state is always one text.
        gather = sorted if store else origin
        return lambda value: gather(items[0](element) for element in value)
    if origin is list:
        return lambda value: [items[0](element) for element in value]
    if origin is tuple:
        build = list if store else tuple
        return lambda value: build(code(element) for element, code in zip(value, items))
    if hint in (int, str, bool, float):
        return _same if store else hint
    raise TypeError(f"cannot {'store' if store else 'load'} a value of type {hint!r}")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


@functools.lru_cache(maxsize=None)
def _layout(cls: Any) -> tuple[tuple[str, Any, Codec, Codec], ...]:
    """Each field of dataclass ``cls``: name, default (or MISSING), encoder, decoder."""
    hints = _hints(cls)
    return tuple(
        (field.name, _default(field), _codec(hints[field.name], True), _codec(hints[field.name], False))
        for field in dataclasses.fields(cls)
    )


@functools.lru_cache(maxsize=None)
def _decoders(cls: Any) -> dict[str, Codec]:
    return {name: decode for name, _, _, decode in _layout(cls)}


def encode_dataclass(value: Any) -> dict[str, Any]:
    """A dataclass instance as a JSON object, its default fields left out."""
    encoded = {}
    for name, default, encode, _ in _layout(type(value)):  # type: ignore[arg-type]
        item = getattr(value, name)
        if item != default:
            encoded[name] = None if item is None else encode(item)
    return encoded


def decode_dataclass(data: dict[str, Any], cls: Any) -> Any:
    """The instance of dataclass ``cls`` that :func:`encode_dataclass` wrote."""
    decoders = _decoders(cls)
    return cls(
        **{name: None if item is None else decoders[name](item) for name, item in data.items() if name in decoders}
    )


class Dumped(NamedTuple):
    """One key's state, taken out of the rules.

    Attributes:
      state(dict): The JSON to store; only ``{"fence": n}`` for an empty key.
      expires_at(int): Its latest deadline, in server Unix ms; 0 for none.
    """

    state: dict[str, Any]
    expires_at: int


def last_fence(state: dict[str, Any]) -> int:
    return max(int(state.get("fence", 0)), int(state.get("entry", {}).get("fence", 0)))


def load(rules: LockRules, key: str, state: dict[str, Any]) -> None:
    hints = _hints(KeyState)
    parts = {
        part: decode_dataclass(state[part], _dataclass_of(hints[part])) if part in state else None for part in _PARTS
    }
    record = _dataclass_of(hints["records"])
    records = {message_id: decode_dataclass(data, record) for message_id, data in state.get("records", {}).items()}
    rules.load_key_state(key, KeyState(**parts, records=records, last_fence=last_fence(state)))


def dump(rules: LockRules, key: str, *, fence: int = 0) -> Dumped:
    """Take ``key``'s state out of ``rules``, keeping ``fence`` (its last known) when the entry is gone."""
    kept = rules.key_state(key)
    state: dict[str, Any] = {}
    deadlines = [0]
    for part in _PARTS:
        value = getattr(kept, part)
        if value is not None:
            state[part] = encode_dataclass(value)
            deadlines.append(getattr(value, "expires_at", 0))
    if kept.entry is not None:
        deadlines.extend(kept.entry.holders.values())
        fence = max(fence, kept.entry.fence)
    if kept.records:
        state["records"] = {message_id: encode_dataclass(record) for message_id, record in kept.records.items()}
        deadlines.extend(record.expires_at for record in kept.records.values())
    if fence:
        state["fence"] = fence
    return Dumped(state, max(deadlines) if len(state) > ("fence" in state) else 0)


class Applied(NamedTuple):
    """What a call did.

    Attributes:
      writes(list): :data:`.sql.WRITE`'s parameters for each changed row.
      deletes(list[str]): The keys whose rows, made for this call, hold
        nothing, not even a fence.
    """

    result: Any
    writes: list[list[str]]
    deletes: list[str]


def loaded(rows: Sequence[Row]) -> tuple[LockRules, dict[str, dict[str, Any]]]:
    """Rules holding ``rows`` at their latest clock (else this process's), and each row's state."""
    rules = LockRules(clock=max((int(row[2]) for row in rows if row[2] is not None), default=None))
    states = {}
    for key, text, _ in rows:
        if key is None or text is None:
            continue
        states[key] = json.loads(text)
        load(rules, key, states[key])
    return rules, states


def run(rows: Sequence[Row], verb: Callable[[LockRules], T]) -> T:
    """``verb``'s result on rules holding ``rows``: for reads, keeping no change."""
    return verb(loaded(rows)[0])


def apply(rows: Sequence[Row], verb: Callable[[LockRules], Any], *, fence_memory: int) -> Applied:
    """Run ``verb`` on rules holding the locked ``rows``; say what to write back."""
    rules, before = loaded(rows)
    result = verb(rules)
    writes, deletes = [], []
    for key, old in before.items():
        state, expires_at = dump(rules, key, fence=last_fence(old))
        if not state:
            deletes.append(key)
        elif state != old:
            assert rules.clock is not None
            expires_at = expires_at or rules.clock // 1000 + fence_memory
            writes.append([json.dumps(state), str(expires_at), key])
    return Applied(result, writes, deletes)
