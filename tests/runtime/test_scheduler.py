"""The scheduler alone, without a model: admission order and cap, chunk packing, cancellation,
slot reuse. The engine's part (running the plan) is played by `_run`, which does what the
engine does to the sequences' states."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import graftlm
from graftlm.errors import RequestError
from graftlm.lora.settings import AdapterSettings
from graftlm.runtime.sampling import SamplingParams
from graftlm.runtime.scheduler import Request, Scheduler, StepPlan

SRC = Path(graftlm.__file__).parent
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


class SlotAllocator:
    """One cache slot of the full context per sequence; the lowest free slot first, a freed
    slot goes to the back. `borrow` lends a slot outside any sequence (a scoring pass)."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.free: list[int] = list(range(n_slots))
        self._slot_of: dict[int, int] = {}  # request id -> slot

    @property
    def n_free(self) -> int:
        return len(self.free)

    def can_admit(self, seq: Request) -> bool:
        return bool(self.free)

    def admit(self, seq: Request) -> None:
        self._slot_of[seq.id] = self.free.pop(0)
        seq.n_prefilled = 0

    def grow(self, seq: Request, n_tokens: int) -> bool:
        return True  # a slot holds the whole context

    def commit(self, seq: Request, n_written: int) -> None:
        pass

    def release(self, seq: Request) -> None:
        self.free.append(self._slot_of.pop(seq.id))

    def slot(self, seq: Request) -> int:
        return self._slot_of[seq.id]

    def borrow(self, n_tokens: int = 0) -> int:
        if not self.free:
            raise RequestError("no free sequence slot", "server_busy")
        return self.free.pop(0)

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


def _req(n: int) -> Request:
    return Request(list(range(1, n + 1)), PARAMS)


def _scheduler(
    n_slots: int = 4, chunk: int = 8, max_running: int | None = None, packed: bool = True
) -> Scheduler:
    s = Scheduler(SlotAllocator(n_slots), chunk, max_running)
    s.packed = packed
    return s


def _run(s: Scheduler, plan: StepPlan, max_tokens: int = 4) -> None:
    """What the engine does with a plan: prefill the chunks (a finished prompt samples a token),
    decode one token per row, end the sequences that reached max_tokens."""
    for c in plan.prefill:
        c.seq.n_prefilled = c.end
        if c.end == len(c.seq.prompt):
            c.seq.generated.append(0)
    for r in plan.decode:
        if not r.done:
            r.generated.append(0)
            if len(r.generated) >= max_tokens:
                s.finish(r, "length")


def test_the_scheduler_imports_no_torch() -> None:
    """Plain Python: the scheduler and what it imports load without torch (the package's own
    __init__, which loads the API, is left out of the import here)."""
    code = f"""
import sys, types
for name, path in [("graftlm", {str(SRC)!r}), ("graftlm.lora", {str(SRC / "lora")!r}),
                   ("graftlm.runtime", {str(SRC / "runtime")!r})]:
    pkg = types.ModuleType(name)
    pkg.__path__ = [path]
    sys.modules[name] = pkg
sys.modules["torch"] = None  # importing it fails
import graftlm.runtime.scheduler
print(sorted(m for m in sys.modules if m.startswith("graftlm")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "graftlm.runtime.scheduler" in out.stdout


def test_admission_in_arrival_order_under_the_cap() -> None:
    s = _scheduler(n_slots=4, max_running=2)
    reqs = [_req(3) for _ in range(4)]
    for r in reqs:
        s.submit(r)
    plan = s.plan()
    assert plan.admitted == tuple(reqs[:2]) and plan.n_running == 2
    assert list(s.waiting) == reqs[2:]
    assert s.allocator.n_free == 2  # the cap, not the cache, held the others back
    _run(s, plan)
    assert s.plan().admitted == ()  # nothing ended: nobody new starts
    s.finish(reqs[0], "stop")
    assert s.plan().admitted == (reqs[2],)


def test_admission_stops_when_the_cache_is_full() -> None:
    s = _scheduler(n_slots=2)
    reqs = [_req(2) for _ in range(3)]
    for r in reqs:
        s.submit(r)
    assert s.plan().admitted == tuple(reqs[:2]) and list(s.waiting) == [reqs[2]]
    s.finish(reqs[1], "stop")
    slot = s.allocator.borrow()  # a scoring pass holds the freed slot
    assert s.plan().admitted == () and list(s.waiting) == [reqs[2]]
    s.allocator.give_back(slot)
    assert s.plan().admitted == (reqs[2],)


def _three_prefills(s: Scheduler) -> tuple[list[Request], list[StepPlan], list[list[tuple]]]:
    """Prompts of 3, 11, 30 and 6 tokens submitted, then three steps run: the requests, the
    plans and each step's prefill pieces (sequence, start, length)."""
    reqs = [_req(3), _req(11), _req(30), _req(6)]
    for r in reqs:
        s.submit(r)
    plans, steps = [], []
    for _ in range(3):
        plan = s.plan()
        plans.append(plan)
        steps.append([(x.seq, x.start, x.length) for x in plan.prefill])
        _run(s, plan, max_tokens=100)
    return reqs, plans, steps


def test_chunk_packing_counts_padding() -> None:
    """Padded (GRAFTLM_PADDED_PREFILL=1): the next piece of the first prompt, then as many more
    as fit in `chunk` tokens with every row padded to the longest piece; one request decodes in
    the step its prompt ends."""
    s = _scheduler(n_slots=4, chunk=24, packed=False)
    (a, b, c, d), plans, steps = _three_prefills(s)
    assert plans[0].width == 11 and plans[0].decode == (a, b)  # both prompts ended here
    assert steps == [
        [(a, 0, 3), (b, 0, 11)],  # 2 x 11 <= 24; a third row of 24 would not fit
        [(c, 0, 24)],  # 2 x 24 > 24: c alone
        [(c, 24, 6), (d, 0, 6)],
    ]
    plan = s.plan()
    assert plan.prefill == () and plan.decode == (a, b, c, d)


def test_packed_chunks_count_their_own_tokens() -> None:
    """Packed (the default): `chunk` counts the pieces' own tokens, and the last piece of a step
    is what fits of its prompt: every step but the last computes `chunk` tokens."""
    s = _scheduler(n_slots=4, chunk=24)
    (a, b, c, d), plans, steps = _three_prefills(s)
    assert all(p.computed == sum(x.length for x in p.prefill) for p in plans)
    assert plans[0].decode == (a, b)  # both prompts ended here, c goes on
    assert steps == [
        [(a, 0, 3), (b, 0, 11), (c, 0, 10)],
        [(c, 10, 20), (d, 0, 4)],
        [(d, 4, 2)],
    ]
    plan = s.plan()
    assert plan.prefill == () and plan.decode == (a, b, c, d)


def test_a_long_prompt_is_prefilled_in_chunks() -> None:
    s = _scheduler(chunk=8)
    r = _req(20)
    s.submit(r)
    pieces = []
    while not r.generated:
        plan = s.plan()
        pieces.append([(x.start, x.length) for x in plan.prefill])
        _run(s, plan)
    assert pieces == [[(0, 8)], [(8, 8)], [(16, 4)]]


def test_cancelling_a_waiting_request_takes_it_off_the_queue() -> None:
    s = _scheduler(n_slots=1)
    first, second, third = _req(2), _req(2), _req(2)
    for r in (first, second, third):
        s.submit(r)
    s.plan()
    s.cancel(second, "cancelled")
    assert second.done and second.cancelled and list(s.waiting) == [third]
    s.cancel(first, "cancelled")  # running: its slot is free at once
    assert first.finish_reason == "cancelled" and first.t_end is not None
    assert s.plan().admitted == (third,)
    s.cancel(third, "stop")
    s.cancel(third, "cancelled")  # a second stop changes nothing
    assert third.finish_reason == "stop" and not s.busy


def test_slots_are_reused() -> None:
    s = _scheduler(n_slots=2)
    a, b, c = _req(2), _req(2), _req(2)
    for r in (a, b):
        s.submit(r)
    s.plan()
    assert (s.allocator.slot(a), s.allocator.slot(b)) == (0, 1)
    s.finish(a, "stop")
    s.submit(c)
    assert s.plan().admitted == (c,) and s.allocator.slot(c) == 0
    s.finish(b, "stop")
    s.finish(c, "stop")
    assert sorted(s.allocator.free) == [0, 1] and not s.busy


def test_the_plan_carries_each_requests_settings_unchanged() -> None:
    s = _scheduler(chunk=16)
    settings = [AdapterSettings({0: 1.0}), AdapterSettings(), AdapterSettings({1: -0.5, 0: 2.0})]
    reqs = [Request([1, 2, 3], PARAMS, lo) for lo in settings]
    for r in reqs:
        s.submit(r)
    plan = s.plan()
    assert [c.seq.lora for c in plan.prefill] == settings
    assert all(c.seq.lora is lo for c, lo in zip(plan.prefill, settings, strict=True))
