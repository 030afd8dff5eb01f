"""Preemption: SIGTERM, SIGINT or SIGUSR1 asks for a save and a clean exit at the next step
boundary (agreed by every rank through the control all-reduce). A second signal exits at once.

torchrun forwards one signal to its workers and SIGKILLs them 30 s later, so the save has to
finish within that grace period.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class PreemptionHandler:
    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            # The second signal: give up on the orderly save and die of the signal.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = signum
        log.warning("received %s: saving a checkpoint and stopping at the next step boundary",
                    signal.Signals(signum).name)

    @property
    def installed(self) -> bool:
        """False off the main thread, where Python cannot install signal handlers."""
        return bool(self._previous)

    def __enter__(self) -> "PreemptionHandler":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
