"""The adapters attached to one model: ids, scales, and their slots in every projection.

An adapter's id is its slot in every LoraSite and its column in every batch's scale table. Ids are
given in load order and never reused while the model lives, so a request that names an id cannot
silently reach a different adapter.

The slots change on the engine's thread, between steps, except one change: a new adapter at
scale 0 may go in from another thread beside a running step (`attach_beside`), the steps' tables
taking it on the engine's thread (`publish`). A lock keeps the changes one at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftlm.errors import AdapterError, GraftError, RequestError
from graftlm.lora.adapter import EMBEDDING, ResolvedAdapter
from graftlm.lora.packed import PackedSlot, pack_many
from graftlm.lora.scales import Reaches, checked_scale, fits_by_reach, together_overflow
from graftlm.lora.settings import AdapterSettings
from graftlm.lora.site import LoraSite
from graftlm.lora.targets import Base

log = logging.getLogger(__name__)

# who the model's scales (`set_scales`, an adapter attached at a scale) reach: the calls with no
# adapter settings of their own
MODEL_SCALES = "every call at the model's scales"


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
            # activated LoRA: the delta applies from the last occurrence of these tokens on
            "alora_invocation_tokens": list(a.invocation_tokens),
        }


class _Asleep:
    """The model of a set whose model was released (the server's sleep): any use says so."""

    def __getattr__(self, name: str) -> Any:
        raise GraftError(f"the model is asleep (its {name!r} was released); wake it first")


_ASLEEP: Any = _Asleep()


class AdapterSet:
    def __init__(self, model: Base) -> None:
        self.model = model
        self.attached: dict[int, Attached] = {}
        self._next_id = 0
        self._lock = threading.Lock()  # one change of the slots at a time (module docstring)
        self._staged: list[LoraSite] = []  # sites holding slots no step's table has (`publish`)

    def load(self, path: str | Path) -> ResolvedAdapter:
        """Read and check an adapter (GGUF file or PEFT directory) against the base; attach nothing."""
        p = Path(path)
        if p.is_dir():
            from graftlm.lora.peft import read_peft_adapter

            resolved = read_peft_adapter(p, self.model)
        else:
            from graftlm.lora.gguf_adapter import read_gguf_adapter

            resolved = read_gguf_adapter(p, self.model, self.model.base_tensor_names)
        resolved.check_values()
        self._pack(resolved)
        return resolved

    def _pack(self, adapter: ResolvedAdapter) -> None:
        """Each projection's factors in the native delta's form, packed with the read (the
        server reads in a worker thread): attaching then only points the tables at them. The
        packed form is then the factors' one copy (Delta.hold; lora.site)."""
        if self.model.device.type != "cpu":
            return
        for d in adapter.deltas.values():  # (as LoraSite.put keeps them: then it copies nothing)
            if not (d.a.is_contiguous() and d.b.is_contiguous()):
                d.a, d.b = d.a.contiguous(), d.b.contiguous()
        table = self.model.seams
        by_kind: dict[bool, list[str]] = {}  # compact or not: the projections of each kind
        for name in adapter.deltas:
            if name != EMBEDDING:
                by_kind.setdefault(table.projections[name].approximate, []).append(name)
        for compact, names in by_kind.items():
            deltas = [adapter.deltas[name] for name in names]
            for d, packed in zip(
                deltas, pack_many([(d.a, d.b) for d in deltas], compact), strict=True
            ):
                d.hold(packed)

    def attach(self, adapter: ResolvedAdapter, scale: float = 1.0) -> int:
        """Put a resolved adapter into its slot of every projection it names. Cannot fail halfway:
        every check ran when the adapter was resolved, and off the CPU every factor is copied to
        the model's device (where memory can run out) before any is attached."""
        with self._lock:
            slot = self._next_id
            self._place(slot, adapter)
            self._next_id += 1
            self.attached[slot] = Attached(slot, adapter, float(scale))
            return slot

    def attach_beside(self, adapter: ResolvedAdapter) -> int | None:
        """`attach` at global scale 0 from any thread, beside a step that may be running on the
        engine's; its id, or None (nothing attached: attach it between two steps) where it
        cannot go in so: a projection with no slots yet (its site would be made under the
        step), the embedding, factors not packed for their projection (off the CPU), the
        model asleep, or the slots changing on the engine's thread right now (the caller, an
        event loop, does not wait for it).

        What the running step reads does not change: each projection's slot goes in whole (its
        packed form made with the read) beside the slots there, no table is remade, and the
        id is new (never reused), so no row of the step names it and the kernels, which read a
        scale of 0 for a slot no row names, skip it in any table made meanwhile. The steps'
        tables take it at `publish`, which the engine's thread runs before any step whose
        rows can name it."""
        if not self._lock.acquire(blocking=False):
            return _not_beside(adapter, "the slots are changing on the engine's thread")
        try:
            return self._stage(adapter)
        finally:
            self._lock.release()

    def _stage(self, adapter: ResolvedAdapter) -> int | None:
        if isinstance(self.model, _Asleep):
            return _not_beside(adapter, "the model is asleep")
        if self.model.device.type != "cpu":
            return _not_beside(adapter, f"the model is on {self.model.device}, not the CPU")
        projections = self.model.seams.projections
        staged: list[tuple[LoraSite, PackedSlot]] = []
        for name, d in adapter.deltas.items():  # (a refusal comes before any site holds it)
            p = projections.get(name) if name != EMBEDDING else None
            if p is None or p.lora is None:
                return _not_beside(adapter, f"{name} has no adapter slots yet")
            if d.packed is None:
                return _not_beside(adapter, f"its factors for {name} are not packed")
            site, packed = p.lora, d.packed
            if packed.half != p.approximate or (packed.n_in, packed.n_out) != (
                site.n_in,
                site.n_out,
            ):
                return _not_beside(
                    adapter,
                    f"its packed factors for {name} ({packed.n_in} -> {packed.n_out}, half "
                    f"{packed.half}) do not fit the slots ({site.n_in} -> {site.n_out}, half "
                    f"{p.approximate})",
                )
            staged.append((site, packed))
        slot = self._next_id
        for site, packed in staged:
            site.stage_packed(slot, packed)
        self._staged += [site for site, _ in staged]
        self._next_id += 1
        self.attached[slot] = Attached(slot, adapter, 0.0)
        return slot

    def publish(self) -> None:
        """On the engine's thread, between two steps: the slots `attach_beside` put in, in the
        projections' tables from the next step on."""
        with self._lock:
            staged, self._staged = self._staged, []
            for site in staged:
                site.publish()

    def rebind(self, model: Base) -> None:
        """Attach every adapter, under its id and at its scale, to `model` in place of the one
        this set was made for (a fresh load of the same file: the server's wake from sleep)."""
        with self._lock:
            self.model = model
            self._staged = []  # (the old model's sites; every slot is placed whole below)
            for slot, a in sorted(self.attached.items()):
                self._place(slot, a.adapter)

    def release(self) -> None:
        """Let go of the model (the server's sleep); the adapters, ids and scales stay, for
        `rebind`. Until then nothing that needs the model may be asked of this set."""
        with self._lock:
            self.model = _ASLEEP

    def _place(self, slot: int, adapter: ResolvedAdapter) -> None:
        dev = self.model.device
        # a delta packed for its projection goes in as it is on the CPU; any other's factors
        # (read back from the packed form when it has one) are on the model's device before
        # any is attached
        table = self.model.seams
        packed = {
            name: d.packed
            for name, d in adapter.deltas.items()
            if d.packed is not None
            and dev.type == "cpu"
            and d.packed.half == table.projections[name].approximate
        }
        factors = {}
        for name, d in adapter.deltas.items():
            if name not in packed:
                a, b = d.a, d.b
                # (no tensor call on the engine's thread when the factors are there already)
                factors[name] = (
                    (a, b) if a.device == dev and b.device == dev else (a.to(dev), b.to(dev))
                )
        for name in adapter.deltas:
            if name == EMBEDDING:
                a, b = factors[name]
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
                if name in packed:
                    p.lora.put_packed(slot, packed[name])
                else:
                    p.lora.put(slot, *factors[name])

    def detach(self, adapter_id: int) -> None:
        with self._lock:
            self._detach(adapter_id)

    def _detach(self, adapter_id: int) -> None:
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

    def describe_ids(self, ids: Iterable[int] | None = None) -> str:
        """Which ids a request may name: every attached adapter's, or `ids`."""
        known = sorted(self.attached if ids is None else ids)
        if not known:
            return "no adapter is loaded"
        if known == list(range(known[0], known[-1] + 1)):
            return f"valid ids are {known[0]}..{known[-1]}"
        return f"valid ids are {known}"

    def check_scale(
        self, adapter_id: object, scale: object, among: Collection[int] | None = None
    ) -> float:
        """The scale as a float, or AdapterError naming the unknown id (not attached, or not in
        `among`) or the bad scale (not a number, not finite, past float32's range)."""
        if among is None:
            self._check(adapter_id)
        elif (
            isinstance(adapter_id, bool)
            or not isinstance(adapter_id, int)
            or adapter_id not in among
        ):
            raise AdapterError(f"unknown adapter id {adapter_id!r}; {self.describe_ids(among)}")
        return checked_scale(scale, f"adapter {adapter_id}")

    def settings(
        self,
        lora: object = None,
        *,
        base: Mapping[int, float] | None = None,
        among: Collection[int] | None = None,
        where: str = "",
        error: type[GraftError] = RequestError,
    ) -> AdapterSettings:
        """The one check of adapter settings that come from outside, into the value every later
        stage carries unchanged.

        lora: the API's `[{"id": ..., "scale": ...}]` list, or a mapping id -> scale (a later
        entry for an id wins); None: `base`, or the model's global scales when there is no base
        either. base: what the listed entries are laid over (the server's adapter named as the
        model, at scale 1). among: the ids that may be named (default: every attached adapter).
        Raises `error` (default RequestError: a bad request), its message prefixed by `where`."""
        if lora is None:
            return self.scales() if base is None else AdapterSettings(base)
        if isinstance(lora, Mapping):
            entries: list[object] = [{"id": i, "scale": s} for i, s in lora.items()]
        elif isinstance(lora, list):
            entries = list(lora)
        else:
            raise error(
                f"{where}lora must be a list of {{'id', 'scale'}} objects, got {type(lora).__name__}"
            )
        out: dict[int, float] = dict(base or {})
        for item in entries:
            if not isinstance(item, dict) or "id" not in item or "scale" not in item:
                raise error(f"{where}each lora entry needs an 'id' and a 'scale', got {item!r}")
            try:
                out[item["id"]] = self.check_scale(item["id"], item["scale"], among)
            except AdapterError as exc:
                raise error(f"{where}{exc}") from None
        return AdapterSettings(out)

    def call_settings(self, lora: object) -> AdapterSettings:
        """`settings` for one call of the Python API, whose own scales (`lora` not None) must
        also keep its adapters' deltas within float16's range, alone and together: RequestError
        invalid_scale naming the adapters, their scales and how far each may go, before any
        step runs (it ended in "logits not finite"). None: the model's scales, checked when they
        were set (`set_scales`, `check_attach`)."""
        settings = self.settings(lora)
        if lora is not None and (problem := self.overflow(settings, "this call")) is not None:
            raise RequestError(f"lora: {problem}", "invalid_scale")
        return settings

    def overflow(
        self,
        scales: Mapping[int, float],
        who: str = MODEL_SCALES,
        new: tuple[str, ResolvedAdapter, float] | None = None,
    ) -> str | None:
        """Why the attached adapters at `scales` (ids checked), and `new` (one not attached yet:
        how to name it, it, its scale), cannot apply together, `who` naming those that would
        overflow (`together_overflow`); None when they can."""
        attached = self.attached
        pairs = [(i, a.adapter, s) for i, s in scales.items() if (a := attached.get(i))]
        extra = [new] if new is not None else []
        if fits_by_reach((r, s) for _, r, s in [*pairs, *extra]):  # (no names made for it)
            return None
        scaled: list[tuple[str, Reaches | None, float]] = [
            (f"adapter {i} ({Path(r.path).name})", r, s) for i, r, s in pairs
        ]
        return together_overflow([*scaled, *extra], who)

    def check_attach(self, adapter: ResolvedAdapter, scale: object, what: str = "") -> float:
        """The scale a new adapter may be attached at (`attach`), as a float: a number within
        float32's range whose delta stays within float16's range beside the adapters at the
        model's scales; AdapterError otherwise (naming it by `what`, default its path)."""
        what = what or str(adapter.path)
        value = checked_scale(scale, what)
        if (problem := self.overflow(self.scales(), new=(what, adapter, value))) is not None:
            raise AdapterError(problem)
        return value

    def set_scales(self, scales: Mapping[int, float]) -> None:
        """llama-server's POST /lora-adapters: the listed adapters get these scales, the rest 0.
        AdapterSettings were checked when they were built (the server's registry checks their
        range, `together_overflow`); any other mapping is checked here, ids, values and range
        together (AdapterError, and nothing changes)."""
        if not isinstance(scales, AdapterSettings):
            scales = self.settings(scales, error=AdapterError)
            if (problem := self.overflow(scales)) is not None:
                raise AdapterError(problem)
        with self._lock:  # (an attach beside the step adds to `attached`)
            for i, a in self.attached.items():
                a.scale = scales.get(i, 0.0)

    def scales(self) -> AdapterSettings:
        """The model's global scales, the default a request starts from: their one copy (the
        server asks here too). Safe from any thread: the table is copied in one C call."""
        return AdapterSettings((i, a.scale) for i, a in list(self.attached.items()))

    def invocations(self) -> dict[int, tuple[int, ...]]:
        """Activated-LoRA adapters by id: their invocation tokens."""
        return {
            i: tuple(a.adapter.invocation_tokens)
            for i, a in list(self.attached.items())
            if a.adapter.invocation_tokens
        }

    def info(self) -> list[dict[str, object]]:
        return [a.info() for _, a in sorted(self.attached.items())]


def _not_beside(adapter: ResolvedAdapter, why: str) -> int | None:
    """`attach_beside` declines (the adapter is attached between two steps instead): why, in
    the debug log; None, attach_beside's answer."""
    log.debug(
        "%s: not attached beside the step (%s); attached between two steps", adapter.path, why
    )
    return None
