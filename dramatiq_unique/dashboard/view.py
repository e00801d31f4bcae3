"""The dashboard page's filters, totals and lock table, rendered on the server as HTML fragments from
the dicts of :meth:`Lock.as_dict`.

The first response holds them (a page without its script shows the locks, never "Loading"), and the
script asks ``api/view`` for the same fragments on each refresh: this is the one renderer, and all
lock data goes through :func:`html.escape`.  A field a lock lacks (on older data) shows ``?``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import astuple, dataclass
from datetime import datetime, timezone
from html import escape
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence
from urllib.parse import urlencode

#: The sortable columns: name -> (header, first-click direction: oldest, most held, most waiting first).
SORTS = {
    "actor": ("Actor", "asc"),
    "lock": ("Lock", "asc"),
    "age": ("Age", "desc"),
    "expires": ("Expires", "asc"),
    "holders": ("Holders", "desc"),
    "waiting": ("Waiting", "desc"),
}
DEFAULT_SORT = "age"
#: The URL parameters of :class:`Query`'s fields, in their order.
PARAMS = ("actor", "type", "q", "pattern", "sort", "dir")
#: Per actor and per lock type, the totals list at most this many rows.
TOP = 8


@dataclass(frozen=True)
class Query:
    """The page's state, as its URL carries it."""

    actor: str = ""
    lock_type: str = ""
    text: str = ""
    pattern: str = ""
    sort: str = DEFAULT_SORT
    direction: str = "desc"

    @classmethod
    def parse(cls, query: Mapping[str, list[str]]) -> "Query":
        actor, lock_type, text, pattern, sort, direction = ((query.get(name) or [""])[0].strip() for name in PARAMS)
        sort = sort if sort in SORTS else DEFAULT_SORT
        return cls(actor, lock_type, text, pattern, sort, direction if direction in ("asc", "desc") else SORTS[sort][1])

    def href(self, **changes: str) -> str:
        """A link to the page with ``changes``, naming only the parameters that differ from the defaults."""
        values = {**dict(zip(PARAMS, astuple(self))), **changes}
        if values["sort"] == DEFAULT_SORT and values["dir"] == SORTS[DEFAULT_SORT][1]:
            values["sort"] = values["dir"] = ""
        params = {name: value for name, value in values.items() if value}
        return "?" + urlencode(params) if params else "./"


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _items(lock: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    """The lock's ``holders`` or ``waiting`` that are dicts."""
    return [item for item in lock.get(name) or () if isinstance(item, Mapping)]


def _earliest(lock: Mapping[str, Any], field: str) -> Optional[int]:
    """The earliest ``field`` (Unix ms) of the lock's holders; None when none has it."""
    return min((t for t in (_int(h.get(field)) for h in _items(lock, "holders")) if t is not None), default=None)


def taken_at(lock: Mapping[str, Any]) -> Optional[int]:
    """When the lock was taken (Unix ms): its own ``taken_at``, else its oldest holder's, else None."""
    own = _int(lock.get("taken_at"))
    return own if own is not None else _earliest(lock, "taken_at")


def lock_type(lock: Mapping[str, Any]) -> str:
    return str(lock.get("lock") or "?")


def actor_of(lock: Mapping[str, Any]) -> str:
    return str(lock.get("actor") or "?")


def _searchable(lock: Mapping[str, Any]) -> str:
    parts = [str(lock.get(name) or "") for name in ("key", "digest", "actor", "lock")]
    parts.append(json.dumps(lock.get("lock_args"), sort_keys=True))
    parts.extend(str(h.get(name) or "") for h in _items(lock, "holders") for name in ("owner", "message_id"))
    parts.extend(str(w.get("message_id") or "") for w in _items(lock, "waiting"))
    return "\n".join(parts).lower()


def matches(lock: Mapping[str, Any], query: Query) -> bool:
    """Whether a lock passes the filters that the scan does not apply."""
    if query.actor and lock.get("actor") != query.actor:
        return False
    if query.lock_type and lock_type(lock) != query.lock_type:
        return False
    return not query.text or query.text.lower() in _searchable(lock)


def sort_locks(locks: Iterable[Mapping[str, Any]], query: Query, now: int) -> list[Mapping[str, Any]]:
    """The locks in the query's order; those without the value come last either way, ties by key."""
    value: Callable[[Mapping[str, Any]], Any] = {
        "actor": lambda lock: str(lock.get("actor") or ""),
        "lock": lambda lock: (lock_type(lock), str(lock.get("phase") or "")),
        "age": lambda lock: None if (taken := taken_at(lock)) is None else now - taken,
        "holders": lambda lock: len(_items(lock, "holders")),
        "expires": lambda lock: None if (deadline := _earliest(lock, "deadline")) is None else deadline - now,
        "waiting": lambda lock: len(_items(lock, "waiting")),
    }[query.sort]
    by_key = sorted(locks, key=lambda lock: str(lock.get("key") or ""))
    known = sorted((lock for lock in by_key if value(lock) is not None), key=value, reverse=query.direction == "desc")
    return known + [lock for lock in by_key if value(lock) is None]


def duration(ms: float) -> str:
    """As the page's script writes it: ``4.2 s``, ``3 min 05 s``..."""
    seconds = max(0.0, ms) / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60):02d} s"
    hours = minutes // 60
    if hours < 48:
        return f"{hours} h {minutes % 60:02d} min"
    return f"{hours // 24} d {hours % 24} h"


def remaining(ms: float) -> str:
    return "expired" if ms <= 0 else duration(ms)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def clock(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%H:%M:%S UTC")


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _muted(text: str, title: str = "") -> str:
    return f'<span class="muted" title="{title}">{text}</span>' if title else f'<span class="muted">{text}</span>'


def _clip(tag: str, text: str, css: str = "clip", inner: str = "") -> str:
    """``text`` ellipsized on one line, the whole of it in its tooltip."""
    return f'<{tag} class="{css}" title="{_e(text)}">{inner or _e(text)}</{tag}>'


COPY_ICON = (
    '<svg viewBox="0 0 16 16" aria-hidden="true"><rect x="5.5" y="5.5" width="8" height="8" rx="1.5"/>'
    '<path d="M10.5 3.5v-.5a1.5 1.5 0 0 0-1.5-1.5H4A1.5 1.5 0 0 0 2.5 3v5A1.5 1.5 0 0 0 4 9.5h.5"/></svg>'
)


def copyable(text: str, what: str, css: str) -> str:
    """One identifier on one line, with a button that copies it."""
    button = f'<button type="button" class="copy" data-copy="{_e(text)}" title="Copy {what}" aria-label="Copy {what}">'
    return f'<span class="ident">{_clip("code", text, f"clip {css}")}{button}{COPY_ICON}</button></span>'


def _timed(css: str, data: str, verb: str, ms: int, text: str) -> str:
    """A time that the page's script keeps counting from ``data``; its date in the tooltip."""
    return f'<span class="{css}" {data} title="{verb} {iso(ms)}">{text}</span>'


def since(taken: Optional[int], now: int, css: str, prefix: str = "") -> str:
    if taken is None:
        return f'<span class="{css} unknown" title="not recorded">{_e(prefix)}?</span>'
    data = f'data-taken="{taken}" data-prefix="{_e(prefix)}"'
    return _timed(css, data, "taken", taken, f"{_e(prefix)}{duration(now - taken)}")


def countdown(deadline: Optional[int], now: int) -> str:
    if deadline is None:
        return _muted("\u2014", "no holder")
    css = "remaining expired" if deadline <= now else "remaining"
    return _timed(css, f'data-deadline="{deadline}"', "expires", deadline, remaining(deadline - now))


def lock_args_html(args: Any) -> str:
    if args is None:
        return _muted("not recorded")
    if isinstance(args, dict):
        entries = [(str(name), value) for name, value in args.items()]
    elif isinstance(args, list):
        entries = [(f"#{i + 1}", value) for i, value in enumerate(args)]
    else:
        return _clip("code", json.dumps(args))
    if not entries:
        return _muted("none")
    items = []
    for name, value in entries:
        text = json.dumps(value)
        inner = f'<span class="name">{_e(name)}: </span><code>{_e(text)}</code>'
        items.append(_clip("li", f"{name}: {text}", inner=inner))
    return '<ul class="args">' + "".join(items) + "</ul>"


def holder_html(lock: Mapping[str, Any], holder: Mapping[str, Any], now: int) -> str:
    owner = str(holder.get("owner") or "")
    message_id = str(holder.get("message_id") or owner)
    meta = [countdown(_int(holder.get("deadline")), now)]
    if _int(holder.get("taken_at")) is not None or lock.get("phase") == "queue":
        meta.append(since(_int(holder.get("taken_at")), now, "age", "age "))
    if holder.get("provisional"):
        title = "lapses at its deadline unless its publish is confirmed"
        meta.append(f'<span class="badge provisional" title="{title}">provisional</span>')
    if lock.get("current") == message_id:
        superseded = _e(lock.get("superseded") or 0)
        title = "the newest send, the one that runs"
        meta.append(f'<span class="badge current" title="{title}">current, superseded {superseded}</span>')
    place = holder.get("queue")
    if isinstance(place, str) and place:
        meta.append(f'<span class="place clip" title="published to {_e(place)}">{_e(place)}</span>')
    release = f'<button type="button" class="action release-holder" data-owner="{_e(owner)}">Release holder</button>'
    return (
        f'<li class="holder" data-owner="{_e(owner)}">{copyable(message_id, "message id", "message-id")}'
        f'<div class="meta">{"".join(meta)}</div><div class="holder-actions">{release}</div></li>'
    )


def waiting_html(lock: Mapping[str, Any], now: int) -> str:
    if lock.get("phase") != "run":
        return _muted("\u2014", "only run locks have a waiting line")
    items = []
    for waiter in _items(lock, "waiting"):
        message_id, sent = str(waiter.get("message_id") or ""), _int(waiter.get("since"))
        waited = "" if sent is None else _timed("waited", f'data-since="{sent}"', "sent", sent, duration(now - sent))
        ident = copyable(message_id, "message id", "message-id")
        items.append(f'<li class="waiter" data-message-id="{_e(message_id)}">{ident}{waited}</li>')
    return '<ul class="waiting">' + "".join(items) + "</ul>" if items else _muted("none")


def row_html(lock: Mapping[str, Any], now: int) -> str:
    key, digest, phase = (str(lock.get(name) or "") for name in ("key", "digest", "phase"))
    actor, kind = actor_of(lock), lock_type(lock)
    holders = _items(lock, "holders")
    holders_list = "".join(holder_html(lock, holder, now) for holder in holders)
    count = f'<div class="count">{len(holders)} holders</div>' if len(holders) > 1 else ""
    return (
        f'<tr class="lock" data-key="{_e(key)}" data-digest="{_e(digest)}" data-phase="{_e(phase)}">'
        f'<td class="c-actor">{_clip("div", actor, "clip actor-name")}{copyable(digest, "digest", "digest")}</td>'
        f'<td class="c-lock type">{_clip("span", kind, "clip lock-name")}'
        f'<span class="badge phase phase-{_e(phase)}">{_e(phase)}</span></td>'
        f'<td class="c-args args">{lock_args_html(lock.get("lock_args"))}</td>'
        f'<td class="c-age">{since(taken_at(lock), now, "lock-age")}</td>'
        f'<td class="c-expires">{countdown(_earliest(lock, "deadline"), now)}</td>'
        f'<td class="c-holders">{count}<ul class="holders">{holders_list}</ul></td>'
        f'<td class="c-waiting">{waiting_html(lock, now)}</td>'
        f'<td class="c-actions"><button type="button" class="action danger release-lock">Release lock</button></td>'
        "</tr>"
    )


def thead_html(query: Query) -> str:
    cells = []
    ascending = query.direction == "asc"
    for name, (title, first) in SORTS.items():
        active = query.sort == name
        direction = ("desc" if ascending else "asc") if active else first
        aria = f' aria-sort="{"ascending" if ascending else "descending"}"' if active else ""
        arrow = ("\u25b2" if ascending else "\u25bc") if active else "\u2195"
        cells.append(
            f'<th scope="col" class="c-{name}{" sorted" if active else ""}"{aria}>'
            f'<a class="sort" href="{_e(query.href(sort=name, dir=direction))}" data-sort="{name}" '
            f'data-dir="{direction}" title="Sort by {title.lower()}">{title}'
            f'<span class="arrow" aria-hidden="true">{arrow}</span></a></th>'
        )
        if name == "lock":
            cells.append('<th scope="col" class="c-args">Lock args</th>')
    cells.append('<th scope="col" class="c-actions">Actions</th>')
    return "<tr>" + "".join(cells) + "</tr>"


def _card(label: str, value: str, note: str = "") -> str:
    note_html = f'<div class="note">{note}</div>' if note else ""
    return f'<div class="card "><div class="label">{label}</div><div class="value">{value}</div>{note_html}</div>'


#: The totals' panels: the URL parameter that filters on a name -> (title, the name of a lock).
PANELS: dict[str, tuple[str, Callable[[Mapping[str, Any]], str]]] = {
    "actor": ("Per actor", actor_of),
    "type": ("Per lock type", lock_type),
}


def _breakdown(param: str, locks: Sequence[Mapping[str, Any]], query: Query) -> str:
    """The locks and holders per name of the ``param`` panel."""
    title, name_of = PANELS[param]
    counts, holders = Counter[str](), Counter[str]()
    for lock in locks:
        counts[name_of(lock)] += 1
        holders[name_of(lock)] += len(_items(lock, "holders"))
    most = max(counts.values(), default=0)
    selected = query.actor if param == "actor" else query.lock_type
    rows = []
    for name, n in counts.most_common(TOP):
        # (the page's policy forbids inline styles: a class per tenth)
        tenth = round(10 * n / most) if most else 0
        rows.append(
            f'<li class="{"active" if selected == name else ""}"><a class="facet clip" '
            f'href="{_e(query.href(**{param: name}))}" data-param="{param}" data-value="{_e(name)}" '
            f'title="Show only {_e(name)}">{_e(name)}</a><span class="bar"><span class="fill w{tenth}"></span></span>'
            f'<span class="n" title="locks">{n}</span><span class="n muted" title="holders">{holders[name]}</span></li>'
        )
    more = len(counts) - TOP
    more_html = f'<li class="more muted">and {plural(more, "more")}</li>' if more > 0 else ""
    body = "".join(rows) + more_html if rows else '<li class="muted">none</li>'
    return (
        f'<section class="panel" data-totals="{param}"><h2>{title}<span class="cols">'
        f'<span>locks</span><span>holders</span></span></h2><ul class="breakdown">{body}</ul></section>'
    )


def summary_html(locks: Sequence[Mapping[str, Any]], query: Query, now: int) -> str:
    """The totals of the listed (filtered) locks: cards, then per actor and per lock type."""
    holders = sum(len(_items(lock, "holders")) for lock in locks)
    waiting = sum(len(_items(lock, "waiting")) for lock in locks)
    runs = sum(1 for lock in locks if lock.get("phase") == "run")
    dated = [(taken, lock) for lock in locks if (taken := taken_at(lock)) is not None]
    oldest_at, oldest = min(dated, key=lambda pair: pair[0], default=(None, None))
    soonest = min((d for d in (_earliest(lock, "deadline") for lock in locks) if d is not None), default=None)
    oldest_note = _e(oldest.get("actor") or "") if oldest is not None else ""
    if len(locks) > len(dated):
        oldest_note = " \u00b7 ".join(filter(None, [oldest_note, f"{len(locks) - len(dated)} not recorded"]))
    cards = [
        _card("Locks", f'<span id="total-locks">{len(locks)}</span>', f"{runs} run \u00b7 {len(locks) - runs} queue"),
        _card("Holders", f'<span id="total-holders">{holders}</span>'),
        _card("Waiting", f'<span id="total-waiting">{waiting}</span>', "messages in run-lock lines"),
        _card("Oldest", since(oldest_at, now, "lock-age") if oldest_at is not None else "\u2014", oldest_note),
        _card("Next expiry", countdown(soonest, now) if soonest is not None else "\u2014"),
    ]
    panels = "".join(_breakdown(param, locks, query) for param in PANELS)
    return f'<div class="cards">{"".join(cards)}</div><div class="panels">{panels}</div>'


def options_html(values: Iterable[str], selected: str, everything: str) -> str:
    names = sorted(set(values) | ({selected} if selected else set()))
    options = [f'<option value=""{"" if selected else " selected"}>{everything}</option>']
    options.extend(
        f'<option value="{_e(name)}"{" selected" if name == selected else ""}>{_e(name)}</option>' for name in names
    )
    return "".join(options)


#: A listing: the listed locks (filtered, sorted); every lock scanned (for the filters' choices); whether
#: it was cut at the limit; and when it was made, in Unix ms.
Listing = tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]], bool, int]


def fragments(listing: Listing, query: Query, prefix: str, limit: int) -> dict[str, str]:
    """Every part of the page that changes with the data or the query."""
    locks, seen, truncated, now = listing
    filtered = bool(query.actor or query.lock_type or query.text or query.pattern)
    empty = "No lock matches the filters." if filtered else "No locks are held."
    rows = "".join(row_html(lock, now) for lock in locks) or f'<tr class="empty"><td colspan="8">{empty}</td></tr>'
    order = f"sorted by {SORTS[query.sort][0].lower()}, {'ascending' if query.direction == 'asc' else 'descending'}"
    cut = f" (the first {limit}: narrow the filters to see the rest)" if truncated else ""
    return {
        "summary": summary_html(locks, query, now),
        "thead": thead_html(query),
        "rows": rows,
        "status": f"{plural(len(locks), 'lock')}{cut} under prefix <code>{_e(prefix)}</code>, {order}.",
        "actors": options_html(map(actor_of, seen), query.actor, "All actors"),
        "types": options_html((lock_type(lock) for lock in seen), query.lock_type, "All lock types"),
        "refreshed": clock(now),
    }


def page_html(template: str, parts: Mapping[str, str], query: Query, now: int, *, error: str = "") -> str:
    """The page with the fragments and the query's values in place."""
    values = {"now": str(now), "error": _e(error), "error_hidden": "" if error else " hidden", "q": _e(query.text)}
    values.update(pattern=_e(query.pattern), sort=_e(query.sort), dir=_e(query.direction), **parts)
    for name, value in values.items():
        template = template.replace("{{" + name + "}}", value)
    return template
