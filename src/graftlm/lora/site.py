"""The adapters attached to one projection, stacked into slots, and the delta they add.

Semantics (per row b of the batch, per token t):
    y[b, t] += sum_s scales[b, s] * B_s @ (A_s @ x[b, t])
where every A_s is (r_s, n_in), every B_s is (n_out, r_s) with the adapter's per-tensor factor
(alpha / r, or PEFT's rule) already folded in at load. The slots are stacked along the rank, so one
step computes any mix of adapters and scales over all rows with two matrix products:
    xa = x @ A_cat.T                   # (B, T, R), R = sum of ranks of the active slots
    y += (xa * scales[:, col_slot]) @ B_cat.T
An adapter whose scale is 0 on every row of the step is not in the active set and costs nothing.

This module is the delta's PyTorch form (`LoraSite.add_delta`), the reference twin of every fast
path. Faster forms of the same stack (the native kernels' layouts) are made by their users through
`LoraSite.derived`, which caches them beside the slots and forgets them when the slots change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from graftlm.step.batch import LoraRows

T = TypeVar("T")


@dataclass(frozen=True)
class Stack:
    """The active slots of a site, concatenated along the rank."""

    a: torch.Tensor  # (R, n_in); (n_vocab, R) on a gathering site
    bt: torch.Tensor  # (R, n_out): B_cat transposed
    col_slot: torch.Tensor  # (R,) int64: the slot each rank column belongs to
    layout: tuple[tuple[int, int], ...]  # (slot, rank) of each stacked part, in column order


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
        self._derived: dict[Any, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._slots)

    @property
    def slot_ids(self) -> list[int]:
        return sorted(self._slots)

    def nbytes(self, slot: int) -> int:
        a, b = self._slots[slot]
        return a.numel() * a.element_size() + b.numel() * b.element_size()

    def _changed(self) -> None:
        self._derived = {}
        self.generation.bump()  # whoever caches bound forms of the model's sites rebinds

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Attach (or replace) one slot. a: (r, n_in), or (n_vocab, r) when gathering; b: (n_out, r).
        Both are moved to the site's device (no copy on the CPU)."""
        dev = self.device
        self._slots[slot] = (a.to(dev).contiguous(), b.to(dev).contiguous())
        self._changed()

    def to(self, device: torch.device | str) -> LoraSite:
        """Every slot's factors on `device`, and later ones put there (in place; returns self)."""
        self.device = torch.device(device)
        self._slots = {
            s: (a.to(self.device), b.to(self.device)) for s, (a, b) in self._slots.items()
        }
        self._changed()
        return self

    def drop(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._changed()

    def present(self, active: tuple[int, ...]) -> tuple[int, ...]:
        """The slots of `active` attached here, in order."""
        return tuple(s for s in active if s in self._slots)

    def factors(self, slots: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) of each slot, as put."""
        return [self._slots[s] for s in slots]

    def derived(self, key: Any, build: Callable[[], T]) -> T:
        """`build()`, cached under `key` until the slots change (a faster form of a stack)."""
        if key not in self._derived:
            self._derived[key] = build()
        out: T = self._derived[key]
        return out

    def stack(self, active: tuple[int, ...]) -> Stack | None:
        """The stack of the active slots present here (cached per active set), or None."""
        slots = self.present(active)
        if not slots:
            return None
        return self.derived(("stack", slots), lambda: self.concat(slots))

    def concat(self, slots: tuple[int, ...]) -> Stack:
        """These slots concatenated, not cached (a faster form built from it keeps only its own
        copy: B is the bulk of an adapter, and the torch twin's float32 copy is made only if the
        twin runs)."""
        parts = self.factors(slots)
        a = torch.cat([a for a, _ in parts], dim=1 if self.gather else 0)
        bt = torch.cat([b.T for _, b in parts], dim=0).contiguous()
        col = torch.cat(
            [torch.full((b.shape[1],), s, dtype=torch.long, device=a.device)
             for s, (_, b) in zip(slots, parts, strict=True)]
        )  # fmt: skip
        layout = tuple((s, int(b.shape[1])) for s, (_, b) in zip(slots, parts, strict=True))
        return Stack(a, bt, col, layout)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """y (B, T, n_out) plus the delta of x (B, T, n_in), or of token ids (B, T) when gathering.

        y must be the caller's own fresh output (the projection's, the embedding lookup's): the
        delta is added into it in place when it is contiguous."""
        st = self.stack(rows.active)
        if st is None:
            return y
        s = rows.columns(st.layout, st.col_slot)  # (B, 1, R)
        xa = st.a[x] if self.gather else x @ st.a.T.to(x.dtype)  # (B, T, R)
        xa = (xa * s).reshape(-1, xa.shape[-1])
        if not self.gather and y.is_contiguous():  # a fresh matmul output: add in place
            y.view(-1, y.shape[-1]).addmm_(xa, st.bt)
            return y
        return torch.addmm(y.reshape(-1, y.shape[-1]), xa, st.bt).view(y.shape)
