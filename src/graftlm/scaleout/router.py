"""The replicas' request router: Serve's multiplexed power-of-two choices, held to the adapter.

Serve's default router (`PowerOfTwoChoicesRequestRouter`) mixes in `FIFOMixin`: a replica
found for one request is handed to the oldest pending request of the same adapter, or, if
there is none, to the oldest pending request of any adapter, which then loads its adapter
there. Under a burst of several adapters that evicts and reloads adapters on a replica that
was never chosen for them. It also leaves the replicas that hold an adapter after one busy
probe (a queue-length reply later than 0.1 s, common on a loaded machine) for the replicas
with the fewest adapters.

`AdapterRouter` is built of Serve's public request-router pieces (`RequestRouter`,
`MultiplexMixin`, `LocalityMixin`): each routing attempt serves the request it was made for
(`RequestRouter`'s exact match), and a request whose adapter some replica holds is offered
only those replicas until Serve's multiplexed matching timeout (1 to 2 s) has passed; then
the replicas with the fewest adapters, then all, as Serve does. Requests without an adapter
are routed as Serve routes them.

Each router also says what it knows, for the ingress's cold-start order (`scaleout.known`):
where each adapter is held, from Serve's public replica records
(`RunningReplica.multiplexed_model_ids`).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from graftlm.scaleout.known import publish

# at least Serve's multiplexed matching timeout: its setting, read as Serve reads it
HOLD_S = float(os.environ.get("RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S", "1.0"))


class AdapterRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Power of two choices among the replicas holding the request's adapter."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        adapter = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if not adapter:
            ids: Any = self.apply_locality_routing(pending_request=pending_request)
            return [_two(self.curr_replicas, ids)]
        assert pending_request is not None
        holders = [r for r in candidate_replicas if adapter in r.multiplexed_model_ids]
        if holders and time.time() - pending_request.created_at < HOLD_S:
            pending_request.routing_context.should_backoff = True  # busy: wait for them
            return [random.sample(holders, min(2, len(holders)))]
        return [_two(self.curr_replicas, self.apply_multiplex_routing(pending_request))]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish(self.curr_replicas.values())

    def _publish(self, replicas: Iterable[RunningReplica]) -> None:
        held: dict[str, set[str]] = {}
        for r in replicas:
            for name in r.multiplexed_model_ids:
                held.setdefault(name, set()).add(r.replica_id.unique_id)
        publish(self.app_name, {name: frozenset(ids) for name, ids in held.items()})


def _two(replicas: dict[Any, RunningReplica], ids: Any) -> list[RunningReplica]:
    """Two of the candidates `ids` at random (one if one): the two whose queues are probed."""
    chosen = list(ids)
    if len(chosen) > 2:
        chosen = random.sample(chosen, 2)
    return [replicas[i] for i in chosen if i in replicas]
