"""An adapter file read and checked against the base, before anything is attached.

`prepare_adapter` is the step a server runs off its engine's thread (a worker thread): the file
is read, mapped onto the base and packed, and every way it can fail becomes one AdapterError
that names the file. Attaching what it returns is the engine thread's (`EngineService.attach`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
