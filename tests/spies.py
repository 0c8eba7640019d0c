"""Spies on the native paths, shared by the tests that check a step was served natively."""

from __future__ import annotations

import pytest
import torch

from graftlm.step.batch import Batch


def stack_calls(mp: pytest.MonkeyPatch) -> list[bool]:
    """From here on, whether each FusedStack call served its step (True) or refused it (False)."""
    from graftlm.models.fused import FusedStack

    served: list[bool] = []
    call = FusedStack.__call__

    def counted(self: FusedStack, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        y = call(self, x, batch)
        served.append(y is not None)
        return y

    mp.setattr(FusedStack, "__call__", counted)
    return served
