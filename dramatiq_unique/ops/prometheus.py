"""Prometheus metrics of dramatiq-unique, exposed along Dramatiq's own (docs/operations.md,
"Prometheus metrics").

``prometheus_client`` picks in-process or multiprocess values on first import, which must follow
Dramatiq's ``Prometheus`` middleware setting up its directory: so it is imported at the first event.
The gauge's ``livesum`` mode drops out a process that has shut down.
"""

from __future__ import annotations

import importlib.util
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

from ..events import LockEvent

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge

    from ..middleware import UniqueMiddleware

#: The metrics, as ``(name, type, labels, meaning)``; a counter's samples carry a ``_total`` suffix.
METRICS = (
    ("dramatiq_unique_lock_events", "counter", ("actor_name", "event"), "lock events, by actor and event name"),
    ("dramatiq_unique_leases_held", "gauge", ("actor_name",), "run locks (leases) this process holds now"),
)

_by_registry: "weakref.WeakKeyDictionary[Any, tuple[Counter, Gauge]]" = weakref.WeakKeyDictionary()
_by_registry_mutex = threading.Lock()


def _metrics(registry: Optional["CollectorRegistry"]) -> tuple["Counter", "Gauge"]:
    """The metrics on ``registry``, made once per registry so a process's middlewares share them."""
    import prometheus_client as prom  # here, never at import: see the module docstring

    target = prom.REGISTRY if registry is None else registry
    with _by_registry_mutex:
        if target not in _by_registry:
            (events, _, event_labels, event_help), (leases, _, lease_labels, lease_help) = METRICS
            _by_registry[target] = (
                prom.Counter(events, event_help, event_labels, registry=target),
                prom.Gauge(leases, lease_help, lease_labels, registry=target, multiprocess_mode="livesum"),
            )
        return _by_registry[target]


class LockMetrics:
    """Counts the lock events of a :class:`UniqueMiddleware`, and gauges its process's run leases.

    Parameters:
      middleware(UniqueMiddleware): The middleware to observe (this subscribes to its events).
      registry(prometheus_client.CollectorRegistry): Where to register the metrics; defaults to
        ``prometheus_client.REGISTRY``.

    Raises:
      ImportError: when ``prometheus_client`` is not installed.
    """

    def __init__(self, middleware: "UniqueMiddleware", *, registry: Optional["CollectorRegistry"] = None) -> None:
        if importlib.util.find_spec("prometheus_client") is None:
            raise ImportError("LockMetrics needs prometheus_client. Run `pip install dramatiq-unique[prometheus]`.")
        self.middleware = middleware
        self.registry = registry
        # Serialises reading the count and setting the gauge: an older count never overwrites a newer.
        self._gauge_mutex = threading.Lock()
        middleware.events.subscribe(self)

    def __call__(self, event: LockEvent) -> None:
        """Count ``event``; for a run lock, set the gauge of leases."""
        events, leases = _metrics(self.registry)
        events.labels(actor_name=event.actor, event=event.name).inc()
        if event.key.endswith(":run"):
            with self._gauge_mutex:
                leases.labels(actor_name=event.actor).set(self.middleware.threads.leases.count(event.actor))
