"""The adapters attached to one projection, stacked into slots, and the delta they add.

Semantics (per row b of the batch, per token t):
    y[b, t] += sum_s scales[b, s] * B_s @ (A_s @ x[b, t])
where every A_s is (r_s, n_in), every B_s is (n_out, r_s) with the adapter's per-tensor factor
(alpha / r, or PEFT's rule) already folded in at load. The slots are stacked along the rank, so one
step computes any mix of adapters and scales over all rows with two matrix products:
    xa = x @ A_cat.T                   # (B, T, R), R = sum of ranks of the active slots
    y += (xa * scales[:, col_slot]) @ B_cat.T
An adapter whose scale is 0 on every row of the step is not in the active set and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graftlm.native import ops as native_ops
from graftlm.quant.config import get_compute_dtype
from graftlm.step.batch import LoraRows


@dataclass(frozen=True)
class _Stack:
    a: torch.Tensor  # (R, n_in)
    bt: torch.Tensor | None  # (R, n_out): B_cat transposed; None when only `blocked` is kept
    col_slot: torch.Tensor  # (R,) int64: the slot each rank column belongs to
    layout: tuple[tuple[int, int], ...]  # (slot, rank) of each stacked part, in column order
    n_out: int
    blocked: torch.Tensor | None = None  # B_cat in the native delta's layout (lora_block)
    spans: torch.Tensor | None = None  # (R, 2): nonzero output range of each column
    a_s8: tuple[torch.Tensor, torch.Tensor] | None = None  # A for the decode's integer dots

    def b_t(self) -> torch.Tensor:
        """B_cat transposed, (R, n_out), from whichever form is kept."""
        if self.bt is not None:
            return self.bt
        assert self.blocked is not None
        return native_ops.lora_unblock(self.blocked, self.n_out).float()


# Bumped by every put/drop on any site: whoever caches stacks (the native layer) rebinds on change.
_GENERATION = [0]


def generation() -> int:
    """A counter that changes whenever any site's adapters change."""
    return _GENERATION[0]


class LoraSite:
    """Adapter slots on one projection (or on the embedding, with `gather=True`)."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        gather: bool = False,
        compact: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_in = n_in
        self.n_out = n_out
        self.device = torch.device(device)  # the model's: factors are moved here when put
        # gather: A is a table (n_vocab, r) looked up by token id (llama.cpp's token_embd layout)
        self.gather = gather
        # compact: in the fast compute mode, the native delta streams B as bfloat16 (float32
        # arithmetic) and takes A . x as the base product takes W x: int8 x, A as Q8_0, integer
        # dots. Set for projections whose base product is itself approximate (int8
        # activations); float32 mode always gets the float32 factors.
        self.compact = compact
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacks: dict[tuple[tuple[int, ...], bool], _Stack | None] = {}

    def __bool__(self) -> bool:
        return bool(self._slots)

    @property
    def slot_ids(self) -> list[int]:
        return sorted(self._slots)

    def nbytes(self, slot: int) -> int:
        a, b = self._slots[slot]
        return a.numel() * a.element_size() + b.numel() * b.element_size()

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Attach (or replace) one slot. a: (r, n_in), or (n_vocab, r) when gathering; b: (n_out, r).
        Both are moved to the site's device (no copy on the CPU)."""
        dev = self.device
        self._slots[slot] = (a.to(dev).contiguous(), b.to(dev).contiguous())
        self._stacks = {}
        _GENERATION[0] += 1

    def to(self, device: torch.device | str) -> LoraSite:
        """Every slot's factors on `device`, and later ones put there (in place; returns self)."""
        self.device = torch.device(device)
        self._slots = {
            s: (a.to(self.device), b.to(self.device)) for s, (a, b) in self._slots.items()
        }
        self._stacks = {}
        _GENERATION[0] += 1
        return self

    def drop(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._stacks = {}
        _GENERATION[0] += 1

    def _stack(self, active: tuple[int, ...]) -> _Stack | None:
        """The stack of the active slots present here, in the form the current mode computes
        with (cached per active set and mode)."""
        exact = get_compute_dtype() is torch.float32
        slots = tuple(s for s in active if s in self._slots)
        cached = self._stacks.get((slots, exact), False)
        if cached is not False:
            return cached  # type: ignore[return-value]
        key = slots
        stack = None
        if key:
            a_dim = 1 if self.gather else 0
            a = torch.cat([self._slots[s][0] for s in key], dim=a_dim)
            bt = torch.cat([self._slots[s][1].T for s in key], dim=0).contiguous()
            col = torch.cat(
                [
                    torch.full((self._slots[s][1].shape[1],), s, dtype=torch.long, device=a.device)
                    for s in key
                ]
            )
            layout = tuple((s, int(self._slots[s][1].shape[1])) for s in key)
            native = (
                not self.gather
                and native_ops.library() is not None
                and a.dtype == bt.dtype == torch.float32
                and a.device.type == "cpu"
            )
            if native:  # one copy of B, blocked as the native delta streams it
                half = self.compact and not exact
                dtype = torch.bfloat16 if half else torch.float32
                blocked, spans = native_ops.lora_block(bt, dtype), native_ops.lora_spans(bt)
                a_s8 = native_ops.lora_a_s8(a) if half else None
                a = a.to(dtype).contiguous()
                stack = _Stack(a, None, col, layout, self.n_out, blocked, spans, a_s8)
            else:
                stack = _Stack(a, bt, col, layout, self.n_out)
        self._stacks[(key, exact)] = stack
        return stack

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """y (B, T, n_out) plus the delta of x (B, T, n_in), or of token ids (B, T) when gathering.

        y must be the caller's own fresh output (the projection's, the embedding lookup's): the
        delta is added into it in place when it is contiguous."""
        st = self._stack(rows.active)
        if st is None:
            return y
        s = rows.columns(st.layout, st.col_slot)  # (B, 1, R)
        if st.blocked is not None and st.spans is not None:
            if native_ops.lora_delta(y, x, st.a, s, st.blocked, st.spans, st.a_s8):
                return y
        xa = st.a[x] if self.gather else x @ st.a.T.to(x.dtype)  # (B, T, R)
        xa = (xa * s).reshape(-1, xa.shape[-1])
        if not self.gather and y.is_contiguous():  # a fresh matmul output: add in place
            y.view(-1, y.shape[-1]).addmm_(xa, st.b_t())
            return y
        return torch.addmm(y.reshape(-1, y.shape[-1]), xa, st.b_t()).view(y.shape)
