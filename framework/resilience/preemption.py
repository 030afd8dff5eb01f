"""Preemption: SIGTERM, SIGINT or SIGUSR1 asks for a save and a clean exit at the next step
boundary (agreed by every rank through the control all-reduce).

The handler is installed on the first line of ``DDPTrainer.__init__`` and stays until the
trainer is closed, so a signal at any moment is recorded, never lost, and never meets Python's
"Signal 15 ignored due to race condition" (a signal arriving while a handler is being swapped).
Signals within ``DUPLICATE_WINDOW_S`` of the first count as the same request: a scheduler and
torchrun's forward of it often both deliver one. A later signal exits at once, by the signal.

torchrun forwards one signal to its workers and SIGKILLs them 30 s later, so the save has to
finish within that grace period.

A worker whose torchrun agent died (kill -9) gets SIGTERM as its death signal. Before training has
begun it has nothing to save and no launcher waits for a PREEMPTED marker, so it exits at once
instead of finishing its start-up to reach the first step boundary; in training it saves first.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from ..ddp import process_group

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
DUPLICATE_WINDOW_S = 2.0


class PreemptionHandler:
    def __init__(self) -> None:
        self.requested: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self.started = False
        """Set by the trainer when training begins; before, an orphaned worker exits at once."""

    @property
    def installed(self) -> bool:
        """False off the main thread, where Python cannot install signal handlers."""
        return bool(self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested is None and not self.started and signum == signal.SIGTERM and process_group.agent_gone():
            log.warning("received SIGTERM: the torchrun agent is gone and training has not begun (nothing to "
                        "save): exiting now")
            self._die(signum)
        if self.requested is None:
            self.requested, self._first_at = signum, time.monotonic()
            log.warning("received %s: saving a checkpoint and stopping at the next step boundary",
                        signal.Signals(signum).name)
            return
        if time.monotonic() - self._first_at < DUPLICATE_WINDOW_S:
            log.info("received %s again within %.0f s: the same request", signal.Signals(signum).name,
                     DUPLICATE_WINDOW_S)
            return
        # A second request: give up on the orderly save and die of the signal.
        self._die(signum)

    @staticmethod
    def _die(signum: int) -> None:
        for handler in logging.getLogger().handlers:
            handler.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put the previous handlers back (a request already recorded stays in ``requested``)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
