"""A decoder layer's decode step as one native call, and a model's layers as one call.

The PyTorch blocks compose the same native pieces (RMS norm, the quantized products through the
projection seam, each projection's LoRA delta, RoPE + attention through the cache, the gate) one
Python call at a time; at one token per row, those calls cost more than the arithmetic.
``FusedLayer`` binds a block's weights, norms, cache and RoPE tables once into the C struct and
runs the whole layer in C (``gl_layer_decode``); ``FusedStack`` runs every layer of the model in
one call (``gl_layers_decode``). The composed blocks are their twin. Each serves only what it was
built for and says so by returning None: the caller then runs the layers one call each, or the
PyTorch blocks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from graftlm.lora.packed import SlotTable
from graftlm.lora.site import Generation, LoraSite
from graftlm.models.seam import Projection, ProjectionGroup
from graftlm.native import build as native_build
from graftlm.native import layer_calls as native_layer
from graftlm.native import library
from graftlm.native.abi import GlLayer, GlLoraSite, GlWeight, Scratch
from graftlm.native.build import loaded_library
from graftlm.native.layer_calls import ACTS, GATINGS
from graftlm.native.ops import gl_kv
from graftlm.quant import QWeight

# experts a token that the native routed FFN serves (csrc/graftlm.h's GL_MAX_EXPERTS_USED)
MAX_EXPERTS_USED = 16
# tokens a native call of a prompt's routed FFN (FusedLayer.routed_ffn) takes: as many as its
# buffers (every (token, expert) pair's rows, gl_moe_bytes: 234 KiB a token for Qwen3-30B-A3B,
# about 440 KiB Mixtral-8x7B) hold in MOE_SCRATCH_BYTES, at least MOE_MIN_ROWS, at most
# MOE_ROWS; the model keeps that scratch for its life (base.py's _moe_scratch). 128 MiB keeps
# Qwen3-30B-A3B's 512-token chunk in one call (at 64 MiB it took two, each expert's weights read
# twice: pp512 0.95x, bench/moe_budget_ab.py), under 1% of such a model's weights
MOE_ROWS = 512
MOE_MIN_ROWS = 16
MOE_SCRATCH_BYTES = 128 << 20


def native_routed_ffn_env() -> bool:
    """GRAFTLM_NATIVE_MOE_PROMPT=0 (or off, no, false, as GRAFTLM_NATIVE): a prompt's routed FFN
    composed from Python (the twin; A/B)."""
    return not native_build.switched_off("GRAFTLM_NATIVE_MOE_PROMPT")


NATIVE_ROUTED_FFN = native_routed_ffn_env()

if TYPE_CHECKING:
    from graftlm.models.primitives import Rope
    from graftlm.step.batch import Batch, LoraRows, RowIndex
    from graftlm.step.kv_cache import KVCache


@dataclass
class LayerSpec:
    """What a family's block hands the native layer: its projections and vectors."""

    qkv: list[Projection]  # one stacked projection, or Q, K, V
    o: Projection
    gate_up: Projection | None  # stacked gate/up (None: a routed FFN, `moe`)
    down: Projection | None
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    act: str = "silu"
    q_norm: torch.Tensor | None = None  # per-head RMS norms before RoPE
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # RMS norms of the outputs, before the residual
    post_ffw_norm: torch.Tensor | None = None
    q_bias: torch.Tensor | None = None  # added to the products (qwen2), outside the adapters
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    softcap: float = 0.0  # gemma-2: cap * tanh(score / cap) on the attention scores
    moe: MoeSpec | None = None  # a routed FFN in place of gate_up / down
    sinks: torch.Tensor | None = None  # gpt-oss: (n_head,) logits in the softmax, no value

    @classmethod
    def of(
        cls,
        qkv: ProjectionGroup,
        o: Projection,
        gate_up: ProjectionGroup,
        down: Projection,
        attn_norm: torch.Tensor,
        ffn_norm: torch.Tensor,
        **extra: Any,
    ) -> LayerSpec | None:
        """The spec of a block whose Q/K/V and gate/up are the loader's groups, or None when
        gate and up could not be stacked (the layer takes them as one weight)."""
        if gate_up.fused is None:
            return None
        return cls(qkv.projections(), o, gate_up.fused, down, attn_norm, ffn_norm, **extra)

    def projections(self) -> list[Projection]:
        """The projections with adapter sites, in the struct's order of sites."""
        if self.moe is not None:
            return [*self.qkv, self.o]  # (+ the router: its site bound apart)
        assert self.gate_up is not None and self.down is not None
        return [*self.qkv, self.o, self.gate_up, self.down]

    def servable(self) -> bool:
        vectors = [self.attn_norm, self.ffn_norm, self.q_norm, self.k_norm,
                   self.post_attn_norm, self.post_ffw_norm,
                   self.q_bias, self.k_bias, self.v_bias, self.o_bias, self.sinks]  # fmt: skip
        if self.moe is not None:
            vectors += [self.moe.router_bias, self.moe.gate_up_bias, self.moe.down_bias]
        return (
            len(self.qkv) in (1, 3)
            and self.act in ACTS
            and all(p.weight.native() is not None for p in self.projections())
            and (self.moe is None or self.moe.servable())
            and all(
                v is None
                or (v.dtype == torch.float32 and v.is_contiguous() and v.device.type == "cpu")
                for v in vectors
            )
        )


class ExpertSite(Protocol):
    """One routed expert's weight as its adapters are attached to it (moe.py's ExpertSeam)."""

    lora: LoraSite | None


@dataclass
class MoeSpec:
    """A routed FFN for the native layer: the router projection and every expert's stacked
    [gate; up] and down weights (moe.py's GatedExperts and Experts); gpt-oss's biases (added to
    the router's logits, to each expert's [gate; up] and down products) and gating
    ("softmax_norm": the softmax of every logit at the chosen, over their sum; "softmax_chosen":
    the softmax of the chosen logits)."""

    router: Projection
    gate_up: list[QWeight]
    down: list[QWeight]
    n_used: int
    router_bias: torch.Tensor | None = None  # (n_expert,)
    gate_up_bias: torch.Tensor | None = None  # (n_expert, 2 n_ff)
    down_bias: torch.Tensor | None = None  # (n_expert, n_embd)
    gating: str = "softmax_norm"
    # every expert's seam of [gate; up] and of down (moe.py's), whose adapters the native layer
    # adds (each expert's packed slots, bound as the projections' are); None: no adapters on the
    # experts
    seams: tuple[Sequence[ExpertSite], Sequence[ExpertSite]] | None = None

    def servable(self) -> bool:
        n = len(self.gate_up)
        shapes = [(self.router_bias, n), (self.gate_up_bias, n * self.gate_up[0].shape[0]),
                  (self.down_bias, n * self.down[0].shape[0])] if n else []  # fmt: skip
        return (
            0 < self.n_used <= min(n, MAX_EXPERTS_USED)
            and self.gating in GATINGS
            and all(b is None or b.numel() == size for b, size in shapes)
            # the composed block's own product (GGUF routers are F32: csrc/float.c's), so both
            # route every row to the same experts, near ties included
            and self.router.weight.native() is not None
            and len(self.gate_up) == len(self.down)
            and all(w.native() is not None for w in [*self.gate_up, *self.down])
        )

    def arrays(self) -> tuple[ctypes.Array[GlWeight], ctypes.Array[GlWeight]]:
        """The experts' weights as two C arrays of gl_weight (kept alive by the caller)."""
        n = len(self.gate_up)
        gate_up = (GlWeight * n)(*[w.native() for w in self.gate_up])
        down = (GlWeight * n)(*[w.native() for w in self.down])
        return gate_up, down


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class ScaleBoard:
    """The current decode step's adapter scales, in one buffer that stays where it is.

    One per model. Every native layer's sites read their rows' scales from it (row b's scale of
    adapter s at [b, s]): they bind its address once, and each step copies the batch's scale
    table into it once for all layers (`fill`). It grows (and the layers rebind) only when an
    adapter's id passes its width. Rebinding ctypes fields per layer every step cost about as
    much as the adapter's arithmetic (7 us a layer).
    """

    def __init__(self, adapters: Generation) -> None:
        self.adapters = adapters  # the model's: changes whenever any of its slots do
        self.buf = torch.zeros(1, 8, dtype=torch.float32)  # grown by fill
        self.generation = 0  # bumped when the buffer is replaced: bound addresses are stale
        self._filled: LoraRows | None = None
        self._clear = True  # the buffer holds zeros

    @property
    def key(self) -> tuple[int, int]:
        """What a layer's binding depends on: (adapter generation, board generation)."""
        return (self.adapters.value, self.generation)

    def fill(self, lora: LoraRows | None, rows: int) -> None:
        """This step's scales for its `rows` rows (lora None: every adapter at 0), once a step;
        grows the buffer first when the rows or an adapter's id pass it (the kernels read a
        scale for every row of every attached adapter)."""
        if lora is not None and lora is self._filled:
            return
        self._put(None if lora is None else lora.scales, rows)
        self._filled = lora

    def fill_tokens(self, scales: torch.Tensor | None, rows: int) -> None:
        """`rows` tokens' scales (rows, n_slots), a row each (None: every adapter at 0): a
        routed FFN's call over a prompt's tokens (FusedLayer.routed_ffn); the next step's fill
        copies its own again."""
        self._put(scales, rows)
        self._filled = None

    def _put(self, scales: torch.Tensor | None, rows: int) -> None:
        b, n = (rows, 0) if scales is None else scales.shape
        if b > self.buf.shape[0] or n > self.buf.shape[1]:
            cols = max(n, 2 * self.buf.shape[1]) if n > self.buf.shape[1] else self.buf.shape[1]
            self.buf = torch.zeros(max(b, self.buf.shape[0]), cols, dtype=torch.float32)
            self.generation += 1
        elif not self._clear:
            self.buf.zero_()
        self._clear = scales is None
        if scales is not None:
            self.buf[:b, :n] = scales


class FusedLayer:
    """A decoder layer (see LayerSpec) bound to the model's current KV cache."""

    def __init__(
        self,
        spec: LayerSpec,
        cache: KVCache,
        index: int,
        rope: Rope,
        dims: dict[str, int],
        eps: float,
        scale: float,
        board: ScaleBoard,
    ) -> None:
        self.spec = spec
        self.board = board
        self.sites = spec.projections() + ([spec.moe.router] if spec.moe is not None else [])
        kv = gl_kv(cache, index)
        if kv is None:
            raise ValueError("the native decode layer needs a contiguous KV cache on the CPU")
        # everything the struct points into
        self.keep = (cache.k[index], cache.v[index], cache.tables, rope.cos, rope.sin)
        self.n_ctx = cache.n_ctx
        self.n_slots = cache.n_slots
        self.n_embd = dims["n_embd"]
        weights = [p.weight.native() for p in spec.qkv]
        weights += [None] * (3 - len(weights))
        layer = GlLayer()
        for i, w in enumerate(weights):
            if w is not None:
                layer.qkv[i] = w
        layer.o = spec.o.weight.native()
        self.experts: tuple[ctypes.Array[GlWeight], ctypes.Array[GlWeight]] | None = None
        if spec.moe is not None:
            self._moe_fields(layer, spec.moe)
        else:
            assert spec.gate_up is not None and spec.down is not None
            layer.gate_up, layer.down = spec.gate_up.weight.native(), spec.down.weight.native()
        for name in (
            "attn_norm",
            "ffn_norm",
            "q_norm",
            "k_norm",
            "post_attn_norm",
            "post_ffw_norm",
            "q_bias",
            "k_bias",
            "v_bias",
            "o_bias",
        ):
            setattr(layer, name, _ptr(getattr(spec, name)))
        layer.kv = kv
        layer.cos_t, layer.sin_t = rope.cos.data_ptr(), rope.sin.data_ptr()
        layer.n_qkv = len(spec.qkv)
        for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "window"):
            setattr(layer, name, dims[name])
        layer.n_ctx = cache.max_blocks * cache.block  # (the scores a row can have)
        layer.rot, layer.neox = rope.cos.shape[-1] * 2, int(rope.neox)
        layer.act, layer.eps, layer.scale = ACTS[spec.act], eps, scale
        layer.softcap = spec.softcap
        layer.sinks = _ptr(spec.sinks)
        self.layer = layer
        # the experts' adapter sites, one an expert for [gate; up] and for down (pointed at by
        # the struct while some expert has an adapter)
        self.expert_seams = spec.moe.seams if spec.moe is not None else None
        self.expert_sites: list[ctypes.Array[GlLoraSite]] = []
        if self.expert_seams is not None:
            self.expert_sites = [(GlLoraSite * len(s))() for s in self.expert_seams]
        self.lora_fields = [layer.l_qkv[i] for i in range(len(spec.qkv))]
        tail = [layer.l_router] if spec.moe is not None else [layer.l_gate_up, layer.l_down]
        self.lora_fields += [layer.l_o, *tail]
        # the adapters bound into the struct: the board's key when they were
        self._bound: tuple[int, int] | None = None
        self._tables: list[SlotTable] = []  # kept alive: the struct points into them
        self._servable = True
        self.scratch = Scratch(loaded_library())  # the step's buffers, kept from step to step

    def _moe_fields(self, layer: GlLayer, moe: MoeSpec) -> None:
        """The routed FFN's fields: the router, every expert's weights (self.experts, which the
        struct points into), their biases and the gating."""
        layer.router = moe.router.weight.native()
        self.experts = moe.arrays()
        layer.exp_gate_up = ctypes.addressof(self.experts[0])
        layer.exp_down = ctypes.addressof(self.experts[1])
        layer.n_expert, layer.n_expert_used = len(moe.gate_up), moe.n_used
        layer.router_bias, layer.gating = _ptr(moe.router_bias), GATINGS[moe.gating]
        layer.exp_gate_up_bias = _ptr(moe.gate_up_bias)
        layer.exp_down_bias = _ptr(moe.down_bias)

    def bind_lora(self) -> bool:
        """Point the struct's LoRA fields at each site's table of packed adapters and at the
        board's scale buffer: once per change of the model's adapters or of the board, never
        per step (the kernels skip the adapters a step's rows have at scale 0). False when some
        site's adapters are not packed (the PyTorch block serves the layer)."""
        board = self.board
        if board.key != self._bound:
            self._tables, self._servable = [], True
            buf = board.buf
            for site, p in zip(self.lora_fields, self.sites, strict=True):
                site.n = 0  # no adapter here
                table = None if p.lora is None else p.lora.native()
                if p.lora is not None and table is None:
                    self._servable = False
                    continue
                if table is not None:
                    self._tables.append(table)
                    table.point(site, buf.data_ptr(), buf.shape[1])
            self._bind_experts()
            self._bound = board.key
        return self._servable

    def _bind_experts(self) -> None:
        """bind_lora's for the routed experts: each expert's site of [gate; up] and of down at
        its packed adapters, and the struct at the sites where some expert has any (NULL: the
        native layer reads none of them)."""
        if self.expert_seams is None:
            return
        buf = self.board.buf
        fields = ("l_exp_gate_up", "l_exp_down")
        for name, seams, sites in zip(fields, self.expert_seams, self.expert_sites, strict=True):
            adapted = False
            for seam, site in zip(seams, sites, strict=True):
                site.n = 0
                table = None if seam.lora is None else seam.lora.native()
                if seam.lora is not None and table is None:
                    self._servable = False
                elif table is not None:
                    self._tables.append(table)
                    table.point(site, buf.data_ptr(), buf.shape[1])
                    adapted = True
            setattr(self.layer, name, ctypes.addressof(sites) if adapted else None)

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """x (B, 1, n_embd) -> the layer's output, or None when this step is not for it."""
        rows = _decode_rows(x, batch, self.n_ctx, self.n_slots)
        if rows is None:
            return None
        self.board.fill(batch.lora, batch.n_rows)
        if not self.bind_lora():
            return None  # (an adapter the native delta cannot read: the PyTorch block runs)
        out = x.reshape(-1, self.n_embd).clone()
        native_layer.layer_decode(self.layer, out, rows.slots, rows.starts, self.scratch)
        return out.view(x.shape)

    def routed_ffn(self, h: torch.Tensor, batch: Batch, scratch: Scratch) -> torch.Tensor | None:
        """The routed FFN of h (B, T, n_embd), normed -> (B, T, n_embd), each token at its row's
        scales, in one native call a moe_rows() tokens (``gl_moe_ffn``: the router, the experts'
        products over the tokens grouped by expert and their adapters' delta, as a decode
        step's): the composed routed FFN's (moe.moe_ffn, gpt_oss.routed_ffn) twin on a fast
        step. None where it does not serve: an exact step, no routed FFN, an adapter the native
        delta cannot read, AMX tiles on (below). Its buffers come from `scratch` (the model's
        one for these calls)."""
        if (
            self.spec.moe is None
            or not NATIVE_ROUTED_FFN
            or batch.exact
            # Where AMX tiles serve prompts (build.amx()), the composed twin's expert products of
            # >= GRAFTLM_AMX_ROWS rows run on the tiles (proj.c's proj_run -> amx_tasks), while
            # moe_run's jobs take the int8 VNNI kernels only: slower on such a Xeon, and other
            # numerics (bfloat16 tiles against int8 dots). The real fix: moe_run sends an
            # expert's job of >= gl_amx_rows (token, expert) pairs to the tiles as proj_run does.
            or native_build.amx()
            or library() is None
            or h.dtype is not torch.float32
            or h.device.type != "cpu"
        ):
            return None
        b, t, d = h.shape
        x = h.reshape(b * t, d).contiguous()
        lora = batch.lora
        # (N, n_slots): each token its row's scales
        scales = None if lora is None else lora.scales.repeat_interleave(t, dim=0)
        out = torch.empty_like(x)
        if not self.bind_lora():  # (the adapters' ranks size the buffers: moe_rows)
            return None
        step = self.moe_rows()
        for r0 in range(0, b * t, step):
            r1 = min(r0 + step, b * t)
            self.board.fill_tokens(None if scales is None else scales[r0:r1], r1 - r0)
            if not self.bind_lora():
                return None
            native_layer.moe_ffn(self.layer, x[r0:r1], out[r0:r1], scratch)
        return out.view(b, t, d)

    def moe_rows(self) -> int:
        """Tokens a call of routed_ffn takes at the adapters bound now: as many as fit in
        MOE_SCRATCH_BYTES (128 MiB: all 512 tokens of Qwen3-30B-A3B, about 300 of Mixtral-8x7B),
        clamped to [MOE_MIN_ROWS, MOE_ROWS]."""
        per_token = -(-native_layer.moe_bytes(self.layer, MOE_ROWS) // MOE_ROWS)
        return min(MOE_ROWS, max(MOE_MIN_ROWS, MOE_SCRATCH_BYTES // max(per_token, 1)))


def _decode_rows(x: torch.Tensor, batch: Batch, n_ctx: int, n_slots: int) -> RowIndex | None:
    """The step's rows when the native layers serve it: the library loaded, one new token a row,
    a fast step (not exact), float32 x, and every (slot, position) inside the cache (the C code
    writes the cache there: never out of range)."""
    rows = batch.decode_rows()
    if (
        rows is None
        or batch.exact
        or library() is None
        or x.dtype is not torch.float32
        or rows.max_start >= n_ctx
        or rows.max_slot >= n_slots
    ):
        return None
    return rows


class FusedStack:
    """Every layer of a model, each a FusedLayer, run in one native call a decode step
    (``gl_layers_decode``): the per-layer Python between the calls cost about 10% of SmolLM2's
    step. A step some layer cannot serve (an adapter the native delta cannot read) is refused
    whole, and the layers run one call each, or in PyTorch."""

    def __init__(self, layers: list[FusedLayer]) -> None:
        self.layers = layers
        self.n_embd = layers[0].n_embd
        self.n_ctx = min(f.n_ctx for f in layers)
        self.n_slots = min(f.n_slots for f in layers)
        self._ptrs = (ctypes.c_void_p * len(layers))(*[ctypes.addressof(f.layer) for f in layers])
        self.scratch = Scratch(loaded_library())  # every layer's buffers, kept from step to step
        self.board = layers[0].board  # the model's, every layer's
        assert all(f.board is self.board for f in layers)
        # the board's key when every layer last bound its adapters, and whether all could
        self._bound: tuple[int, int] | None = None
        self._servable = True

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """x (B, 1, n_embd), the embeddings -> the last layer's output, or None."""
        rows = _decode_rows(x, batch, self.n_ctx, self.n_slots)
        if rows is None:
            return None
        self.board.fill(batch.lora, batch.n_rows)  # once for all the layers
        if self.board.key != self._bound:  # the adapters or the board changed: every layer binds
            self._servable = all([f.bind_lora() for f in self.layers])
            self._bound = self.board.key
        if not self._servable:
            return None
        out = x.reshape(-1, self.n_embd).clone()
        native_layer.layers_decode(self._ptrs, out, rows.slots, rows.starts, self.scratch)
        return out.view(x.shape)
