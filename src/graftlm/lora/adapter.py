"""An adapter resolved against one base: per-projection A and B, ready to attach.

Whatever the source (llama.cpp's GGUF adapter, a PEFT directory), an adapter becomes a
`ResolvedAdapter` before anything is attached: every name mapped to the base's projections, every
layout turned to torch order, every per-tensor factor (alpha / r, rsLoRA, patterns) folded into B.
The hot path sees only A, B and the user's scale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from graftlm.lora.packed import PackedSlot

from graftlm.errors import AdapterError

EMBEDDING = "token_embd"


def refusal(head: str, problems: list[str]) -> AdapterError:
    """`head`, then every problem on a line of its own (the CLI shows the first few)."""
    lines = [head if problems else head.rstrip(":"), *(f"  - {p}" for p in problems)]
    return AdapterError("\n".join(lines))


def hidden_size(shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The model width an adapter was made for: the input size of its first attn_q/q_proj A,
    given as {name: torch shape (r, n_in)}."""
    for name, shape in sorted(shapes.items()):
        if ("attn_q." in name or "q_proj." in name) and len(shape) == 2:
            return int(shape[1])
    return None


class Delta:
    """One target's low-rank pair, factor folded in.

    Projection: a (r, n_in), b (n_out, r): delta = b @ (a @ x).
    Embedding (EMBEDDING target): a (n_vocab, r), b (n_embd, r): delta = b @ a[token].

    Once packed (`hold`, AdapterSet.load) the native form is the pair's only copy: `a` and `b`
    are read back from it in float32 on each use (lora.site's one-form rule)."""

    __slots__ = ("_a", "_b", "parts", "packed", "sources")

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        parts: tuple[int, ...] = (),
        packed: PackedSlot | None = None,
        sources: tuple[str, ...] = (),
    ) -> None:
        self._a: torch.Tensor | None = a
        self._b: torch.Tensor | None = b
        # ranks of the file tensors stacked into this delta (several when Q/K/V share a
        # projection)
        self.parts = parts
        # the native form, packed with the read, off the engine's thread (AdapterSet.load);
        # None: the factors are kept (no native form: off the CPU, no library, the embedding)
        self.packed = packed
        # the file's names of what it holds (GGUF tensors, PEFT modules), for messages
        self.sources = sources
        if packed is not None:
            self.hold(packed)

    def hold(self, packed: PackedSlot | None) -> None:
        """Keep `packed` (when not None) as the pair's one form, the float32 factors let go."""
        self.packed = packed
        if packed is not None:
            self._a = self._b = None

    @property
    def a(self) -> torch.Tensor:
        if self._a is not None:
            return self._a
        assert self.packed is not None
        return self.packed.a_dense()

    @a.setter
    def a(self, value: torch.Tensor) -> None:
        assert self.packed is None, "the factors of a packed delta are its packed form's"
        self._a = value

    @property
    def b(self) -> torch.Tensor:
        if self._b is not None:
            return self._b
        assert self.packed is not None
        return self.packed.b_dense()

    @b.setter
    def b(self, value: torch.Tensor) -> None:
        assert self.packed is None, "the factors of a packed delta are its packed form's"
        self._b = value

    @property
    def width(self) -> int:
        """Columns of B: the sum of the stacked ranks."""
        if self._b is not None:
            return int(self._b.shape[1])
        assert self.packed is not None
        return self.packed.r

    @property
    def rank(self) -> int:
        """The largest rank of a file tensor in this delta (what --max-lora-rank limits)."""
        return max(self.parts) if self.parts else self.width

    @property
    def nbytes(self) -> int:
        """The bytes it holds: its packed form where it has one, else the float32 factors
        (the twin's)."""
        if self.packed is not None:
            return self.packed.nbytes
        a, b = self.a, self.b
        return a.numel() * a.element_size() + b.numel() * b.element_size()


@dataclass
class ResolvedAdapter:
    path: str
    alpha: float  # as the file states it (0: none); informational once folded
    deltas: dict[str, Delta]  # keyed by the engine's projection name, or EMBEDDING
    n_tensors: int  # tensors in the source file
    task_name: str = ""
    prompt_prefix: str = ""
    invocation_tokens: list[int] = field(default_factory=list)
    source: str = "gguf"  # "gguf" or "peft"
    # each delta's reach (check_values'): its largest output on an input of +-1 values at
    # scale 1; the embedding's, a bound on the delta of any token's row
    reaches: dict[str, float] = field(default_factory=dict)
    # the output rows [lo, hi) each projection's delta reaches (first to last not 0 on the
    # reach's input: a Q-only delta on a fused QKV projection reaches Q's); absent: all of them
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.deltas.values())

    @property
    def reach(self) -> float:
        """The largest reach of its deltas: a global scale past F16_MAX / reach overflows."""
        return max(self.reaches.values(), default=0.0)

    def check_values(self) -> None:
        """Refuse factors that would break every use: inf or nan, or a delta whose output on an
        input of +-1 values (about the scale of a normalized activation) leaves float16's range,
        where the KV cache and the activations overflow (alpha / r folded in). A file whose
        declared alignment does not match where its writer put the data reads as such values.
        Each file tensor (a part of a stacked delta) is checked and named on its own. Keeps
        each delta's reach (`reaches`): a global scale past F16_MAX / reach overflows every use,
        and adapters at global scales overflow together where their reaches' sum does."""
        within = _all_within(self.deltas)
        if within is not None:
            self.reaches, self.rows = within
            return
        problems = []
        for name, d in sorted(self.deltas.items()):
            reach = _reach(d.a, d.b, name == EMBEDDING)
            if reach <= F16_MAX:  # nan and inf fail it too
                self.reaches[name] = reach
                continue
            for where, a, b in _pieces(name, d):
                a, b = a.double(), b.double()
                bad = int(a.numel() - torch.isfinite(a).sum() + b.numel() - torch.isfinite(b).sum())
                if bad:
                    s = "s are" if bad > 1 else " is"
                    problems.append(f"{where}: {bad} value{s} inf or nan")
                    continue
                reach = _reach(a, b, name == EMBEDDING)
                if reach > F16_MAX:
                    problems.append(
                        f"{where}: its delta reaches {reach:.3g} on an input of +-1 values, past "
                        f"float16's range ({F16_MAX:g}; A {list(a.shape)}, B {list(b.shape)} "
                        "with alpha / r folded in)"
                    )
        if problems:
            raise refusal(
                f"adapter {self.path}: factors with which every use would overflow:", problems
            )


def _all_within(
    deltas: dict[str, Delta],
) -> tuple[dict[str, float], dict[str, tuple[int, int]]] | None:
    """The reach of each delta and the output rows it reaches (`ResolvedAdapter.rows`) where
    every projection's delta is clearly within check_values' limit, else None: their reaches
    computed together, the deltas of one shape as one batched product (a few tensor operations
    an adapter, not a few a projection), with a margin for the batched sums' other rounding.
    None sends check_values to its exact per-delta test (which keeps no rows: all of them)."""
    groups: dict[tuple[int, ...], list[tuple[str, Delta]]] = {}
    for name, d in deltas.items():
        if name == EMBEDDING or d.a.dtype != d.b.dtype:
            return None
        groups.setdefault((*d.a.shape, *d.b.shape), []).append((name, d))
    out: dict[str, float] = {}
    rows: dict[str, tuple[int, int]] = {}
    for group in groups.values():
        a, b = torch.stack([d.a for _, d in group]), torch.stack([d.b for _, d in group])
        if not a.numel() or not b.numel():
            out.update((name, 0.0) for name, _ in group)
            continue
        x = _signs(a.shape[2], a.dtype).expand(a.shape[0], -1).unsqueeze(2)  # (G, n_in, 1)
        y = torch.bmm(b, torch.bmm(a, x)).squeeze(2).abs()  # (G, n_out)
        reach = y.amax(dim=1)  # (G,)
        if not float(reach.max()) <= F16_MAX * 0.999:  # nan and inf fail it too
            return None
        out.update(zip((name for name, _ in group), reach.tolist(), strict=True))
        # the rows each reaches on that input (a row it leaves at 0 there adds nothing to a sum)
        touched = (y != 0).to(torch.int8)  # (G, n_out)
        first = touched.argmax(dim=1).tolist()  # (0 for a delta that reaches no row)
        last = (touched.shape[1] - touched.flip(1).argmax(dim=1)).tolist()
        for (name, _), lo, hi, some in zip(group, first, last, reach.tolist(), strict=True):
            rows[name] = (int(lo), int(hi)) if some > 0 else (0, 0)
    return out, rows


def _pieces(name: str, d: Delta) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A delta's parts as the file held them: (its name, A rows, B columns)."""
    ranks = d.parts or (d.width,)
    if len(d.sources) != len(ranks):
        return [(name, d.a, d.b)]
    out, at = [], 0
    embedding = name == EMBEDDING
    for source, r in zip(d.sources, ranks, strict=True):
        a = d.a[:, at : at + r] if embedding else d.a[at : at + r]
        out.append((f"{source} (in {name})" if source != name else name, a, d.b[:, at : at + r]))
        at += r
    return out


F16_MAX = 65504.0


def _reach(a: torch.Tensor, b: torch.Tensor, embedding: bool) -> float:
    """The largest output of a delta on a fixed input of +-1 values (a projection), or a bound
    on any token's row (the embedding, A (n_vocab, r), B (n_embd, r): token t's row is
    B @ A[t], each of its values at most sum over r of |A[t, r]| max |B[:, r]|; the largest
    over the tokens), in the factors' type (an overflow in float32 reads as inf: past the limit
    either way)."""
    if not a.numel() or not b.numel():
        return 0.0
    if embedding:
        return float((a.abs() @ b.abs().amax(dim=0)).max())  # (n_vocab,) bounds: the largest
    return float((b @ (a @ _signs(a.shape[1], a.dtype))).abs().max())


@functools.lru_cache(maxsize=64)
def _signs(n: int, dtype: torch.dtype) -> torch.Tensor:
    """n fixed pseudo-random values of +-1."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(dtype)
