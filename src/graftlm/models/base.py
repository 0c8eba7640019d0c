"""What every architecture shares: weights from the GGUF file, embedding, head, the forward step.

An architecture file defines how one block turns hidden states into hidden states; this module
owns the rest of the step: embedding (with its adapter seam), the blocks, final norm, head.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import numpy as np
import torch
from tqdm import tqdm

from graftlm.config import ModelConfig
from graftlm.errors import ModelFileError
from graftlm.gguf import GGUFFile, TensorEntry
from graftlm.lora.site import LoraSite
from graftlm.lora.targets import SeamTable
from graftlm.models.fused import FusedLayer, FusedStack, LayerSpec, ScaleBoard
from graftlm.models.primitives import Rope, attention, rms_norm
from graftlm.models.seam import Projection, ProjectionGroup
from graftlm.native import library as native_library
from graftlm.native import ops as native_ops
from graftlm.native.abi import Scratch
from graftlm.native.build import loaded_library
from graftlm.quant import QWeight, dequantize_any
from graftlm.quant.base import release_pages
from graftlm.step.batch import Batch
from graftlm.step.kv_cache import KVCache


class Weights:
    """Typed access to a GGUF file's tensors, with errors that name the missing tensor.

    Every projection it builds is entered in `seams` (the model's table; set by Transformer)."""

    def __init__(self, file: GGUFFile, prefer: str = "fast", progress: bool = False) -> None:
        self.file = file
        self.prefer = prefer
        self.used: set[str] = set()
        self.seams: SeamTable | None = None
        self.bar = (
            tqdm(total=len(file.tensors), desc="loading", unit="tensor", leave=False)
            if progress
            else None
        )

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def _entry(self, name: str) -> TensorEntry:
        try:
            entry = self.file.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.file.path}: missing tensor {name!r}") from None
        if name not in self.used:  # (the bar counts each tensor once)
            self.used.add(name)
            if self.bar is not None:
                self.bar.update(1)
        return entry

    def vector(self, name: str, n: int | None = None) -> torch.Tensor:
        """A 1-D tensor (a norm, a bias) as float32; n: the length it must have."""
        e = self._entry(name)
        try:
            v = dequantize_any(e.data, e.ggml_type, e.shape).reshape(-1)
        except (ValueError, NotImplementedError) as exc:
            raise ModelFileError(f"{self.file.path}: tensor {name!r}: {exc}") from None
        if n is not None and v.numel() != n:
            raise ModelFileError(
                f"{self.file.path}: tensor {name!r} has {v.numel()} values (shape "
                f"{list(e.shape)}), expected {n}"
            )
        return v

    def entry(self, name: str, shape: tuple[int, ...], order: str = "") -> TensorEntry:
        """Tensor `name`, which must have this shape (torch order; `order` names its axes in
        the message), marked used."""
        e = self._entry(name)
        if tuple(e.shape) != shape:
            raise ModelFileError(
                f"{self.file.path}: tensor {name!r} has shape {list(e.shape)}, expected "
                f"{list(shape)}" + (f" {order}" if order else "")
            )
        return e

    def matrix(self, name: str, shape: tuple[int, int]) -> QWeight:
        e = self.entry(name, shape)
        return self.qweight(e, e.data, shape, name)

    def qweight(self, e: TensorEntry, data: Any, shape: tuple[int, int], name: str) -> QWeight:
        """`data` (all of e's bytes, or a part of them) as a weight of this shape."""
        try:
            return QWeight.from_gguf(data, e.ggml_type, shape, name=name, prefer=self.prefer)
        except NotImplementedError:
            raise ModelFileError(
                f"{self.file.path}: tensor {e.name!r} is of type {e.ggml_type.name}, which no "
                "kernel computes with (integer tensors are not weights)"
            ) from None

    def proj(self, base: str, n_in: int, n_out: int) -> Projection:
        return self.seam(Projection(base, self.matrix(base + ".weight", (n_out, n_in))))

    def seam(self, p: Projection) -> Projection:
        """p, entered in the model's seam table."""
        assert self.seams is not None, "the model sets Weights.seams before building projections"
        self.seams.projections[p.name] = p
        return p

    def attn_qkv(self, cfg: ModelConfig, i: int) -> ProjectionGroup:
        """Q, K and V of block i over the normed input (stacked where the types allow)."""
        p = f"blk.{i}."
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        parts = [
            (p + "attn_q", q),
            (p + "attn_k", kv),
            (p + "attn_v", cfg.n_head_kv * cfg.v_head_dim),
        ]
        return self.group(p + "attn_qkv", parts, cfg.n_embd)

    def ffn_gate_up(self, cfg: ModelConfig, i: int) -> ProjectionGroup:
        """The gate and up projections of block i's gated FFN."""
        p = f"blk.{i}."
        return self.group(
            p + "ffn_gate_up", [(p + "ffn_gate", cfg.n_ff), (p + "ffn_up", cfg.n_ff)], cfg.n_embd
        )

    def group(self, fused: str, parts: list[tuple[str, int]], n_in: int) -> ProjectionGroup:
        """Projections over the same input, stacked into one weight named `fused` when the file
        holds them in one quantization type (rows of GGUF blocks concatenate exactly)."""
        names = [b for b, _ in parts]
        sizes = [n for _, n in parts]
        entries = [self._entry(b + ".weight") for b in names]
        for e, n in zip(entries, sizes, strict=True):
            if tuple(e.shape) != (n, n_in):
                raise ModelFileError(
                    f"{self.file.path}: tensor {e.name!r} has shape {list(e.shape)}, expected {[n, n_in]}"
                )
        if len({e.ggml_type for e in entries}) != 1:
            return ProjectionGroup(names, sizes, parts=[self.proj(b, n_in, n) for b, n in parts])
        assert self.seams is not None
        data = np.concatenate([np.asarray(e.data) for e in entries], axis=0)
        weight = self.qweight(entries[0], data, (sum(sizes), n_in), fused + ".weight")
        for e in entries:
            release_pages(e.data)  # the stacked copy replaces the mapped pages
        group = ProjectionGroup(names, sizes, fused=self.seam(Projection(fused, weight)))
        self.seams.parts.update(group.targets())
        return group


class Transformer:
    """A decoder-only model. Subclasses build `self.blocks` and implement `block`."""

    arch: ClassVar[str]
    blocks: list[Any]  # one object per layer, built by the architecture

    def __init__(self, cfg: ModelConfig, w: Weights, n_ctx: int) -> None:
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.device = torch.device("cpu")  # built here; `to` moves it
        self.base_tensor_names = set(w.file.tensors)
        # every place an adapter can attach, entered as the weights load
        self.seams = w.seams = SeamTable(cfg.n_vocab, cfg.n_embd)
        self.token_embd = w.matrix("token_embd.weight", (cfg.n_vocab, cfg.n_embd))
        self.output_norm = w.vector("output_norm.weight", cfg.n_embd)
        if cfg.tied_head:
            # Tied: the head reads the embedding table; an adapter on the embedding changes the
            # lookup only (as PEFT does), so the head gets its own seam over the same weight.
            self.output = w.seam(Projection("output", self.token_embd))
        else:
            self.output = w.proj("output", cfg.n_embd, cfg.n_vocab)
        ropes: dict[float, Rope] = {}
        for base in set(cfg.rope_base_layer):
            ropes[base] = Rope(cfg.rope_dim, base, n_ctx, cfg.rope_neox)
        self.rope_of_layer = [ropes[b] for b in cfg.rope_base_layer]
        self.cache: KVCache | None = None
        # layer -> (the cache it was bound to, its one-call native decode step or None)
        self._fused: dict[int, tuple[int, FusedLayer | None]] = {}
        self._stack: list[FusedStack | None] = []  # [] unknown, [None] some layer has none
        self._scale_board: ScaleBoard | None = None  # made with the first native layer (CPU)
        self._moe_scratch: Scratch | None = None  # every layer's routed_ffn's buffers, in turn

    # -- adapter seams -------------------------------------------------------------------------
    def projections(self) -> dict[str, Projection]:
        """Every projection by its GGUF base name ("blk.0.attn_q", "output")."""
        return cast(dict[str, Projection], dict(self.seams.projections))

    @property
    def embd_lora(self) -> LoraSite | None:
        """The adapter slots on the token embedding (None while no adapter has one)."""
        return self.seams.embedding

    # -- the device ------------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> Transformer:
        """Move the model to `device`, in place (returns self): every weight (off the CPU a dense
        bfloat16 copy, see QWeight.to), every vector of the blocks, the final norm, the RoPE
        tables, the attached adapters' factors, and the KV cache (allocated afresh: empty).

        A weight shared by two projections (a tied head) stays one weight. The CPU-only pieces
        (native kernels, the native decode layer) are simply not used off the CPU: their checks
        see the device."""
        dev = torch.device(device)
        if dev == self.device:
            return self
        # id -> (the object, moved): shared weights and RoPEs move once; holding the object keeps
        # its id from being reused by a new one before the move ends
        moved: dict[int, tuple[Any, Any]] = {}

        def move(v: Any) -> Any:
            if v is None or isinstance(v, (bool, int, float, str)):
                return v
            key = id(v)
            if key not in moved:
                if isinstance(v, Projection):
                    v.weight = move(v.weight)
                    if v.lora is not None:
                        v.lora.to(dev)
                    out: Any = v
                elif isinstance(v, ProjectionGroup):
                    for p in v.projections():
                        move(p)
                    out = v
                elif isinstance(v, list):
                    out = [move(x) for x in v]
                elif isinstance(v, (torch.Tensor, QWeight)) or callable(getattr(v, "to", None)):
                    out = v.to(dev)  # tensors, weights, Rope, Experts, LoraSite
                else:
                    raise TypeError(f"{type(self).__name__}.to: cannot move a {type(v).__name__}")
                moved[key] = (v, out)
            return moved[key][1]

        self.token_embd = move(self.token_embd)
        self.output = move(self.output)
        self.output_norm = move(self.output_norm)
        self.rope_of_layer = move(self.rope_of_layer)
        if self.embd_lora is not None:
            self.embd_lora.to(dev)
        for blk in self.blocks:
            for name, v in list(vars(blk).items()):
                setattr(blk, name, move(v))
        self.device = dev
        if self.cache is not None:  # (also unbinds the native layers, which point into it)
            c = self.cache
            self.allocate_cache(c.n_slots, c.n_blocks, c.dtype)
        return self

    # -- the step --------------------------------------------------------------------------------
    def allocate_cache(
        self, n_slots: int, n_blocks: int | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A paged KV cache of n_slots sequences of this model's context, in n_blocks blocks
        (default: every slot's whole context) of `dtype` (default: the last cache's, at first
        float16)."""
        cfg = self.cfg
        if dtype is None:
            dtype = self.cache.dtype if self.cache is not None else torch.float16
        self.cache = None  # (the old pool goes before the new one is made)
        self._fused, self._stack = {}, []
        self.cache = KVCache(
            cfg.n_layer,
            n_slots,
            cfg.n_head_kv,
            self.n_ctx,
            cfg.head_dim,
            cfg.v_head_dim,
            dtype=dtype,
            device=self.device,
            n_blocks=n_blocks,
        )
        self._fused, self._stack = {}, []  # native layers point into the old cache: bind again
        return self.cache

    def embed(self, batch: Batch) -> torch.Tensor:
        tokens = batch.tokens
        x = self.token_embd.rows(tokens.reshape(-1)).view(*tokens.shape, -1)  # (B, T, n_embd)
        if self.embd_lora is not None and batch.lora is not None:
            x = self.embd_lora.add_delta(x, tokens, batch.lora)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        return x

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer i composed in PyTorch (the twin of the native layer, which `forward` tries
        first)."""
        raise NotImplementedError

    # -- the native decode step of a layer ------------------------------------------------------
    def layer_spec(self, i: int) -> LayerSpec | None:
        """Layer i's pieces for the one-call native decode step (graftlm.native.layer_calls), or None
        for a family (or a layer) it does not serve."""
        return None

    def fused_layer(self, i: int) -> FusedLayer | None:
        """Layer i's native decode step bound to the current KV cache, or None."""
        if self.cache is None:
            return None
        kc = self.cache.k[i]
        known = self._fused.get(i)
        if known is not None and known[0] == kc.data_ptr():  # (allocate_cache also clears them)
            return known[1]
        cfg = self.cfg
        spec = self.layer_spec(i) if native_library() is not None else None
        fused = None
        if (
            spec is not None
            and spec.servable()
            and cfg.v_head_dim == cfg.head_dim
            and native_ops.decode_head_dims(cfg.head_dim, cfg.v_head_dim)
            and kc.device.type == "cpu"
            and kc.is_contiguous()
        ):
            dims = {
                "n_embd": cfg.n_embd,
                "n_head": cfg.n_head,
                "n_head_kv": cfg.n_head_kv,
                "head_dim": cfg.head_dim,
                "n_ff": cfg.n_ff,
                "window": cfg.sliding_window[i],
            }
            if self._scale_board is None:
                self._scale_board = ScaleBoard(self.seams.generation)
            rope, board = self.rope_of_layer[i], self._scale_board
            fused = FusedLayer(spec, self.cache, i, rope, dims, cfg.rms_eps, cfg.scale, board)
        self._fused[i] = (kc.data_ptr(), fused)
        return fused

    def fused_stack(self) -> FusedStack | None:
        """Every layer's native decode step for one call over them all, or None when some layer
        has none (bound to the current cache; made once)."""
        if self.cache is None:
            return None
        if not self._stack:
            layers = [self.fused_layer(i) for i in range(self.cfg.n_layer)]
            full = [f for f in layers if f is not None]
            self._stack = [FusedStack(full) if full and len(full) == len(layers) else None]
        return self._stack[0]

    def native_layers(self, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Every layer in one native call when this step is a decode step they all serve."""
        stack = self.fused_stack()
        return None if stack is None else stack(x, batch)

    def native_block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Layer i in one native call when this step is a decode step it serves, else None."""
        fused = self.fused_layer(i)
        return None if fused is None else fused(x, batch)

    def native_routed_ffn(self, i: int, h: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Layer i's routed FFN of h (B, T, n_embd), normed, in native calls (a prompt's tokens:
        FusedLayer.routed_ffn) where its native layer serves the step, else None."""
        fused = self.fused_layer(i)
        if fused is None:
            return None
        if self._moe_scratch is None:
            self._moe_scratch = Scratch(loaded_library())
        return fused.routed_ffn(h, batch, self._moe_scratch)

    def attend(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: Batch,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer i's attention from its projected q, k, v (B, T, n * head_dim): heads split,
        optional per-head RMS norm (QK-norm), RoPE, the cache, optional sinks (n_head,: see
        primitives.attention). -> (B, T, n_head * v_head_dim)."""
        cfg = self.cfg
        B, T, _ = q.shape
        q = q.view(B, T, cfg.n_head, cfg.head_dim)
        k = k.view(B, T, cfg.n_head_kv, cfg.head_dim)
        v = v.view(B, T, cfg.n_head_kv, cfg.v_head_dim)
        if q_norm is not None and k_norm is not None:
            q, k = rms_norm(q, q_norm, cfg.rms_eps), rms_norm(k, k_norm, cfg.rms_eps)
        rope = self.rope_of_layer[i]
        assert self.cache is not None
        rows = batch.decode_rows()
        if rows is not None:  # one new token per row: the native step, when it can serve it
            out = native_ops.attn_decode(
                q.view(B, T, -1), k.view(B, T, -1), v.view(B, T, -1),
                self.cache, i, rows.slots, rows.starts, rope.cos, rope.sin,
                rope.neox, cfg.scale, cfg.sliding_window[i],
                bounds=(rows.max_slot, rows.max_start), sinks=sinks,
            )  # fmt: skip
            if out is not None:
                return out
        q, k = rope(q, batch.positions), rope(k, batch.positions)
        window = cfg.sliding_window[i]
        return attention(q, k, v, i, batch, self.cache, cfg.scale, window, sinks=sinks)

    def forward(self, batch: Batch, all_logits: bool = False, hidden: bool = False) -> torch.Tensor:
        """Logits (B, T, n_vocab) with all_logits, else (B, n_vocab) at each row's last real token.
        hidden: the final-norm hidden states (B, T, n_embd) instead (embeddings). A packed batch
        (Batch.packed, B sequences) gives (B, n_vocab) at each sequence's last token."""
        assert self.cache is not None, "allocate_cache() first"
        packing = batch.packing
        assert packing is None or not (all_logits or hidden), (
            f"a packed batch gives last logits only (all_logits={all_logits}, hidden={hidden})"
        )
        x = self.embed(batch)
        y = self.native_layers(x, batch)
        if y is not None:
            x = y
        else:  # each layer natively when it serves the step, else its family's composed block
            for i in range(self.cfg.n_layer):
                y = self.native_block(i, x, batch)
                x = y if y is not None else self.block(i, x, batch)
        if hidden:
            return rms_norm(x, self.output_norm, self.cfg.rms_eps)  # (B, T, n_embd)
        if not all_logits:
            x = x[batch.last_tokens].unsqueeze(1)  # (B, 1, n_embd)
        x = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        # (packed: the B last tokens with their sequences' scale rows)
        logits = self.output(x, batch if packing is None else packing.head)
        return logits if all_logits else logits[:, 0]

    @property
    def nbytes(self) -> int:
        total = self.token_embd.nbytes + self.output_norm.numel() * 4
        if not self.cfg.tied_head:
            total += self.output.weight.nbytes
        for blk in self.blocks:
            for v in vars(blk).values():
                if isinstance(v, ProjectionGroup):
                    total += sum(p.weight.nbytes for p in v.projections())
                elif isinstance(v, Projection):
                    total += v.weight.nbytes
                elif isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total
