"""The hang watchdog with heartbeats: a step or phase that runs too long dumps every thread's
stack and names the ranks that are behind."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import statistics
import threading
import time
from collections import deque

from .config import RecoverySection
from ..train.events import Listener

log = logging.getLogger(__name__)


class Watchdog(Listener):
    """A per-step deadline of max(step_timeout_s, factor x median step time), armed with
    faulthandler so it fires even while a hung call holds the GIL: it dumps every thread's stack
    to the rank's log and exits the process non-zero, so torchrun tears the group down or
    restarts it.

    Re-arming faulthandler costs a thread start, so it is re-armed only every quarter deadline,
    with a third more slack: a hang is caught between 1 and 1.33 deadlines. A monitor thread
    names the stragglers: on a rank that waits in a collective (which releases the GIL) it writes
    this rank's heartbeat to torchrun's store once the step is slow, and shortly before the
    deadline reports the ranks whose heartbeat is behind, i.e. the ones that never got there.

    Work between steps (evaluation, the consistency check, waiting for a checkpoint write) runs
    in a ``phase`` with its own deadline, from its own measured durations: max(step_timeout_s,
    factor x median of that phase); before the first measurement, factor x median step x the
    phase's ``scale`` (its size in steps' worth of work).

    On the event bus: armed at a step's start, disarmed at its end (or when the data ran out).
    ``section``: the ``recovery`` section (``step_timeout_s``, ``step_timeout_factor``)."""

    Config = RecoverySection  # the configuration's ``recovery`` section, its first argument

    def __init__(self, section, *, log_file, rank: int, world_size: int, store=None):
        step_timeout_s = section.step_timeout_s
        self.minimum = step_timeout_s
        self.factor = section.step_timeout_factor
        self.log_file = log_file
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.durations: deque[float] = deque(maxlen=50)
        self.phase_durations: dict[str, deque[float]] = {}
        self._step = -1
        self._started: float | None = None
        self._armed_at = -float("inf")
        self._deadline = step_timeout_s
        self._reported = -1
        self._monitor: threading.Thread | None = None
        self._closed = threading.Event()

    @property
    def enabled(self) -> bool:
        return self.minimum > 0

    def deadline(self) -> float:
        median = statistics.median(self.durations) if self.durations else 0.0
        return max(self.minimum, self.factor * median)

    def arm(self, step: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        self._step, self._started = step, now
        if now - self._armed_at > self._deadline / 4:
            self._deadline = self.deadline()
            faulthandler.dump_traceback_later(self._deadline * 4 / 3, exit=True, file=self.log_file)
            self._armed_at = now
        if self._monitor is None and self.store is not None and self.world_size > 1:
            self._monitor = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
            self._monitor.start()

    @contextlib.contextmanager
    def phase(self, name: str, scale: float = 1.0):
        """Run the block under a deadline of its own (see the class docstring)."""
        if not self.enabled:
            yield
            return
        history = self.phase_durations.setdefault(name, deque(maxlen=20))
        step_median = statistics.median(self.durations) if self.durations else 0.0
        expected = statistics.median(history) if history else step_median * scale
        deadline = max(self.minimum, self.factor * expected)
        self._started = None  # the straggler monitor watches steps only
        faulthandler.dump_traceback_later(deadline, exit=True, file=self.log_file)
        start = time.perf_counter()
        try:
            yield
        finally:
            history.append(time.perf_counter() - start)
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = -float("inf")  # the next step arms its own deadline at once

    def dump_on(self, signum: int) -> None:
        """Also dump every thread's stack when ``signum`` arrives, from C, before the Python
        handler runs: when torchrun tears the group down, a rank stuck while holding the GIL still
        shows where it was. A debugging aid (the trainer arms it under --debug only): faulthandler
        walks the other threads' frames while they run, and can crash the process doing so."""
        if self.enabled and self.log_file is not None:
            faulthandler.register(signum, file=self.log_file, chain=True)

    def step_start(self, step: int) -> None:
        self.arm(step)

    def data_ready(self, step: int, micro_batches: list | None) -> None:
        if micro_batches is None:
            self.disarm()

    def step_end(self, result, model) -> None:
        self.disarm()

    def disarm(self) -> None:
        if self._started is not None:
            self.durations.append(time.perf_counter() - self._started)
            self._started = None

    def close(self) -> None:
        self._closed.set()
        self._started = None
        if self._monitor is not None:
            # No thread of ours may be inside a store call when the interpreter shuts down.
            self._monitor.join()
            self._monitor = None
        self.store = None  # and no reference keeps the store client alive until then
        if self.enabled:
            faulthandler.cancel_dump_traceback_later()
            for signum in (signal.SIGTERM,):
                faulthandler.unregister(signum)

    def _watch(self) -> None:
        beaten = -1
        while not self._closed.wait(0.25):
            started, step = self._started, self._step
            if started is None:
                continue
            elapsed = time.perf_counter() - started
            if elapsed > self._deadline / 4 and beaten != step:
                self.store.set(f"heartbeat/{self.rank}", f"{step} {time.time():.3f}")
                beaten = step
            if elapsed > self._deadline * 0.75 and self._reported != step:
                self._reported = step
                self._name_stragglers(step)

    def _name_stragglers(self, step: int) -> None:
        behind = []
        for r in range(self.world_size):
            beat = (self.store.get(f"heartbeat/{r}").decode() if self.store.check([f"heartbeat/{r}"])
                    else "-1 0").split()
            if int(beat[0]) < step:
                behind.append(f"rank {r} (last heartbeat at step {beat[0]})")
        if behind:
            log.error("step %d is about to time out (%.1f s): straggler %s", step, self._deadline, "; ".join(behind))
        else:
            log.error("step %d is about to time out (%.1f s): every rank is stuck inside it", step, self._deadline)
        for handler in logging.getLogger().handlers:
            handler.flush()
