"""Where this process's request routers last heard each adapter is held, for the ingress.

`AdapterRouter` publishes here from Serve's public replica records; the ingress reads it to
order a cold start. The table lives in a module of its own because Serve sends a custom router's
module by value (cloudpickle's `register_pickle_by_value`): a table in the router's module would
be a copy of its own in every process, never the one the ingress imports.
"""

from __future__ import annotations

# application -> adapter -> ids of the replicas holding it
_KNOWN: dict[str, dict[str, frozenset[str]]] = {}


def publish(app: str, held: dict[str, frozenset[str]]) -> None:
    """A router of application `app` heard of these holders (all of them: it replaces)."""
    _KNOWN[app] = held  # a new dict each time: readers on other threads see one or the other


def known_adapters(app: str) -> dict[str, frozenset[str]] | None:
    """Where the routers of application `app` in this process last heard each adapter is held
    (adapter -> replica ids); None before such a router has heard of any replica."""
    return _KNOWN.get(app)
