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
from typing import Any, NamedTuple, Optional, Union

from .. import stub as stub_module
from ..stub import StubBackend

#: The state a row holds, by top-level name: the attribute of
#: StubBackend that keeps it by key, and its dataclass (``records`` is
#: kept by key and message id).
_PARTS = {
    "entry": ("_entries", stub_module._Entry),
    "waiters": ("_waiters", stub_module._Waiters),
    "superseded": ("_superseded", stub_module._Superseded),
}

#: The StubBackend attributes this module stores; a test checks that the
#: stub keeps no other state.
STORED_ATTRIBUTES = frozenset({"_mutex", "_last_fence", "_records", *(name for name, _ in _PARTS.values())})


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(stub_module))


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
    if origin is set:
        return sorted(_encode(item, args[0]) for item in value)
    if origin is tuple:
        return [_encode(item, arg) for item, arg in zip(value, args)]
    if hint in (int, str, bool):
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
    if origin is set:
        return {_decode(item, args[0]) for item in data}
    if origin is tuple:
        return tuple(_decode(item, arg) for item, arg in zip(data, args))
    if hint in (int, str, bool):
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
    hints = _hints(type(value))
    encoded = {}
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        if item != _default(field):
            encoded[field.name] = _encode(item, hints[field.name])
    return encoded


def decode_dataclass(data: dict[str, Any], cls: type) -> Any:
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
    for part, (attribute, cls) in _PARTS.items():
        if part in state:
            getattr(stub, attribute)[key] = decode_dataclass(state[part], cls)
    for message_id, record in state.get("records", {}).items():
        stub._records[(key, message_id)] = decode_dataclass(record, stub_module._Record)
    stub._last_fence = max(stub._last_fence, last_fence(state))


def dump(stub: StubBackend, key: str, *, fence: int = 0) -> Dumped:
    """Take the state of ``key`` out of ``stub``, with ``fence`` the last
    fence of the key known before (kept when the entry is gone).
    """
    state: dict[str, Any] = {}
    deadlines = [0]
    entry: Optional[stub_module._Entry] = stub._entries.get(key)
    for part, (attribute, _) in _PARTS.items():
        value = getattr(stub, attribute).get(key)
        if value is not None:
            state[part] = encode_dataclass(value)
            deadlines.append(getattr(value, "expires_at", 0))
    if entry is not None:
        deadlines.extend(entry.holders.values())
        fence = max(fence, entry.fence)
    records = {message_id: record for (owner, message_id), record in stub._records.items() if owner == key}
    if records:
        state["records"] = {message_id: encode_dataclass(record) for message_id, record in records.items()}
        deadlines.extend(record.expires_at for record in records.values())
    if fence:
        state["fence"] = fence
    return Dumped(state, max(deadlines) if len(state) > ("fence" in state) else 0)
