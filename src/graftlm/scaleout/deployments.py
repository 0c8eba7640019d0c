"""graftlm on Ray Serve: an ingress, N replicas of graftlm's own server, and a directory.

- `Replica` (scaleout/replica.py): one engine and graftlm's HTTP app, run in-process on each
  forwarded request; its adapters are Serve's multiplexed models.
- `Ingress` (scaleout/ingress.py): the HTTP surface. It routes each request to a replica by its
  adapter (Serve's multiplexed model id, placed by `AdapterRouter`), and answers `/metrics` and
  `/replicas` itself.
- `Directory` (here): what replicas report (metrics, loads, adapters) and the catalog of adapters
  loaded or unloaded at runtime, which every replica applies.

The three are deployments made once, here; `build_app` binds them to one application's spec
(the replicas' count, resources and routing as `.options`, the spec itself as an argument).

Ray is imported here only: graftlm without its `ray` extra never imports this module.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from graftlm.scaleout.forward import LIVE_S
from graftlm.scaleout.ingress import Ingress
from graftlm.scaleout.replica import Replica
from graftlm.scaleout.router import AdapterRouter
from graftlm.scaleout.spec import ScaleSpec


class Directory:
    """Replicas' reports and the runtime adapter catalog (name -> path; None: unloaded)."""

    def __init__(self) -> None:
        self.version = 0
        self.catalog: dict[str, str | None] = {}
        self.reports: dict[str, tuple[float, dict[str, Any]]] = {}

    async def report(self, replica: str, info: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.reports[replica] = (time.monotonic(), info)
        return self.version, dict(self.catalog)

    async def catalog_now(self) -> tuple[int, dict[str, Any]]:
        return self.version, dict(self.catalog)

    async def set_adapter(self, name: str, path: str | None) -> int:
        self.version += 1
        self.catalog[name] = path
        return self.version

    async def replicas(self) -> dict[str, dict[str, Any]]:
        """The reports of the replicas heard from in the last LIVE_S seconds."""
        now = time.monotonic()
        for k in [k for k, (t, _) in self.reports.items() if now - t > 10 * LIVE_S]:
            del self.reports[k]
        return {k: info for k, (t, info) in self.reports.items() if now - t <= LIVE_S}


_SMALL = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}  # one, on no CPU of its own
# without an access log: every replica reports every REPORT_S, a line each
DIRECTORY = serve.deployment(
    Directory, name="Directory", logging_config={"enable_access_log": False}, **_SMALL
)
REPLICA = serve.deployment(
    Replica,
    name="Replica",
    request_router_config=RequestRouterConfig(request_router_class=AdapterRouter),
)
INGRESS = serve.deployment(
    serve.ingress()(Ingress), name="Ingress", max_ongoing_requests=1000, **_SMALL
)


def build_app(spec: ScaleSpec) -> Any:
    """The Serve application (`serve.run(build_app(spec), name=spec.name, route_prefix="/")`)."""
    directory = DIRECTORY.bind()
    replica = REPLICA.options(**spec.replica_options()).bind(spec, directory)
    return INGRESS.bind(spec, replica, directory)


def start(spec: ScaleSpec, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Deploy the application on the Ray cluster this process is connected to (`ray.init`
    first) with Serve's HTTP proxy on host:port; returns its URL once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(spec), name=spec.name, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"
