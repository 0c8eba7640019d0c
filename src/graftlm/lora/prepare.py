"""An adapter file read and checked against the base, before anything is attached.

`prepare_adapter` is the step a server runs off its engine's thread (a worker thread): the file
is read, mapped onto the base and packed, and every way it can fail becomes one AdapterError
that names the file. Attaching what it returns is the engine thread's (`EngineService.attach`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graftlm.errors import AdapterError, GraftError
from graftlm.lora.adapter import ResolvedAdapter
from graftlm.lora.adapter_set import AdapterSet


@dataclass(frozen=True)
class AdapterFacts:
    path: str
    nbytes: int
    rank: int
    alpha: float
    task_name: str
    prompt_prefix: str
    n_tensors: int
    invocation_tokens: tuple[int, ...] = ()  # activated LoRA's; () for a plain LoRA
    reach: float = 0.0  # ResolvedAdapter.reach: the largest delta output on +-1 inputs, scale 1
    # ResolvedAdapter.reaches: each projection's (and the embedding's) reach
    reaches: Mapping[str, float] = field(default_factory=dict, hash=False)
    # ResolvedAdapter.rows: the output rows [lo, hi) each projection's delta reaches
    rows: Mapping[str, tuple[int, int]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # (`together_overflow` settles the usual case on `reach` as the largest of `reaches`)
        if self.reaches and self.reach < max(self.reaches.values()):
            raise ValueError(
                f"{self.path}: reach {self.reach:g} below its largest projection's "
                f"{max(self.reaches.values()):g}"
            )

    @classmethod
    def of(cls, resolved: ResolvedAdapter) -> AdapterFacts:
        return cls(
            path=str(resolved.path),
            nbytes=int(resolved.nbytes),
            rank=max((d.rank for d in resolved.deltas.values()), default=0),
            alpha=float(resolved.alpha),
            task_name=resolved.task_name,
            prompt_prefix=resolved.prompt_prefix,
            n_tensors=resolved.n_tensors,
            invocation_tokens=tuple(resolved.invocation_tokens),
            reach=float(resolved.reach),
            reaches=dict(resolved.reaches),
            rows=dict(resolved.rows),
        )


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read and checked against the base, not attached yet."""

    facts: AdapterFacts
    resolved: ResolvedAdapter


def prepare_adapter(adapters: AdapterSet, path: str | Path) -> PreparedAdapter:
    """Read and check an adapter against the set's base (blocking: call it off the event loop).
    Nothing is attached; raises AdapterError when the file cannot be used."""
    p = Path(path)
    try:
        found = p.exists()
    except OSError as exc:  # a name too long, a path through a file
        raise AdapterError(f"{str(p)[:200]}: cannot be read ({exc.strerror})") from None
    if not found:
        raise AdapterError(f"{p}: no such file or directory")
    try:
        resolved = adapters.load(p)
    except ImportError as exc:
        raise AdapterError(f"{p}: this kind of adapter is not supported yet ({exc})") from None
    except GraftError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise AdapterError(f"{p}: cannot read the adapter ({exc})") from None
    return PreparedAdapter(AdapterFacts.of(resolved), resolved)


def rank_floor(path: str | Path) -> tuple[int, str]:
    """A bound from below on an adapter's rank, from its file's header alone (no factor is
    read), and the tensor that gives it: over its A factors, the largest of each one's smallest
    dimension (the rank is one of its dimensions); (0, "") where the header does not tell (the
    full read says why). An adapter whose floor is past a rank limit is past it, and is refused
    before anything is read."""
    found = [(min(shape), f"{key} {shape}") for key, shape in _a_shapes(path) if shape]
    return max(found, default=(0, ""))


def bytes_floor(path: str | Path) -> int:
    """A bound from below on the bytes an adapter holds once read and packed (AdapterFacts'
    nbytes, what --max-lora-memory counts), from its file's header alone: every element of its
    A factors takes a byte at least (Q8_0 codes; bfloat16 or float32 elsewhere), B's may take
    none (a column that is zero in B is packed in no part: an untrained adapter's B is zero),
    so the header gives no more; 0 where it does not tell (the full read says why)."""
    total = 0
    for _, shape in _a_shapes(path, experts=True):
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


def _a_shapes(path: str | Path, experts: bool = False) -> list[tuple[str, list[int]]]:
    """An adapter's A factors in its header, (tensor, shape) ([] where it cannot be read);
    PEFT's stacked-expert A ((r n_expert, n_in)) only with experts."""
    p = Path(path)
    try:
        if p.is_dir():
            from graftlm.lora.peft import a_factor_shapes

            return a_factor_shapes(p, experts)
        from graftlm.gguf import GGUFFile

        f = GGUFFile(p)
        return [(n, list(e.shape)) for n, e in f.tensors.items() if n.endswith(".lora_a")]
    except Exception:  # noqa: BLE001 - an unreadable header: the full read names the problem
        return []


@functools.cache
def _openmp() -> Any:
    """The OpenMP runtime torch loaded (libgomp's soname finds the copy already in the process),
    or None where there is none by that name."""
    try:
        lib = ctypes.CDLL("libgomp.so.1")
        return lib if hasattr(lib, "omp_set_num_threads") else None
    except OSError:
        return None


@contextmanager
def one_thread() -> Iterator[None]:
    """The calling thread's torch operations and native calls on one thread (its OpenMP team
    of one) inside the block: an adapter read beside the engine's steps then takes no core
    from the engine's team (a reader's own team of two, on a machine of two cores, has each
    parallel region wait for a core the engine holds, and its idle worker spin on one the
    engine needs). Other threads keep their own setting; the caller's comes back after."""
    lib = _openmp()
    if lib is None:
        yield
        return
    before = torch.get_num_threads()  # (first: torch sets up this thread's team, then ours holds)
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)
