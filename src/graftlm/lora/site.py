"""The adapters attached to one projection, each in its slot, and the delta they add.

Semantics (per row b of the batch, per token t):
    y[b, t] += sum_s scales[b, s] * B_s @ (A_s @ x[b, t])
where every A_s is (r_s, n_in), every B_s is (n_out, r_s) with the adapter's per-tensor factor
(alpha / r, or PEFT's rule) already folded in at load. A step computes any mix of adapters and
scales over all its rows; an adapter whose scale is 0 on every row of the step is not in the
active set and costs nothing.

This module is the delta's PyTorch form (`LoraSite.add_delta`, each active slot in turn), the
reference twin of every fast path. The native form of each slot is packed when the slot is put
(`lora.packed`), never in a step, and the projection's table of them is made once per change of
its slots (`LoraSite.native`).
"""

from __future__ import annotations

import torch

from graftlm.lora.packed import PackedSlot, SlotTable, pack
from graftlm.step.batch import LoraRows


class Generation:
    """A counter shared by the sites of one model: it changes whenever any of their slots do,
    so a cache of bound forms (the native decode layer's) checks one number a step."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class LoraSite:
    """Adapter slots on one projection (or on the embedding, with `gather=True`)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        gather: bool = False,
        compact: bool = False,
        device: torch.device | str = "cpu",
        generation: Generation | None = None,
    ) -> None:
        self.n_in = n_in
        self.n_out = n_out
        self.device = torch.device(device)  # the model's: factors are moved here when put
        # gather: A is a table (n_vocab, r) looked up by token id (llama.cpp's token_embd layout)
        self.gather = gather
        # compact: the projection's own base product is approximate (int8 activations), so a
        # fast form of the delta may be too (bfloat16 B, A . x in integer dots); exact steps
        # always get the float32 factors
        self.compact = compact
        self.generation = generation if generation is not None else Generation()
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._packed: dict[int, PackedSlot | None] = {}  # each slot's native form (lora.packed)
        self._table: SlotTable | None = None

    def __bool__(self) -> bool:
        return bool(self._slots)

    @property
    def slot_ids(self) -> list[int]:
        return sorted(self._slots)

    def nbytes(self, slot: int) -> int:
        """The bytes slot's factors take: as put, and packed."""
        a, b = self._slots[slot]
        packed = self._packed.get(slot)
        extra = packed.nbytes if packed is not None else 0
        return a.numel() * a.element_size() + b.numel() * b.element_size() + extra

    def _changed(self) -> None:
        self._table = None
        self.generation.bump()  # whoever caches bound forms of the model's sites rebinds

    def put(
        self, slot: int, a: torch.Tensor, b: torch.Tensor, packed: PackedSlot | None = None
    ) -> None:
        """Attach (or replace) one slot. a: (r, n_in), or (n_vocab, r) when gathering; b: (n_out, r).
        Both are moved to the site's device (no copy on the CPU). `packed`: their native form,
        packed ahead for a site of this kind (AdapterSet.load); else it is packed here."""
        a, b = self._here(a), self._here(b)
        self._slots[slot] = (a, b)
        if packed is None and not self.gather:
            packed = pack(a, b, self.compact)
        self._packed[slot] = packed
        self._changed()

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        # factors read, checked and packed off the engine's thread arrive ready: a put on that
        # thread then makes no tensor call (each would let the reader threads take the
        # interpreter's lock, the engine waiting to get it back)
        if t.device == self.device and t.is_contiguous():
            return t
        return t.to(self.device).contiguous()

    def to(self, device: torch.device | str) -> LoraSite:
        """Every slot's factors on `device`, and later ones put there (in place; returns self)."""
        self.device = torch.device(device)
        self._slots = {
            s: (a.to(self.device), b.to(self.device)) for s, (a, b) in self._slots.items()
        }
        self._packed = {
            s: None if self.gather else pack(a, b, self.compact)
            for s, (a, b) in self._slots.items()
        }
        self._changed()
        return self

    def drop(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._packed.pop(slot, None)
        self._changed()

    def present(self, active: tuple[int, ...]) -> tuple[int, ...]:
        """The slots of `active` attached here, in order."""
        return tuple(s for s in active if s in self._slots)

    def native(self) -> SlotTable | None:
        """Every slot's packed form as the kernels' table (made once per change of the slots),
        or None where some slot has none (no library, factors off the CPU, a gathering site):
        then the PyTorch twin serves the site."""
        if self._table is None:
            packed = [(s, self._packed.get(s)) for s in self.slot_ids]
            ready = [(s, p) for s, p in packed if p is not None]
            if not packed or len(ready) < len(packed):
                return None
            self._table = SlotTable(ready)
        return self._table

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """y (B, T, n_out) plus the delta of x (B, T, n_in), or of token ids (B, T) when gathering.

        y must be the caller's own fresh output (the projection's, the embedding lookup's): the
        delta is added into it in place when it is contiguous."""
        slots = self.present(rows.active)
        if not slots:
            return y
        in_place = not self.gather and y.is_contiguous()  # a fresh matmul output: add in place
        flat = y.view(-1, y.shape[-1]) if in_place else y.reshape(-1, y.shape[-1]).clone()
        for s in slots:
            a, b = self._slots[s]
            xa = a[x] if self.gather else x @ a.T.to(x.dtype)  # (B, T, r)
            xa = xa * rows.scales[:, s].to(xa.dtype).view(-1, 1, 1)
            flat.addmm_(xa.reshape(-1, xa.shape[-1]), b.T.to(flat.dtype))
        return flat.view(y.shape)

    def add_token_delta(
        self, y: torch.Tensor, x: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        """y (n, n_out) plus the delta of x (n, n_in), token i at scales[i, s] (n, n_slots): a
        routed expert's tokens, gathered from the batch's rows (models.moe). Every attached slot
        with any nonzero scale among these tokens; y is the caller's own fresh output, added into
        in place when contiguous."""
        slots = [s for s in self.slot_ids if s < scales.shape[1] and bool(scales[:, s].any())]
        if not slots:
            return y
        out = y if y.is_contiguous() else y.clone()
        for s in slots:
            a, b = self._slots[s]
            xa = (x @ a.T.to(x.dtype)) * scales[:, s : s + 1].to(x.dtype)  # (n, r)
            out.addmm_(xa, b.T.to(out.dtype))
        return out
