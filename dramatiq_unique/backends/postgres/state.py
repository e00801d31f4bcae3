"""The state :class:`~..stub.StubBackend` keeps of one key, as JSON.

``PostgresBackend`` stores one row per key: everything the stub's
dictionaries hold under that key (the lock entry, its waiters, its
superseded record, the records of its messages) and the last fence the
key handed out.  :func:`load` puts a row's state into a stub made for
one call, and :func:`dump` takes it out again after the stub's own
method ran on it, so the rules of the claim are the stub's.

The encoding follows each dataclass's type hints: so a field added to
one of the stub's dataclasses is stored with no change here.  Fields at
their default value are left out; bytes are base64 text, sets sorted
lists, tuples lists.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import typing
from typing import Any, NamedTuple, Union

from .. import stub as stub_module
from ..stub import KeyState, StubBackend

#: The parts of a row's state that are the stub's dataclasses: the
#: fields of :class:`~..stub.KeyState` other than the records and fence.
_PARTS = ("entry", "waiters", "superseded")


@functools.lru_cache(maxsize=None)
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(stub_module))


def _dataclass_of(hint: Any) -> Any:
    """The dataclass of a hint ``Optional[X]`` or ``dict[str, X]``."""
    return next(arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg))


def _encode(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin is Union:
        return _encode(value, next(arg for arg in args if arg is not type(None)))
    if dataclasses.is_dataclass(hint):
        return encode_dataclass(value)
    if hint is bytes:
        return base64.b64encode(value).decode()
    if origin is dict:
        return {key: _encode(item, args[1]) for key, item in value.items()}
    if origin in (set, frozenset):
        return sorted(_encode(item, args[0]) for item in value)
    if origin is list:
        return [_encode(item, args[0]) for item in value]
    if origin is tuple:
        return [_encode(item, arg) for item, arg in zip(value, args)]
    if hint in (int, str, bool, float):
        return value
    raise TypeError(f"cannot store a value of type {hint!r}")


def _decode(data: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if data is None:
        return None
    if origin is Union:
        return _decode(data, next(arg for arg in args if arg is not type(None)))
    if dataclasses.is_dataclass(hint):
        return decode_dataclass(data, hint)
    if hint is bytes:
        return base64.b64decode(data)
    if origin is dict:
        return {key: _decode(item, args[1]) for key, item in data.items()}
    if origin in (set, frozenset):
        return origin(_decode(item, args[0]) for item in data)
    if origin is list:
        return [_decode(item, args[0]) for item in data]
    if origin is tuple:
        return tuple(_decode(item, arg) for item, arg in zip(data, args))
    if hint in (int, str, bool, float):
        return hint(data)
    raise TypeError(f"cannot load a value of type {hint!r}")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def encode_dataclass(value: Any) -> dict[str, Any]:
    """A dataclass instance as a JSON object, its default fields left out."""
    hints = _hints(type(value))  # type: ignore[arg-type]
    encoded = {}
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        if item != _default(field):
            encoded[field.name] = _encode(item, hints[field.name])
    return encoded


def decode_dataclass(data: dict[str, Any], cls: Any) -> Any:
    """The instance of dataclass ``cls`` that :func:`encode_dataclass` wrote."""
    hints = _hints(cls)
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: _decode(item, hints[name]) for name, item in data.items() if name in names})


class Dumped(NamedTuple):
    """One key's state, taken out of a stub.

    Attributes:
      state(dict): The JSON object to store; ``{"fence": n}`` alone when
        the key holds nothing.
      expires_at(int): The latest deadline in it, in server Unix
        milliseconds; 0 when it holds nothing.
    """

    state: dict[str, Any]
    expires_at: int


def last_fence(state: dict[str, Any]) -> int:
    """The last fence handed out for the key of ``state``."""
    return max(int(state.get("fence", 0)), int(state.get("entry", {}).get("fence", 0)))


def load(stub: StubBackend, key: str, state: dict[str, Any]) -> None:
    """Put a row's ``state`` of ``key`` into ``stub``."""
    hints = _hints(KeyState)
    parts = {part: decode_dataclass(state[part], _dataclass_of(hints[part])) if part in state else None
             for part in _PARTS}
    record = _dataclass_of(hints["records"])
    records = {message_id: decode_dataclass(data, record) for message_id, data in state.get("records", {}).items()}
    stub.load_key_state(key, KeyState(**parts, records=records, last_fence=last_fence(state)))


def dump(stub: StubBackend, key: str, *, fence: int = 0) -> Dumped:
    """Take the state of ``key`` out of ``stub``, with ``fence`` the last
    fence of the key known before (kept when the entry is gone).
    """
    kept = stub.key_state(key)
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
