"""The KV cache: paged. Every layer's keys and values live in blocks of `block` positions from
one pool; each sequence slot has a row of the block table naming the pool block that holds its
positions [i * block, (i + 1) * block).

Which blocks a slot holds is decided above (step/kv_allocator.py: the allocator, with the prefix
cache that lets several slots' tables name the same full block); here is only where they are and
how a step writes and reads them. Pool block 0 is never handed out: a table entry no sequence
owns points at it, so padding rows write there and nothing reads it.

Values are stored as float32, float16 (llama.cpp's default), bfloat16 or q8_0 (`KV_TYPES`; q8_0
is ggml's block_q8_0, per 32 values a float16 scale and 32 int8 codes, held as bytes: its dtype
here is torch.uint8). The native attention reads the blocks as they are; the PyTorch twin gathers
a step's rows into float32.
"""

from __future__ import annotations

import torch

from graftlm import hugepages
from graftlm.config import ModelConfig
from graftlm.errors import GraftError
from graftlm.step.batch import Batch

# llama.cpp's --cache-type names -> (torch dtype, the native code of gl_kv.type)
KV_TYPES: dict[str, tuple[torch.dtype, int]] = {
    "f32": (torch.float32, 0),
    "f16": (torch.float16, 1),
    "bf16": (torch.bfloat16, 2),
    "q8_0": (torch.uint8, 3),  # bytes of ggml's block_q8_0
}
DEFAULT_KV_TYPE = "f16"
BLOCK = 16  # positions a block (vLLM's default)


def kv_dtype(name: str) -> torch.dtype:
    """The dtype of a cache type named as llama.cpp names it (--cache-type-k / -v)."""
    if name not in KV_TYPES:
        raise GraftError(f"cache type {name!r} is not supported; use one of {', '.join(KV_TYPES)}")
    return KV_TYPES[name][0]


def row_width(n: int, dtype: torch.dtype) -> int:
    """Elements of the cache's tensor that n values take (q8_0: bytes, 34 for every 32)."""
    return n // 32 * 34 if dtype is torch.uint8 else n


def block_nbytes(cfg: ModelConfig, dtype: torch.dtype, block: int = BLOCK) -> int:
    """Bytes one block of a model's cache takes: keys and values of every layer."""
    width = row_width(cfg.head_dim, dtype) + row_width(cfg.v_head_dim, dtype)
    return cfg.n_layer * cfg.n_head_kv * block * width * torch.empty(0, dtype=dtype).element_size()


def q8_0_pack(x: torch.Tensor) -> torch.Tensor:
    """(..., n) float -> (..., n / 32 * 34) uint8 blocks, as ggml's quantize_row_q8_0_ref and the
    native kv_store: d = amax / 127 (stored as float16), q = round(x / d) half away from zero."""
    g = x.to(torch.float32).reshape(*x.shape[:-1], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    v = g * inv
    q = torch.trunc(v)
    q = q + torch.where((v - q).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))
    dh = d.to(torch.float16).view(torch.uint8)  # (..., nb, 2)
    qb = q.to(torch.int8).view(torch.uint8)  # (..., nb, 32)
    return torch.cat([dh, qb], -1).reshape(*x.shape[:-1], -1)


def q8_0_unpack(b: torch.Tensor) -> torch.Tensor:
    """The inverse of q8_0_pack: (..., n / 32 * 34) uint8 -> (..., n) float32."""
    g = b.reshape(*b.shape[:-1], -1, 34)
    d = g[..., :2].contiguous().view(torch.float16).to(torch.float32)  # (..., nb, 1)
    q = g[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    return (d * q).reshape(*b.shape[:-1], -1)


class KVCache:
    """n_slots sequences of up to n_ctx positions each, in n_blocks pool blocks (default: enough
    for every slot's whole context, plus block 0)."""

    def __init__(
        self,
        n_layer: int,
        n_slots: int,
        n_head_kv: int,
        n_ctx: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        n_blocks: int | None = None,
        block: int = BLOCK,
    ) -> None:
        if dtype not in {t for t, _ in KV_TYPES.values()}:
            raise GraftError(f"the KV cache cannot hold {dtype}")
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.block = block
        self.max_blocks = -(-n_ctx // block)  # a slot's table row
        self.n_blocks = n_slots * self.max_blocks + 1 if n_blocks is None else n_blocks
        if self.n_blocks < 2:
            raise GraftError(f"a KV cache of {self.n_blocks} blocks holds nothing")
        if dtype is torch.uint8 and (head_dim % 32 or v_head_dim % 32):
            raise GraftError(
                f"the q8_0 KV cache needs head sizes that are multiples of 32; this model's are "
                f"{head_dim} (keys) and {v_head_dim} (values)"
            )
        self.dtype = dtype
        self.n_head_kv, self.head_dim, self.v_head_dim = n_head_kv, head_dim, v_head_dim
        self.type_code = next(c for t, c in KV_TYPES.values() if t == dtype)
        kw, vw = row_width(head_dim, dtype), row_width(v_head_dim, dtype)
        # values: (block, kv_head, position in the block, dim) (q8_0: the dims' bytes); keys the
        # same in q8_0 (its blocks of 32 run along a key), else each block transposed, (block,
        # kv_head, dim, position): a dim of a block's positions is one vector of the decode
        # attention's scores (gl_kv in native/csrc/graftlm.h)
        self.keys_transposed = dtype is not torch.uint8
        kshape = (head_dim, block) if self.keys_transposed else (block, kw)
        self.k = [
            hugepages.zeros(self.n_blocks, n_head_kv, *kshape, dtype=dtype, device=device)
            for _ in range(n_layer)
        ]
        self.v = [
            hugepages.zeros(self.n_blocks, n_head_kv, block, vw, dtype=dtype, device=device)
            for _ in range(n_layer)
        ]
        # until an allocator sets them, a full pool maps slot s's block i to 1 + s * max_blocks + i
        # (every slot its whole context, as callers that pick slots themselves expect)
        self.tables = torch.zeros(n_slots, self.max_blocks, dtype=torch.int32)
        if self.n_blocks >= n_slots * self.max_blocks + 1:
            ids = torch.arange(1, n_slots * self.max_blocks + 1, dtype=torch.int32)
            self.tables = ids.view(n_slots, self.max_blocks).clone()
        self.tables = self.tables.to(device)

    def key_rows(self, layer: int) -> torch.Tensor:
        """A layer's key pool as rows, (n_blocks, Hkv, block, D) (q8_0: the rows' bytes): a view,
        through which the blocks can be read and written whatever their layout."""
        k = self.k[layer]
        return k.transpose(-1, -2) if self.keys_transposed else k

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def set_table(self, slot: int, blocks: list[int]) -> None:
        """Slot's table row: its positions [i * block, (i + 1) * block) in pool block blocks[i];
        the rest of the row points at block 0."""
        if not 0 <= slot < self.n_slots or len(blocks) > self.max_blocks:
            raise IndexError(
                f"table of slot {slot} with {len(blocks)} blocks: the cache has {self.n_slots} "
                f"slots of {self.max_blocks} blocks"
            )
        if blocks and not (0 < min(blocks) and max(blocks) < self.n_blocks):
            raise IndexError(
                f"slot {slot}: blocks {blocks} outside the pool 1..{self.n_blocks - 1}"
            )
        row = torch.zeros(self.max_blocks, dtype=torch.int32)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.tables[slot] = row.to(self.tables.device)

    def _places(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each row's positions this step, (B, T) each."""
        # padding rows may run past the context: their writes land in block 0 or in the row's
        # own blocks past its tokens, never read before they are written again
        pos = batch.positions.clamp(max=self.max_blocks * self.block - 1)
        blocks = self.tables[batch.slot_ids.unsqueeze(1), pos // self.block].long()
        return blocks, pos % self.block

    def write(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's k, v (B, T, Hkv, D) at each row's slot and positions."""
        blocks, offs = self._places(batch)
        if self.keys_transposed:
            self.k[layer][blocks, :, :, offs] = self._pack(k)
        else:
            self.k[layer][blocks, :, offs] = self._pack(k)
        self.v[layer][blocks, :, offs] = self._pack(v)

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        return q8_0_pack(x) if self.dtype is torch.uint8 else x.to(self.dtype)

    def read(self, layer: int, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values so far as float32, (B, Hkv, kv_len, D): a gathered copy
        (the PyTorch twin's; the native attention reads the blocks in place)."""
        kv_len = batch.kv_len
        nb = -(-kv_len // self.block)
        blocks = self.tables[batch.slot_ids, :nb].long()  # (B, nb)

        def gather(pool: torch.Tensor, transposed: bool) -> torch.Tensor:
            g = pool[blocks]  # (B, nb, Hkv, block, D), or (B, nb, Hkv, D, block) transposed
            if transposed:
                g = g.transpose(3, 4)
            if self.dtype is torch.uint8:
                g = q8_0_unpack(g)
            b, _, h, _, d = g.shape
            g = g.permute(0, 2, 1, 3, 4).reshape(b, h, nb * self.block, d)
            return g[:, :, :kv_len].to(torch.float32)

        return gather(self.k[layer], self.keys_transposed), gather(self.v[layer], False)

    def update(
        self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """write() then read()."""
        self.write(layer, batch, k, v)
        return self.read(layer, batch)
