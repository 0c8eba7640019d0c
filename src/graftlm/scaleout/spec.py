"""The settings of a Ray Serve application of graftlm, chosen by the command line (no Ray here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graftlm.server.state import ServerState


@dataclass(frozen=True)
class ScaleSpec:
    """How many replicas of which server, and how requests reach them.

    `build_state` runs in every replica (it loads the model and starts its engine, as
    `graftlm serve` does before it listens); it travels to the replicas pickled, so it must be
    a module-level function or a `functools.partial` of one."""

    build_state: Callable[[], ServerState]
    threads: int = 1  # CPU threads of each replica (and the CPUs Ray reserves for it)
    replicas: int = 1  # fixed number of replicas, unless min/max_replicas autoscale
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0  # autoscaling's target per replica
    max_adapters: int = -1  # adapters each replica holds (Serve's LRU); -1: no limit
    max_ongoing_requests: int = 64  # requests a replica takes at once (its engine queues them)
    affinity: bool = True  # False: requests go anywhere (Serve's default routing)
    api_key: str | None = None  # checked by the ingress for what it answers itself
    max_body_bytes: int = 8 << 20
    name: str = "graftlm"  # the Serve application's name

    def replica_options(self) -> dict[str, Any]:
        """`serve.deployment` options of the replica deployment."""
        opts: dict[str, Any] = {
            "ray_actor_options": {
                "num_cpus": self.threads,
                # torch's and OpenMP's pools sized to the CPUs reserved, before torch loads
                "runtime_env": {
                    "env_vars": {"OMP_NUM_THREADS": str(self.threads)},
                },
            },
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_timeout_s": 5,
        }
        if self.min_replicas is not None or self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
            if not 0 <= low <= high or high < 1:
                raise ValueError(
                    f"--min-replicas {low} / --max-replicas {high}: need 0 <= min <= max, max >= 1"
                )
            opts["autoscaling_config"] = {
                "min_replicas": low,
                "max_replicas": high,
                "initial_replicas": min(max(self.replicas, low), high),
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            if self.replicas < 1:
                raise ValueError(f"--replicas {self.replicas}: must be at least 1")
            opts["num_replicas"] = self.replicas
        return opts
