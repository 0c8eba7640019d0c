"""When an engine may sleep (llama-server's --sleep-idle-seconds): the policy, not the act.

After `sleep_idle_s` seconds with nothing run, waiting or held, the engine service lets its
engine (weights, KV cache) go, and the next work loads it again. This clock keeps what that
decision needs: the callers that hold the engine awake (HTTP requests in progress), when work
was last seen, and the counts of sleeps and wakes. It is told from any thread; the service's
thread asks it. `settle_heap` and `unsettle_heap` keep a loaded model's objects out of the
garbage collector's full passes, and give them back before the model goes.
"""

from __future__ import annotations

import gc
import threading
import time

CHECK_S = 0.5  # the longest the idle engine thread waits before it asks again


class IdleClock:
    def __init__(self, sleep_idle_s: float | None) -> None:
        self.sleep_idle_s = sleep_idle_s
        self.last_active = time.monotonic()
        self.holds = 0  # callers (HTTP requests) that keep the engine awake while they run
        self.lock = threading.Lock()  # held while the service decides, and by hold/unhold
        self.n_sleeps = 0
        self.n_wakes = 0

    def touch(self) -> None:
        """Work was seen now."""
        self.last_active = time.monotonic()

    def hold(self) -> None:
        with self.lock:
            self.holds += 1
            self.last_active = time.monotonic()

    def unhold(self) -> None:
        with self.lock:
            self.holds -= 1
            self.last_active = time.monotonic()

    def wait_s(self) -> float | None:
        """How long the idle thread of an awake engine may wait for work before it asks again
        (None: for ever, it never sleeps)."""
        if self.sleep_idle_s is None:
            return None
        left = self.sleep_idle_s - (time.monotonic() - self.last_active)
        return min(max(left, 0.01), CHECK_S)

    def due(self) -> bool:
        """Nothing held and the time is up (the caller holds `lock` and knows the engine has
        nothing running, waiting or deferred)."""
        return (
            self.sleep_idle_s is not None
            and not self.holds
            and time.monotonic() - self.last_active >= self.sleep_idle_s
        )


def settle_heap() -> None:
    """After a model loads: collect once, then move what survived (the model's modules, the
    tokenizer's tables, the server's: about 200k objects for a 1B model) out of the cyclic
    collector's reach, so its full passes, which come every so often, no longer walk them (one
    took 100-400 ms with the GIL held, landing inside steps and adapter reads). Frozen objects
    are still freed when nothing refers to them; `unsettle_heap` before letting a model go, so
    its cycles can be collected. The freeze is the process's (one service a process settles it:
    the server's)."""
    gc.collect()
    gc.freeze()


def unsettle_heap() -> None:
    """Give every frozen object back to the collector (the next full pass walks them)."""
    gc.unfreeze()
