"""One forward step's batch: rectangular rows of tokens, each row one sequence, or packed.

A row carries its cache slot, where it starts, how many of its T tokens are real, and (when any
adapter is active in this step) the scale of every adapter slot for that row. Everything the model
needs per step is computed here once, not per layer: positions and attention masks. Every tensor
made here is on the device of `tokens` (the model's: the engine builds the batch there).

A packed batch (`Batch.packed`: several prompt chunks in one step) holds only real tokens: N rows
of one token each, every token its own slot, position and scale row, so that everything row-wise
(projections, norms, adapters' deltas, RoPE) computes no padding; attention alone takes each
sequence's tokens together (`Packing.rows`), as that sequence alone would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class LoraRows:
    """Per-row adapter scales for one step.

    scales: (B, n_slots) float32, scale of adapter slot s on row b (0 = off), on the model's
        device.
    active: the slots with any nonzero scale in this step, ascending; only these are computed.

    Never changed once made: one object serves every decode step while its rows' settings hold
    (Engine._decode_lora), and the native layers copy `scales` once an object
    (models.fused.ScaleBoard). Frozen; torch cannot mark a tensor read-only (and one made in
    inference mode keeps no version counter to check), so every consumer only reads `scales`,
    which tests/test_engine.py checks over many steps.
    """

    scales: torch.Tensor
    active: tuple[int, ...]

    def __post_init__(self) -> None:  # the native kernels read it as it is
        object.__setattr__(self, "scales", self.scales.to(torch.float32).contiguous())


@dataclass(frozen=True)
class Packing:
    """What a packed batch keeps of its sequences (Batch.packed).

    rows: each sequence's own (1, n) batch (its slot, start and tokens; no adapter), made once a
        step: the attention of a packed step runs each one as the sequence prefilled alone.
    head: (B, 1) the sequences' last tokens with their per-sequence scales: the batch the head
        (the output projection) takes, after the last tokens' rows are picked out.
    last: (B,) int64, each sequence's last token among the N packed rows.
    """

    rows: tuple[Batch, ...]
    head: Batch
    last: torch.Tensor


class RowIndex(NamedTuple):
    """A step's rows as the native kernels index the cache with them: slots and starts as (B,)
    int64 and their maxima, made once a step (the kernels check them against the cache once,
    not per layer). In a decode step the starts are the positions of the new tokens."""

    slots: torch.Tensor
    starts: torch.Tensor
    max_slot: int
    max_start: int


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T) int64
    slots: list[int]  # cache slot of each row
    starts: list[int]  # position of each row's first token
    lengths: list[int]  # real tokens per row (the rest of T is padding)
    lora: LoraRows | None = None
    # the step's precision: exact float32 products (scoring: log-probabilities are the product)
    # or the fast kernels (generation); every projection of the step reads it from here
    exact: bool = False
    # packed (Batch.packed): N rows of one real token each, and the sequences they came from
    packing: Packing | None = None
    _masks: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)
    _positions: torch.Tensor | None = field(default=None, repr=False)

    @property
    def n_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def kv_len(self) -> int:
        """Keys every row may need to see: up to the furthest position written this step."""
        return max(s + n for s, n in zip(self.starts, self.lengths, strict=False))

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            dev = self.tokens.device
            start = torch.tensor(self.starts, dtype=torch.long, device=dev).unsqueeze(1)
            steps = torch.arange(self.n_tokens, dtype=torch.long, device=dev)
            self._positions = start + steps  # (B, T)
        return self._positions

    @cached_property
    def slot_ids(self) -> torch.Tensor:
        """(B,) int64: each row's cache slot (the cache's writes and reads index with it)."""
        return torch.tensor(self.slots, dtype=torch.long, device=self.tokens.device)

    @cached_property
    def last_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns), each (B,): where each row's last real token sits in (B, T) (packed:
        each sequence's last token among the N rows of one token)."""
        dev = self.tokens.device
        if self.packing is not None:
            last = self.packing.last
            return last, torch.zeros_like(last)
        rows = torch.arange(self.n_rows, device=dev)
        return rows, torch.tensor(self.lengths, dtype=torch.long, device=dev) - 1

    @cached_property
    def _index(self) -> RowIndex | None:
        if min(self.slots) < 0 or min(self.starts) < 0:
            return None
        starts = torch.tensor(self.starts, dtype=torch.long, device=self.tokens.device)
        return RowIndex(self.slot_ids, starts, max(self.slots), max(self.starts))

    def index(self) -> RowIndex | None:
        """The rows' slots and starts as tensors, made once a step; None when any is negative
        (nothing native may index the cache with it)."""
        return self._index

    @cached_property
    def _decode(self) -> RowIndex | None:
        if self.packing is not None:  # (one token a row, but prompt chunks: attention by sequence)
            return None
        one_each = self.n_tokens == 1 and all(n == 1 for n in self.lengths)
        places = set(zip(self.slots, self.starts, strict=True))
        return self.index() if one_each and len(places) == len(self.slots) else None

    def decode_rows(self) -> RowIndex | None:
        """index() when every row is one real token at its own place (a decode step), else None;
        decided once a step, though every layer asks. Rows may share a slot at different
        positions (a speculative draft's tokens): the step writes every row's keys and values
        before any row attends, so each sees the positions up to its own."""
        return self._decode

    def mask(self, window: int) -> torch.Tensor | None:
        """(B, 1, T, kv_len) bool: key j visible to the query at position p; None when every
        query sees every key (one row decoding one token inside its window)."""
        if window in self._masks:
            return self._masks[window]
        m: torch.Tensor | None = None
        if self.n_rows == 1 and self.n_tokens == 1 and (window == 0 or self.kv_len <= window):
            pass
        else:
            q = self.positions.unsqueeze(2)  # (B, T, 1)
            k = torch.arange(self.kv_len, dtype=torch.long, device=q.device).view(1, 1, -1)
            m = k <= q
            if window > 0:
                # llama.cpp's standard SWA: masked when p - j >= window
                m = m & (q - k < window)
            m = m.unsqueeze(1)
        self._masks[window] = m
        return m

    @classmethod
    def padded(
        cls,
        rows: Sequence[Sequence[int]],
        slots: Sequence[int],
        starts: Sequence[int],
        lora: LoraRows | None = None,
        device: torch.device | None = None,
    ) -> Batch:
        """One row a sequence: its tokens at its slot from its start, padded to the longest
        with token 0 (never read: each row's length bounds it)."""
        tokens = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        if device is not None:
            tokens = tokens.to(device)
        return cls(tokens, list(slots), list(starts), [len(r) for r in rows], lora)

    @classmethod
    def packed(
        cls,
        rows: Sequence[Sequence[int]],
        slots: Sequence[int],
        starts: Sequence[int],
        lora: LoraRows | None = None,
        device: torch.device | None = None,
    ) -> Batch:
        """The real tokens of several sequences' chunks, (N, 1) in order (no padding): row i of
        sequence b is its token at position starts[b] + i, with b's slot and b's scale row
        (lora: (B, n_slots), one row a sequence, as for `padded`)."""
        n = [len(r) for r in rows]
        tokens = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)
        tokens = tokens.view(-1, 1)  # (N, 1)
        ends = torch.tensor(n, dtype=torch.long).cumsum(0)
        last = (ends - 1).to(tokens.device)
        seqs, at = [], 0
        for k, slot, start in zip(n, slots, starts, strict=True):
            seqs.append(cls(tokens[at : at + k].view(1, k), [slot], [start], [k]))
            at += k
        ends_at = [s + k - 1 for s, k in zip(starts, n, strict=True)]
        head = cls(tokens[last], list(slots), ends_at, [1] * len(n), lora)
        tokens_lora = None
        if lora is not None:  # each token its sequence's scale row: (N, n_slots)
            counts = torch.tensor(n, dtype=torch.long, device=lora.scales.device)
            scales = lora.scales.repeat_interleave(counts, dim=0, output_size=sum(n))
            tokens_lora = LoraRows(scales, lora.active)
        return cls(
            tokens,
            [s for s, k in zip(slots, n, strict=True) for _ in range(k)],
            [s + i for s, k in zip(starts, n, strict=True) for i in range(k)],
            [1] * len(tokens),
            tokens_lora,
            packing=Packing(tuple(seqs), head, last),
        )

    @classmethod
    def single(
        cls,
        ids: list[int],
        slot: int = 0,
        start: int = 0,
        lora: LoraRows | None = None,
        device: torch.device | None = None,
        exact: bool = False,
    ) -> Batch:
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        return cls(tokens, [slot], [start], [len(ids)], lora, exact)
