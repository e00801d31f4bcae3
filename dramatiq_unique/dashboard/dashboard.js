// The lock dashboard's page: lists locks from api/locks, counts their
// deadlines down, and releases through api/release after a
// confirmation.  URLs are relative so the app can be mounted anywhere.
"use strict";

(function () {
  const REFRESH_MS = 5000;
  const TICK_MS = 250;
  // The release endpoint refuses requests without this header, which
  // other sites' pages cannot send (see dashboard/app.py).
  const CSRF_HEADER = "X-Dramatiq-Unique";

  // The server's clock at the last listing, and when it arrived by
  // this page's monotonic clock: countdowns ignore the browser's clock.
  const clock = { now: 0, fetchedAt: 0 };
  let pending = null;

  const $ = (id) => document.getElementById(id);

  function serverNow() {
    return clock.now + (performance.now() - clock.fetchedAt);
  }

  function formatRemaining(ms) {
    return ms <= 0 ? "expired" : formatDuration(ms);
  }

  function formatDuration(ms) {
    const seconds = Math.max(0, ms) / 1000;
    if (seconds < 60) return seconds.toFixed(1) + " s";
    const minutes = Math.floor(seconds / 60);
    const pad = (n) => String(n).padStart(2, "0");
    if (minutes < 60) return minutes + " min " + pad(Math.floor(seconds % 60)) + " s";
    const hours = Math.floor(minutes / 60);
    if (hours < 48) return hours + " h " + pad(minutes % 60) + " min";
    return Math.floor(hours / 24) + " d " + (hours % 24) + " h";
  }

  // Builds an element; every piece of lock data goes in as text, never HTML.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    Object.assign(node, props || {});
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function show(id, text) {
    $(id).textContent = text || "";
    $(id).hidden = !text;
  }

  function filters() {
    const query = new URLSearchParams();
    for (const name of ["actor", "pattern"]) {
      const value = $(name).value.trim();
      if (value) query.set(name, value);
    }
    return query;
  }

  async function load() {
    const query = filters();
    history.replaceState(null, "", query.toString() ? "?" + query : location.pathname);
    try {
      const response = await fetch("api/locks?" + query, { headers: { Accept: "application/json" } });
      const data = await response.json();
      if (!response.ok) throw new Error(data.error || response.statusText);
      clock.now = data.now;
      clock.fetchedAt = performance.now();
      render(data);
      show("error", "");
    } catch (error) {
      show("error", "Could not list the locks: " + error.message);
    }
  }

  function render(data) {
    const rows = data.locks.map(lockRow);
    if (!rows.length) rows.push(el("tr", {}, el("td", { colSpan: 7, className: "empty" }, "No locks.")));
    document.querySelector("#locks tbody").replaceChildren(...rows);
    const count = data.locks.length + (data.locks.length === 1 ? " lock" : " locks");
    const shown = data.truncated ? " (showing the first " + data.limit + ")" : "";
    show("status", count + shown + " under prefix " + data.prefix + ".");
    tick();
  }

  // A long identifier may break after each underscore.
  function breakable(text) {
    const parts = String(text).split("_");
    return el("span", {}, ...parts.flatMap((part, i) => (i ? ["_", document.createElement("wbr"), part] : [part])));
  }

  // The lock args as "name: value" lines; values stay JSON.
  function lockArgs(args) {
    if (args === null) return el("span", { className: "muted" }, "not recorded");
    if (typeof args !== "object") return el("code", {}, JSON.stringify(args));
    const entries = Array.isArray(args) ? args.map((value, i) => ["#" + (i + 1), value]) : Object.entries(args);
    if (!entries.length) return el("span", { className: "muted" }, "none");
    return el("ul", { className: "args" }, ...entries.map(([name, value]) =>
      el("li", {}, el("span", { className: "name" }, name + ": "), el("code", {}, JSON.stringify(value)))));
  }

  function waitingList(lock) {
    if (lock.phase !== "run") return el("span", { className: "muted", title: "only run locks have a waiting line" }, "\u2014");
    if (!lock.waiting.length) return el("span", { className: "muted" }, "none");
    return el("ul", { className: "waiting" }, ...lock.waiting.map((waiter) => {
      const waited = el("span", { className: "waited", title: "sent " + new Date(waiter.since).toISOString() });
      waited.dataset.since = waiter.since;
      const item = el("li", { className: "waiter" }, el("code", {}, waiter.message_id), waited);
      item.dataset.messageId = waiter.message_id;
      return item;
    }));
  }

  function lockRow(lock) {
    const release = el("button", { type: "button", className: "danger small" }, "Release lock");
    release.addEventListener("click", () =>
      confirmRelease({ digest: lock.digest, phase: lock.phase }, "Release the " + lock.phase + " lock " + lock.key +
        " and all its " + lock.holders.length + " holder(s)?"));
    const row = el(
      "tr", { className: "lock" },
      el("td", { className: "actor" }, el("div", {}, breakable(lock.actor)),
        el("code", { className: "digest", title: "digest" }, lock.digest)),
      el("td", {}, lock.phase),
      el("td", { className: "type" }, breakable(lock.lock || "?")),
      el("td", { className: "args" }, lockArgs(lock.lock_args)),
      el("td", {}, el("ul", { className: "holders" }, ...lock.holders.map((holder) => holderItem(lock, holder)))),
      el("td", {}, waitingList(lock)),
      el("td", {}, release),
    );
    row.dataset.key = lock.key;
    return row;
  }

  function holderItem(lock, holder) {
    const remaining = el("span", { className: "remaining", title: new Date(holder.deadline).toISOString() });
    remaining.dataset.deadline = holder.deadline;
    const release = el("button", { type: "button", className: "small" }, "Release holder");
    release.addEventListener("click", () =>
      confirmRelease({ digest: lock.digest, phase: lock.phase, holder: holder.owner },
        "Release holder " + holder.owner + " of the " + lock.phase + " lock " + lock.key + "?"));
    const parts = [el("code", { title: holder.owner }, holder.message_id)];
    if (lock.current !== null && lock.current === holder.message_id) {
      // replace / debounce: the newest send, the one that runs
      parts.push(el("span", { className: "current" }, "current, superseded " + lock.superseded));
    }
    const when = [remaining];
    if (holder.taken_at !== null && holder.taken_at !== undefined) {
      // An enqueue lock: how long ago it was taken, and whether its
      // publish is still unconfirmed (it then lapses at its deadline).
      const age = el("span", { className: "age", title: "taken " + new Date(holder.taken_at).toISOString() });
      age.dataset.taken = holder.taken_at;
      when.push(age);
      if (holder.provisional) {
        when.push(el("span", { className: "provisional", title: "lapses at its deadline unless its publish is confirmed" },
          "provisional"));
      }
    }
    const item = el("li", { className: "holder" }, ...parts, el("span", { className: "when" }, ...when, release));
    item.dataset.owner = holder.owner;
    return item;
  }

  function tick() {
    for (const span of document.querySelectorAll(".remaining")) {
      const left = Number(span.dataset.deadline) - serverNow();
      span.textContent = formatRemaining(left);
      span.classList.toggle("expired", left <= 0);
    }
    for (const span of document.querySelectorAll(".waited")) {
      span.textContent = formatDuration(serverNow() - Number(span.dataset.since));
    }
    for (const span of document.querySelectorAll(".age")) {
      span.textContent = "age " + formatDuration(serverNow() - Number(span.dataset.taken));
    }
  }

  function confirmRelease(request, text) {
    pending = request;
    $("confirm-text").textContent = text;
    $("confirm").showModal();
  }

  async function release(request) {
    try {
      const response = await fetch("api/release", {
        method: "POST",
        headers: { "Content-Type": "application/json", [CSRF_HEADER]: "1" },
        body: JSON.stringify(request),
      });
      const data = await response.json();
      if (!response.ok) throw new Error(data.error || response.statusText);
      show("notice", "Released " + data.released.join(", ") + ".");
      show("error", "");
    } catch (error) {
      show("notice", "");
      show("error", "Could not release: " + error.message);
    }
    await load();
  }

  function init() {
    const query = new URLSearchParams(location.search);
    $("actor").value = query.get("actor") || "";
    $("pattern").value = query.get("pattern") || "";
    $("filters").addEventListener("submit", (event) => {
      event.preventDefault();
      load();
    });
    $("refresh").addEventListener("click", load);
    $("confirm-cancel").addEventListener("click", () => $("confirm").close());
    $("confirm-release").addEventListener("click", () => {
      const request = pending;
      $("confirm").close();
      if (request) release(request);
    });
    $("confirm").addEventListener("close", () => { pending = null; });
    setInterval(tick, TICK_MS);
    // No refresh while a confirmation is open: its row must stay put.
    setInterval(() => { if (!$("confirm").open) load(); }, REFRESH_MS);
    load();
  }

  init();
})();
