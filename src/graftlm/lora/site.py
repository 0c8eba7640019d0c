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

A slot is held in one form. Where it has a native form (on the CPU, with the library, on a
projection) that form is its only copy, and the twin (exact steps: scoring; any call the native
delta does not take) reads the factors back from it on each call (`PackedSlot.factors`, nothing
kept). On a site over float weights that is the float32 factors as given; on a `compact` site
(int8 activations) B rounded to bfloat16 and A through Q8_0: an exact step is float32
arithmetic on the factors as held, the values every fast path multiplies by too. A slot with no
native form (off the CPU, no library, a gathering site) keeps its float32 factors.
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
        # compact: the projection's own base product is approximate (int8 activations), so the
        # slots' native form is too (bfloat16 B, A as Q8_0 for the integer dots), and, being
        # their one copy, is what exact steps read back (the module's docstring)
        self.compact = compact
        self.generation = generation if generation is not None else Generation()
        # each slot in one of the two: its native form (lora.packed), or, where it has none,
        # its float32 factors on the site's device
        self._packed: dict[int, PackedSlot] = {}
        self._factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._table: SlotTable | None = None

    def __bool__(self) -> bool:
        return bool(self._packed or self._factors)

    @property
    def slot_ids(self) -> list[int]:
        return sorted(self._packed.keys() | self._factors.keys())

    def nbytes(self, slot: int) -> int:
        """The bytes slot's one form takes: packed, or the float32 factors."""
        packed = self._packed.get(slot)
        if packed is not None:
            return packed.nbytes
        a, b = self._factors[slot]
        return a.numel() * a.element_size() + b.numel() * b.element_size()

    def factors(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot's (A, B) in float32 as held: read back from its native form on each call (a
        new pair), or its float32 factors themselves."""
        packed = self._packed.get(slot)
        return packed.factors() if packed is not None else self._factors[slot]

    def _changed(self) -> None:
        self._table = None
        self.generation.bump()  # whoever caches bound forms of the model's sites rebinds

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Attach (or replace) one slot. a: (r, n_in), or (n_vocab, r) when gathering; b: (n_out, r).
        Packed here where the site has a native form, and then only that is kept; else both
        are moved to the site's device (no copy on the CPU) and kept."""
        a, b = self._here(a), self._here(b)
        packed = None if self.gather else pack(a, b, self.compact)
        if packed is not None:
            self.put_packed(slot, packed)
            return
        self._packed.pop(slot, None)
        self._factors[slot] = (a, b)
        self._changed()

    def put_packed(self, slot: int, packed: PackedSlot) -> None:
        """Attach (or replace) one slot by its native form, packed ahead for a site of this
        kind (AdapterSet.load, `compact` as this site's) on the CPU: its one copy here."""
        assert not self.gather and self.device.type == "cpu", "a native form is the CPU's"
        assert (packed.n_in, packed.n_out) == (self.n_in, self.n_out), (
            f"slot {slot}: packed for ({packed.n_out}, {packed.n_in}), "
            f"the site is ({self.n_out}, {self.n_in})"
        )
        self._factors.pop(slot, None)
        self._packed[slot] = packed
        self._changed()

    def stage_packed(self, slot: int, packed: PackedSlot) -> None:
        """Hold a new slot's native form beside a step that may be running on another thread,
        without changing what it reads: the table it has (or makes) stays as it is, and the
        kernels read a scale of 0 for a slot no row of it names (a new id: `AdapterSet`).
        `publish`, between two steps, puts it in the tables."""
        assert not self.gather and self.device.type == "cpu", "a native form is the CPU's"
        assert slot not in self._packed and slot not in self._factors, (
            f"slot {slot} of the site ({self.n_out}, {self.n_in}) is taken"
        )
        # a new dict swapped in whole: a reader on the step's thread iterates either the old or
        # the new one, never one changing under it (with or without the interpreter's lock)
        self._packed = {**self._packed, slot: packed}

    def publish(self) -> None:
        """The slots staged since the last change in the native tables from the next step on."""
        self._changed()

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        # factors read, checked and packed off the engine's thread arrive ready: a put on that
        # thread then makes no tensor call (each would let the reader threads take the
        # interpreter's lock, the engine waiting to get it back)
        if t.device == self.device and t.is_contiguous():
            return t
        return t.to(self.device).contiguous()

    def to(self, device: torch.device | str) -> LoraSite:
        """Every slot on `device`, and later ones put there (in place; returns self): a packed
        slot leaving the CPU is read back to its float32 factors, which move; factors arriving
        on the CPU are packed again (the same bytes: the values as held round-trip)."""
        device = torch.device(device)
        if device == self.device:
            return self
        held = {s: self.factors(s) for s in self.slot_ids}
        self.device = device
        self._packed, self._factors = {}, {}
        for s, (a, b) in held.items():
            self.put(s, a, b)
        self._changed()
        return self

    def drop(self, slot: int) -> None:
        self._packed.pop(slot, None)
        self._factors.pop(slot, None)
        self._changed()

    def present(self, active: tuple[int, ...]) -> tuple[int, ...]:
        """The slots of `active` attached here, in order."""
        return tuple(s for s in active if s in self._packed or s in self._factors)

    def native(self) -> SlotTable | None:
        """Every slot's packed form as the kernels' table (made once per change of the slots),
        or None where some slot has none (no library, factors off the CPU, a gathering site):
        then the PyTorch twin serves the site."""
        if self._table is None:
            if not self._packed or self._factors:
                return None
            self._table = SlotTable(sorted(self._packed.items()))
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
            a, b = self.factors(s)  # (read back from the native form: an exact step's)
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
            a, b = self.factors(s)
            xa = (x @ a.T.to(x.dtype)) * scales[:, s : s + 1].to(x.dtype)  # (n, r)
            out.addmm_(xa, b.T.to(out.dtype))
        return out
