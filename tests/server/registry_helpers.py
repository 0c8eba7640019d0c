"""Shared pieces of the adapter registry's tests (test_server_adapters.py, test_adapter_room.py):
a registry over the tiny adapters and a wait for the engine to attach what it holds resident."""

from __future__ import annotations

from pathlib import Path

from server_fixtures import await_until

from graftlm.runtime.service import EngineService
from graftlm.server.registry import AdapterRegistry

BASE = {"tiny"}  # the base model's names


def tiny_registry(svc: EngineService, files: dict[str, Path], **limits: int) -> AdapterRegistry:
    """alpha, beta and gamma as --lora-modules, a short --lora-wait (0.3 s) before the 503."""
    reg = AdapterRegistry(svc, room_wait_s=0.3, **limits)
    for name in ("alpha", "beta", "gamma"):
        reg.add_module(name, str(files[name]))
    return reg


def attached_ids(svc: EngineService) -> set[int]:
    return set(svc.adapters.attached)


async def settled(svc: EngineService, reg: AdapterRegistry) -> None:
    """The engine attaches exactly the registry's resident adapters, once the detaches the
    registry asked for (on the engine thread, after the release that freed them) have landed."""
    await await_until(
        lambda: attached_ids(svc) == set(reg.by_id),
        60,
        lambda: f"attached {sorted(attached_ids(svc))} against resident {sorted(reg.by_id)}",
    )
