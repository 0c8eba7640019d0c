"""The paged cache's allocator: which pool blocks each sequence holds, and the prefix cache.

Plain Python, beside the pool's tensors (`step/kv_cache.py`): the KV cache's two halves in one
place. It serves the scheduler (a `CacheAllocator`) and knows a sequence only through the
`Request` protocol below; it names blocks, and a callback (the engine's: `KVCache.set_table`)
writes a slot's block table where the kernels read it.

A full block is known by a digest of every token up to its end and of the adapter settings that
computed it (base is its own setting): the digest of block i hashes block i - 1's digest, the
block's tokens and the settings, so equal digests mean the same tokens from position 0 under the
same adapters at the same scales. Each block has a reference count (the sequences whose tables
name it). A sequence admitted looks its tokens up block by block and shares the longest run of
cached blocks (at least its last token is always computed: its logits are the product), and
takes fresh blocks for the rest as it grows. A full block it computed is entered in the table
when it fills. A block that no sequence holds but that has a digest stays cached, in least
recently used order, until a fresh block is wanted and the free list is empty: then the oldest is
evicted. A block some sequence holds is never evicted.

Pool block 0 is never handed out (the cache points unowned table entries at it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from graftlm.errors import RequestError


class Settings(Protocol):
    """Adapter settings as a block digest sees them (lora.settings.AdapterSettings): the
    (adapter id, scale) pairs, empty for the base."""

    @property
    def pairs(self) -> tuple[Any, ...]: ...


class Request(Protocol):
    """What the allocator reads and keeps on a sequence (runtime.scheduler.Request)."""

    id: int
    n_prefilled: int
    n_cached: int
    resume: list[int] | None  # after a preemption: the tokens to compute again
    use_cache: bool
    block_digests: list[bytes]
    digest_epoch: int

    @property
    def fill(self) -> list[int]: ...

    def tokens_upto(self, n: int) -> list[int]: ...

    def settings_at(self, pos: int) -> Settings: ...


def settings_key(lora: Settings, epoch: int = 0) -> bytes:
    """The bytes of adapter settings in a block digest; epoch: the adapters' load epoch (a slot
    reloaded with other weights must not match what the old ones computed)."""
    if not lora.pairs:
        return b"base"
    return repr((epoch, lora.pairs)).encode()


def block_digest(parent: bytes, tokens: list[int], key: bytes) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(key)
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


@dataclass
class PoolStats:
    """Counters for the metrics: prompt tokens looked up, those found, blocks evicted."""

    query_tokens: int = 0
    hit_tokens: int = 0
    evicted: int = 0


class BlockPool:
    """Blocks 1 .. n_blocks - 1: the free list, reference counts, the digest table and the
    least-recently-used order of cached blocks no sequence holds."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.free: deque[int] = deque(range(1, n_blocks))
        self.refs = [0] * n_blocks
        self.digest_of: dict[int, bytes] = {}
        self.by_digest: dict[bytes, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld: oldest first
        self.stats = PoolStats()

    @property
    def n_usable(self) -> int:
        return self.n_blocks - 1

    @property
    def n_available(self) -> int:
        """Blocks a sequence could take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.idle)

    @property
    def n_used(self) -> int:
        return self.n_usable - self.n_available

    @property
    def n_cached(self) -> int:
        return len(self.digest_of)

    def take(self) -> int:
        """A fresh block, held once: a free one, else the least recently used cached one."""
        if self.free:
            b = self.free.popleft()
        elif self.idle:
            b, _ = self.idle.popitem(last=False)
            del self.by_digest[self.digest_of.pop(b)]
            self.stats.evicted += 1
        else:
            raise RequestError("the KV cache pool is full", "server_busy")
        self.refs[b] = 1
        return b

    def share(self, b: int) -> None:
        if self.refs[b] == 0:
            self.idle.pop(b, None)
        self.refs[b] += 1

    def drop(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.digest_of:
                self.idle[b] = None  # most recently used last
            else:
                self.free.append(b)

    def enter(self, b: int, digest: bytes) -> None:
        """b holds the block of this digest (the first block entered for a digest stays it)."""
        if digest not in self.by_digest and b not in self.digest_of:
            self.by_digest[digest] = b
            self.digest_of[b] = digest

    def forget(self, keep: Callable[[bytes], bool] | None = None) -> None:
        """Drop every digest (or those keep() refuses): held blocks stay with their sequences."""
        for b, d in list(self.digest_of.items()):
            if keep is None or not keep(d):
                del self.digest_of[b], self.by_digest[d]
                if b in self.idle:
                    del self.idle[b]
                    self.free.append(b)


@dataclass
class _Held:
    slot: int
    blocks: list[int] = field(default_factory=list)
    entered: int = 0  # blocks[:entered] are in the prefix cache (or were found there)


class PagedAllocator:
    """A `CacheAllocator` over a BlockPool: n_slots sequence slots (rows of the block table),
    blocks of `block` positions, at most max_blocks a sequence. set_table(slot, blocks) writes a
    slot's table. prefix: look prompts up in the prefix cache and enter full blocks in it."""

    def __init__(
        self,
        n_slots: int,
        n_blocks: int,
        block: int,
        max_blocks: int,
        set_table: Callable[[int, list[int]], None],
        prefix: bool = True,
    ) -> None:
        self.n_slots = n_slots
        self.block = block
        self.max_blocks = max_blocks
        self.pool = BlockPool(n_blocks)
        self.set_table = set_table
        self.prefix = prefix
        self.epoch = 0  # adapters' load epoch, part of every adapter setting's digest
        self.free: list[int] = list(range(n_slots))
        self._held: dict[int, _Held] = {}  # request id -> its slot and blocks
        self._lent: dict[int, list[int]] = {}  # borrowed slot -> its blocks
        self._base: set[bytes] = set()  # digests of blocks the base computed
        self.admit_tokens = 512  # what admission makes room for: the scheduler's chunk

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return len(self.free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block)

    @property
    def capacity(self) -> int:
        """The most tokens one sequence can hold: the pool's or the table's, the smaller."""
        return min(self.pool.n_usable, self.max_blocks) * self.block

    # -- the prefix cache ----------------------------------------------------------------------------
    def _key(self, seq: Request, i: int) -> bytes:
        """Block i's setting: the one that computed its last position (an aLoRA's start may
        fall inside it; the digest chain holds the tokens, which fix the start)."""
        return settings_key(seq.settings_at((i + 1) * self.block - 1), self.epoch)

    def _digests(self, seq: Request, n: int) -> list[bytes]:
        """The digests of seq's first n full blocks (at least; memoised on seq: a block's digest
        depends only on the tokens up to its end, its setting and the epoch, so a request that
        waits, is admitted, fills blocks and is preempted hashes each block once)."""
        memo = seq.block_digests
        if seq.digest_epoch != self.epoch:
            memo.clear()
            seq.digest_epoch = self.epoch
        if len(memo) < n:
            tokens = seq.tokens_upto(n * self.block)
            parent = memo[-1] if memo else b""
            for i in range(len(memo), n):
                piece = tokens[i * self.block : (i + 1) * self.block]
                parent = block_digest(parent, piece, self._key(seq, i))
                memo.append(parent)
        return memo

    def lookup(self, seq: Request) -> list[int]:
        """The cached blocks of the longest cached run of seq's full blocks to fill (leaving at
        least the last token to compute); none when seq uses no cache."""
        if not (self.prefix and seq.use_cache):
            return []
        n = (len(seq.fill) - 1) // self.block
        found: list[int] = []
        for d in self._digests(seq, n)[:n]:
            b = self.pool.by_digest.get(d)
            if b is None:
                break
            found.append(b)
        return found

    def adapters_changed(self) -> None:
        """An adapter was loaded, replaced or removed: what adapters computed is no longer
        found (base blocks stay)."""
        self.epoch += 1
        self.pool.forget(keep=self._base.__contains__)
        self._base &= set(self.pool.by_digest)

    # -- CacheAllocator ------------------------------------------------------------------------------
    def can_admit(self, seq: Request) -> bool:
        if not self.free:
            return False
        found = self.lookup(seq)
        idle_found = sum(1 for b in found if self.pool.refs[b] == 0)
        first = min(len(seq.fill), len(found) * self.block + self.admit_tokens)
        need = self.blocks_for(first) - len(found)
        return need <= self.pool.n_available - idle_found

    def admit(self, seq: Request) -> None:
        found = self.lookup(seq)
        self.pool.stats.query_tokens += len(seq.fill)
        self.pool.stats.hit_tokens += len(found) * self.block
        for b in found:
            self.pool.share(b)
        held = _Held(self.free.pop(0), list(found), len(found))
        self._held[seq.id] = held
        seq.n_prefilled = len(found) * self.block
        if seq.resume is None:  # (a preempted sequence keeps what its first admission found)
            seq.n_cached = seq.n_prefilled
        self.set_table(held.slot, held.blocks)

    def grow(self, seq: Request, n_tokens: int) -> bool:
        """Blocks for seq's first n_tokens positions; False (nothing taken) when the pool has too
        few."""
        held = self._held[seq.id]
        need = self.blocks_for(n_tokens) - len(held.blocks)
        if need <= 0:
            return True
        if need > self.pool.n_available or len(held.blocks) + need > self.max_blocks:
            return False
        held.blocks.extend(self.pool.take() for _ in range(need))
        self.set_table(held.slot, held.blocks)
        return True

    def commit(self, seq: Request, n_written: int) -> None:
        """seq's K/V are written up to position n_written - 1: enter the blocks that filled."""
        if not self.prefix:
            return
        held = self._held.get(seq.id)
        if held is None:
            return
        full = min(n_written // self.block, len(held.blocks))
        if full <= held.entered:
            return
        digests = self._digests(seq, full)
        for i in range(held.entered, full):
            self.pool.enter(held.blocks[i], digests[i])
            if self._key(seq, i) == b"base":
                self._base.add(digests[i])
        held.entered = full

    def release(self, seq: Request) -> None:
        held = self._held.pop(seq.id)
        for b in held.blocks:
            self.pool.drop(b)
        self.set_table(held.slot, [])
        self.free.append(held.slot)

    def slot(self, seq: Request) -> int:
        return self._held[seq.id].slot

    def borrow(self, n_tokens: int) -> int:
        """A slot with private blocks for n_tokens positions, outside any sequence (a scoring
        pass: nothing it computes enters the prefix cache)."""
        need = self.blocks_for(n_tokens)
        if not self.free:
            raise RequestError("no free sequence slot", "server_busy")
        if need > self.pool.n_available:
            raise RequestError(
                f"the KV cache has {self.pool.n_available} free blocks of {self.block} tokens; "
                f"{n_tokens} tokens need {need}",
                "server_busy",
            )
        slot = self.free.pop(0)
        blocks = [self.pool.take() for _ in range(need)]
        self._lent[slot] = blocks
        self.set_table(slot, blocks)
        return slot

    def give_back(self, slot: int) -> None:
        for b in self._lent.pop(slot, []):
            self.pool.drop(b)
        self.set_table(slot, [])
        self.free.append(slot)
