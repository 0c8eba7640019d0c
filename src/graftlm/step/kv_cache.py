"""The KV cache: one preallocated block per layer, indexed by sequence slot."""

from __future__ import annotations

import torch

from graftlm.step.batch import Batch


class KVCache:
    def __init__(
        self,
        n_layer: int,
        n_slots: int,
        n_head_kv: int,
        n_ctx: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        # (slot, kv_head, position, dim)
        self.k = [
            torch.zeros(n_slots, n_head_kv, n_ctx, head_dim, dtype=dtype, device=device)
            for _ in range(n_layer)
        ]
        self.v = [
            torch.zeros(n_slots, n_head_kv, n_ctx, v_head_dim, dtype=dtype, device=device)
            for _ in range(n_layer)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's k, v (B, T, Hkv, D) at each row's slot and positions."""
        kc, vc = self.k[layer], self.v[layer]
        if batch.n_rows == 1:
            slot, start, t = batch.slots[0], batch.starts[0], batch.n_tokens
            kc[slot, :, start : start + t] = k[0].transpose(0, 1)
            vc[slot, :, start : start + t] = v[0].transpose(0, 1)
            return
        slots = batch.slot_ids.unsqueeze(1)
        # padding rows may run past the context: their writes land on the last cell, never read
        pos = batch.positions.clamp(max=self.n_ctx - 1)
        kc[slots, :, pos] = k
        vc[slots, :, pos] = v

    def read(self, layer: int, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values so far, (B, Hkv, kv_len, D): views for one row, a gather
        (a copy) for several."""
        kc, vc = self.k[layer], self.v[layer]
        kv_len = batch.kv_len
        if batch.n_rows == 1:
            slot = batch.slots[0]
            return kc[slot : slot + 1, :, :kv_len], vc[slot : slot + 1, :, :kv_len]
        return kc[batch.slot_ids, :, :kv_len], vc[batch.slot_ids, :, :kv_len]

    def update(
        self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """write() then read()."""
        self.write(layer, batch, k, v)
        return self.read(layer, batch)
