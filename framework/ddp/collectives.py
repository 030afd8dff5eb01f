"""Collectives a lost peer cannot hold: each is started asynchronously and waited for until it
completes or a ``Breaker`` names a lost peer, whichever comes first; the loss ends the wait with
``PeerLostError`` at once.

Why: a rank frozen or cut off (SIGSTOP, a partition) sends no reset, so gloo waits out the
group's timeout (``ddp.timeout_s``), and on torch 2.13 neither ``ProcessGroupGloo.abort()`` (it
does not end a wait already blocked: bench/heal_probe.py) nor ``dist.shrink_group`` (NCCL only:
bench/torchft_probe.py) gets the survivors out. The peer monitor (framework/resilience/peers.py)
tells dead from slow from a thread of its own; a breaker carries its verdict into every wait.

A collective that was broken never completes: its work and group are parked (kept referenced for
the life of the process, since freeing them joins gloo threads that may never return), and the
survivors form a new group.

Wired for a run that heals in place: ``process_group.form`` arms this process's ``BREAKER`` for each
generation; the step's agreement (framework/train/agreement.py) and DDP's gradient all-reduce (the
comm hook, framework/ddp/comm_hooks.py) wait through it; the peer monitor names a silent peer in
it (framework/resilience/peers.py). Elsewhere ``BREAKER`` is None and every call is the plain one."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

BREAKER: Breaker | None = None
"""This process's breaker while it heals in place (``arm``), else None."""
PARKED: list[Any] = []
"""Broken collectives' works and their groups, never freed (see the module's docstring). A work
alone does not keep its group: freeing a ``ProcessGroupGloo`` joins its threads, one of which may
be blocked in the broken collective. A process that parked one ends with ``os._exit``."""


def park(*things: Any) -> None:
    PARKED.extend(things)


def exit_if_parked(code: int) -> None:
    """End the process with ``code`` now when it parked a broken group (healing in place):
    freeing one at the interpreter's exit joins gloo threads that may wait for good. Call it
    last, with everything written and closed."""
    if not PARKED:
        return
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class PeerLostError(RuntimeError):
    """A collective was given up because ``ranks`` (of its group) were named lost."""

    def __init__(self, ranks: list[int], what: str = "a collective"):
        self.ranks = sorted(ranks)
        super().__init__(f"{what} given up: peer rank(s) {self.ranks} lost")


class Breaker:
    """The peers named lost in the current generation of the group, and what to cancel when one
    is. Thread-safe: the peer monitor's thread names, the training thread waits, gloo's threads
    complete futures. Ranks are a generation's: a verdict about another generation is ignored."""

    def __init__(self, generation: int = 0) -> None:
        self._lock = threading.Lock()
        self.generation = generation
        self._lost: list[int] = []
        self._cancels: dict[int, Callable[[list[int]], None]] = {}
        self._next = 0

    def lost(self) -> list[int]:
        with self._lock:
            return list(self._lost)

    def name(self, ranks: list[int], generation: int | None = None) -> None:
        """Name ``ranks`` of ``generation`` (None: the current one) lost: every wait in progress,
        and every later one, ends with PeerLostError."""
        with self._lock:
            if generation is not None and generation != self.generation:
                return
            self._lost = sorted(set(self._lost) | set(ranks))
            lost, cancels = list(self._lost), list(self._cancels.values())
            self._cancels.clear()
        for cancel in cancels:  # outside the lock: a cancel completes a future, whose callbacks run here
            cancel(lost)

    def reset(self, generation: int) -> None:
        """``generation``'s group was formed: nobody in it is lost."""
        with self._lock:  # an older generation's watches (works never completed) are not this one's
            self.generation, self._lost, self._cancels = generation, [], {}

    def _watch(self, cancel: Callable[[list[int]], None]) -> int:
        """Register ``cancel`` (called at once if a peer is already lost); returns its key."""
        with self._lock:
            lost = list(self._lost)
            key, self._next = self._next, self._next + 1
            if not lost:
                self._cancels[key] = cancel
        if lost:
            cancel(lost)
        return key

    def _unwatch(self, key: int) -> None:
        with self._lock:
            self._cancels.pop(key, None)

    def wait(self, work: dist.Work | torch.futures.Future, what: str = "a collective", *, group=None,
             timeout_s: float | None = None) -> None:
        """Wait for ``work`` (a collective's work or future, of ``group``, None: the default group);
        raise PeerLostError as soon as a peer is named lost (at once if one already is), or
        TimeoutError after ``timeout_s``. A work given up is parked with its group."""
        event = threading.Event()
        done = work if isinstance(work, torch.futures.Future) else work.get_future()
        done.then(lambda _: event.set())  # also when the work fails (gloo's timeout, a closed connection)
        key = self._watch(lambda _lost: event.set())
        try:
            event.wait(timeout_s)
        finally:
            self._unwatch(key)
        if not done.done():
            park(work, group if group is not None else dist.group.WORLD)
            lost = self.lost()
            if lost:
                raise PeerLostError(lost, what)
            raise TimeoutError(f"{what} did not complete within {timeout_s} s")
        work.wait()  # raises the collective's own error, if it failed

    def future(self, fut: torch.futures.Future, what: str = "a gradient all-reduce", *,
               group=None) -> torch.futures.Future:
        """A future of ``fut``'s tensor that fails with PeerLostError when a peer is named lost
        before ``fut`` completes: what a DDP comm hook returns (``fut`` holding a tensor, as comm
        hooks' futures do), so that backward raises instead of waiting. DDP's reducer reads the
        error as a RuntimeError naming the loss: catch that around backward and ask ``lost()``."""
        out: torch.futures.Future = torch.futures.Future()
        settle = threading.Lock()
        settled = []

        def first() -> bool:
            with settle:
                if settled:
                    return False
                settled.append(True)
                return True

        def cancel(lost: list[int]) -> None:
            if first():
                park(fut, group if group is not None else dist.group.WORLD)
                out.set_exception(PeerLostError(lost, what))

        key = self._watch(cancel)

        def finish(source: torch.futures.Future) -> None:
            self._unwatch(key)
            if not first():
                return
            try:
                value = source.value()
            except Exception as err:  # noqa: BLE001 - the collective's own error, passed on
                out.set_exception(err)
            else:
                out.set_result(value)

        fut.then(finish)
        # A Python set_exception stores the error as the future's value: reading it in a callback
        # raises it, so the future DDP gets truly fails.
        return out.then(lambda f: f.value())


def arm(generation: int) -> Breaker:
    """The breaker of ``generation``'s group, this process's ``BREAKER`` from now on: nobody lost."""
    global BREAKER
    if BREAKER is None:
        BREAKER = Breaker(generation)
    else:
        BREAKER.reset(generation)
    return BREAKER


def disarm() -> None:
    global BREAKER
    BREAKER = None


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, *, breaker: Breaker | None, group=None,
               what: str = "an all-reduce") -> None:
    """``dist.all_reduce``, broken by ``breaker`` (None: the plain blocking call; pass ``BREAKER``)."""
    if breaker is None:
        dist.all_reduce(tensor, op, group=group)
        return
    breaker.wait(dist.all_reduce(tensor, op, group=group, async_op=True), what, group=group)
