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
from typing import Any, Callable, NamedTuple, Union

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


Codec = Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


@functools.lru_cache(maxsize=None)
def _encoder(hint: Any) -> Codec:
    """The function that turns a value of type ``hint`` into JSON data;
    made once per type, from its hints.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        inner = _encoder(next(arg for arg in args if arg is not type(None)))
        return lambda value: None if value is None else inner(value)
    if dataclasses.is_dataclass(hint):
        return encode_dataclass
    if hint is bytes:
        return lambda value: base64.b64encode(value).decode()
    if origin is dict:
        item = _encoder(args[1])
        return lambda value: {key: item(element) for key, element in value.items()}
    if origin in (set, frozenset):
        item = _encoder(args[0])
        return lambda value: sorted(item(element) for element in value)
    if origin is list:
        item = _encoder(args[0])
        return lambda value: [item(element) for element in value]
    if origin is tuple:
        items = [_encoder(arg) for arg in args]
        return lambda value: [code(element) for element, code in zip(value, items)]
    if hint in (int, str, bool, float):
        return _same
    raise TypeError(f"cannot store a value of type {hint!r}")


@functools.lru_cache(maxsize=None)
def _decoder(hint: Any) -> Codec:
    """The function that turns JSON data back into a value of type
    ``hint``: the inverse of :func:`_encoder`.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        inner = _decoder(next(arg for arg in args if arg is not type(None)))
        return lambda data: None if data is None else inner(data)
    if dataclasses.is_dataclass(hint):
        return functools.partial(decode_dataclass, cls=hint)
    if hint is bytes:
        return base64.b64decode
    if origin is dict:
        item = _decoder(args[1])
        return lambda data: {key: item(element) for key, element in data.items()}
    if origin in (set, frozenset):
        item, kind = _decoder(args[0]), origin
        return lambda data: kind(item(element) for element in data)
    if origin is list:
        item = _decoder(args[0])
        return lambda data: [item(element) for element in data]
    if origin is tuple:
        items = [_decoder(arg) for arg in args]
        return lambda data: tuple(code(element) for element, code in zip(data, items))
    if hint in (int, str, bool, float):
        return hint  # type: ignore[no-any-return]
    raise TypeError(f"cannot load a value of type {hint!r}")


def _encode(value: Any, hint: Any) -> Any:
    return None if value is None else _encoder(hint)(value)


def _decode(data: Any, hint: Any) -> Any:
    return None if data is None else _decoder(hint)(data)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


@functools.lru_cache(maxsize=None)
def _layout(cls: Any) -> tuple[tuple[str, Any, Codec, Codec], ...]:
    """Each field of dataclass ``cls``: its name, its default (MISSING
    when it has none), its encoder and its decoder.
    """
    hints = _hints(cls)
    return tuple((field.name, _default(field), _encoder(hints[field.name]), _decoder(hints[field.name]))
                 for field in dataclasses.fields(cls))


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
    return cls(**{name: None if item is None else decoders[name](item)
                  for name, item in data.items() if name in decoders})


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
