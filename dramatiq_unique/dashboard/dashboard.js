// The lock dashboard's page.  The server renders the totals and the
// lock table (the first response already holds them); this script
// takes over: it asks api/view for the same fragments on each refresh,
// sort or filter, counts deadlines and ages on, and releases through
// api/release after a confirmation.  URLs are relative so the app can
// be mounted anywhere.
"use strict";

(function () {
  const REFRESH_MS = 5000;
  const TICK_MS = 250;
  const SEARCH_DELAY_MS = 250;
  // The release endpoint refuses requests without this header, which
  // other sites' pages cannot send (see dashboard/app.py).
  const CSRF_HEADER = "X-Dramatiq-Unique";
  // The page's URL without the user:password@ a link may carry, which
  // fetch() refuses; the browser still sends the password it was given.
  const api = (path) => new URL(path, location.origin + location.pathname);

  // The server's clock at the last listing, and when it arrived by
  // this page's monotonic clock: countdowns ignore the browser's clock.
  const clock = { now: Number(document.body.dataset.now) || Date.now(), fetchedAt: performance.now() };
  const state = { sort: document.body.dataset.sort, dir: document.body.dataset.dir, paused: false };
  let pending = null;
  let loading = null;

  const $ = (id) => document.getElementById(id);

  function serverNow() {
    return clock.now + (performance.now() - clock.fetchedAt);
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

  function show(id, text) {
    $(id).textContent = text || "";
    $(id).hidden = !text;
  }

  // The query of the page's state, without its defaults.
  function query() {
    const params = new URLSearchParams();
    for (const name of ["actor", "type", "q", "pattern"]) {
      const value = $(name).value.trim();
      if (value) params.set(name, value);
    }
    if (state.sort && !(state.sort === "age" && state.dir === "desc")) {
      params.set("sort", state.sort);
      params.set("dir", state.dir);
    }
    return params;
  }

  function load() {
    // One listing at a time; a change meanwhile asks again after it.
    if (loading) {
      loading.again = true;
      return loading.promise;
    }
    const current = { again: false };
    current.promise = fetchView().finally(() => {
      loading = null;
      if (current.again) load();
    });
    loading = current;
    return current.promise;
  }

  async function fetchView() {
    const params = query();
    history.replaceState(null, "", params.toString() ? "?" + params : location.pathname);
    try {
      const response = await fetch(api("api/view?" + params), { headers: { Accept: "application/json" } });
      const data = await response.json();
      if (!response.ok) throw new Error(data.error || response.statusText);
      clock.now = data.now;
      clock.fetchedAt = performance.now();
      render(data.html);
      show("error", "");
    } catch (error) {
      show("error", "Could not list the locks: " + error.message);
    }
  }

  function render(html) {
    $("summary").innerHTML = html.summary;
    document.querySelector("#locks thead").innerHTML = html.thead;
    document.querySelector("#locks tbody").innerHTML = html.rows;
    $("status").innerHTML = html.status;
    setOptions($("actor"), html.actors);
    setOptions($("type"), html.types);
    const refreshed = $("refreshed");
    refreshed.textContent = new Date(clock.now).toLocaleTimeString();
    refreshed.dateTime = new Date(clock.now).toISOString();
    tick();
  }

  function setOptions(select, html) {
    const value = select.value;
    select.innerHTML = html;
    select.value = value;
  }

  function tick() {
    const now = serverNow();
    for (const span of document.querySelectorAll("[data-deadline]")) {
      const left = Number(span.dataset.deadline) - now;
      span.textContent = left <= 0 ? "expired" : formatDuration(left);
      span.classList.toggle("expired", left <= 0);
    }
    for (const span of document.querySelectorAll("[data-taken]")) {
      span.textContent = (span.dataset.prefix || "") + formatDuration(now - Number(span.dataset.taken));
    }
    for (const span of document.querySelectorAll("[data-since]")) {
      span.textContent = formatDuration(now - Number(span.dataset.since));
    }
  }

  function setPaused(paused) {
    state.paused = paused;
    $("pause").textContent = paused ? "Resume" : "Pause";
    $("pause").setAttribute("aria-pressed", String(paused));
    $("live").dataset.state = paused ? "paused" : "live";
    $("refresh-state").textContent = paused ? "Auto-refresh paused" : "Auto-refresh every 5 s";
    if (!paused) load();
  }

  function confirmRelease(request, text) {
    pending = request;
    $("confirm-text").textContent = text;
    $("confirm").showModal();
  }

  async function release(request) {
    try {
      const response = await fetch(api("api/release"), {
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

  async function copy(button) {
    const text = button.dataset.copy;
    try {
      await navigator.clipboard.writeText(text);
    } catch (error) {
      // No clipboard API (a page not served from a secure origin).
      const area = document.createElement("textarea");
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    button.classList.add("copied");
    setTimeout(() => button.classList.remove("copied"), 1200);
  }

  function onClick(event) {
    const target = event.target.closest("a.sort, a.facet, button.copy, button.release-lock, button.release-holder");
    if (!target) return;
    const row = target.closest("tr.lock");
    if (target.matches("a.sort")) {
      event.preventDefault();
      state.sort = target.dataset.sort;
      state.dir = target.dataset.dir;
      load();
    } else if (target.matches("a.facet")) {
      event.preventDefault();
      const select = $(target.dataset.param);
      // A second click on the same name clears its filter.
      select.value = select.value === target.dataset.value ? "" : target.dataset.value;
      load();
    } else if (target.matches("button.copy")) {
      copy(target);
    } else if (target.matches("button.release-lock")) {
      const holders = row.querySelectorAll("li.holder").length;
      confirmRelease({ digest: row.dataset.digest, phase: row.dataset.phase },
        "Release the " + row.dataset.phase + " lock " + row.dataset.key + " and its " + holders +
        (holders === 1 ? " holder?" : " holders?"));
    } else {
      confirmRelease({ digest: row.dataset.digest, phase: row.dataset.phase, holder: target.dataset.owner },
        "Release holder " + target.dataset.owner + " of the " + row.dataset.phase + " lock " + row.dataset.key + "?");
    }
  }

  function init() {
    document.addEventListener("click", onClick);
    $("filters").addEventListener("submit", (event) => {
      event.preventDefault();
      load();
    });
    for (const id of ["actor", "type"]) $(id).addEventListener("change", load);
    let typing = null;
    $("q").addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(load, SEARCH_DELAY_MS);
    });
    $("clear").addEventListener("click", () => {
      for (const id of ["actor", "type", "q", "pattern"]) $(id).value = "";
      load();
    });
    $("refresh").addEventListener("click", load);
    $("pause").addEventListener("click", () => setPaused(!state.paused));
    $("confirm-cancel").addEventListener("click", () => $("confirm").close());
    $("confirm-release").addEventListener("click", () => {
      const request = pending;
      $("confirm").close();
      if (request) release(request);
    });
    $("confirm").addEventListener("close", () => { pending = null; });
    $("refreshed").textContent = new Date(clock.now).toLocaleTimeString();
    setInterval(tick, TICK_MS);
    // No refresh while paused or while a confirmation is open: its row must stay put.
    setInterval(() => { if (!state.paused && !$("confirm").open) load(); }, REFRESH_MS);
    tick();
  }

  init();
})();
