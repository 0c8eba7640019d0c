"""The adapters attached to one model: ids, scales, and their slots in every projection.

An adapter's id is its slot in every LoraSite and its column in every batch's scale table. Ids are
given in load order and never reused while the model lives, so a request that names an id cannot
silently reach a different adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graftlm.errors import AdapterError
from graftlm.lora.adapter import EMBEDDING, ResolvedAdapter
from graftlm.lora.scales import scale_problem
from graftlm.lora.site import LoraSite
from graftlm.lora.targets import Base


@dataclass
class Attached:
    id: int
    adapter: ResolvedAdapter
    scale: float

    def info(self) -> dict[str, object]:
        a = self.adapter
        return {
            "id": self.id,
            "path": a.path,
            "scale": self.scale,
            "alpha": a.alpha,
            "task_name": a.task_name,
            "prompt_prefix": a.prompt_prefix,
            "n_tensors": a.n_tensors,
            "bytes": a.nbytes,
        }


class AdapterSet:
    def __init__(self, model: Base) -> None:
        self.model = model
        self.attached: dict[int, Attached] = {}
        self._next_id = 0

    def load(self, path: str | Path) -> ResolvedAdapter:
        """Read and check an adapter (GGUF file or PEFT directory) against the base; attach nothing."""
        p = Path(path)
        if p.is_dir():
            from graftlm.lora.peft import read_peft_adapter

            return read_peft_adapter(p, self.model)
        from graftlm.lora.gguf_adapter import read_gguf_adapter

        return read_gguf_adapter(p, self.model, self.model.base_tensor_names)

    def attach(self, adapter: ResolvedAdapter, scale: float = 1.0) -> int:
        """Put a resolved adapter into its slot of every projection it names. Cannot fail halfway:
        every check ran when the adapter was resolved, and off the CPU every factor is copied to
        the model's device (where memory can run out) before any is attached."""
        dev = self.model.device
        factors = {name: (d.a.to(dev), d.b.to(dev)) for name, d in adapter.deltas.items()}
        slot = self._next_id
        self._next_id += 1
        table = self.model.seams
        for name, (a, b) in factors.items():
            if name == EMBEDDING:
                if table.embedding is None:
                    table.embedding = LoraSite(
                        table.n_vocab, table.n_embd, gather=True, device=dev,
                        generation=table.generation,
                    )  # fmt: skip
                table.embedding.put(slot, a, b)
            else:
                p = table.projections[name]
                if p.lora is None:
                    p.lora = LoraSite(
                        p.n_in, p.n_out, compact=p.approximate, device=dev,
                        generation=table.generation,
                    )  # fmt: skip
                p.lora.put(slot, a, b)
        self.attached[slot] = Attached(slot, adapter, float(scale))
        return slot

    def detach(self, adapter_id: int) -> None:
        self._check(adapter_id)
        table = self.model.seams
        for p in table.projections.values():
            if p.lora is not None:
                p.lora.drop(adapter_id)
                if not p.lora:
                    p.lora = None
        if table.embedding is not None:
            table.embedding.drop(adapter_id)
            if not table.embedding:
                table.embedding = None
        del self.attached[adapter_id]

    def _check(self, adapter_id: object) -> None:
        if (
            isinstance(adapter_id, bool)
            or not isinstance(adapter_id, int)
            or adapter_id not in self.attached
        ):
            raise AdapterError(f"unknown adapter id {adapter_id!r}; {self.describe_ids()}")

    def describe_ids(self) -> str:
        ids = sorted(self.attached)
        if not ids:
            return "no adapter is loaded"
        if ids == list(range(ids[0], ids[-1] + 1)):
            return f"valid ids are {ids[0]}..{ids[-1]}"
        return f"valid ids are {ids}"

    def check_scale(self, adapter_id: object, scale: object) -> float:
        """The scale as a float, or AdapterError naming the unknown id or the bad scale (not a
        number, not finite, past float32's range)."""
        self._check(adapter_id)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise AdapterError(f"adapter {adapter_id}: scale must be a number, got {scale!r}")
        problem = scale_problem(float(scale))
        if problem is not None:
            raise AdapterError(f"adapter {adapter_id}: scale {scale!r} {problem}")
        return float(scale)

    def set_scales(self, scales: dict[int, float]) -> None:
        """llama-server's POST /lora-adapters: the listed adapters get these scales, the rest 0."""
        for i, s in scales.items():
            self.check_scale(i, s)
        for i, a in self.attached.items():
            a.scale = float(scales.get(i, 0.0))

    def scales(self) -> dict[int, float]:
        return {i: a.scale for i, a in self.attached.items() if a.scale != 0.0}

    def info(self) -> list[dict[str, object]]:
        return [a.info() for _, a in sorted(self.attached.items())]
