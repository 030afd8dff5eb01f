"""A silent peer named in seconds: every rank beats in the run's store from a thread of its own,
and a rank whose watched peer stops beating (a frozen process or host, a cut link: nothing tells
the collectives, which wait for ``ddp.timeout_s``) names it and ends the restart with
EXIT_PEER_LOST, so that torchrun restarts the group, or the launcher ends the run, at once; a
stopped peer on this host is killed first (torchrun would wait its SIGTERM grace, 30 s, for it).
Healing in place, the silent peer is killed when it runs on this host, and otherwise named lost in
every rank's breaker (framework/ddp/collectives.py): the step's collectives with it end, and the
others heal in place without it."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from .config import RecoverySection
from ..ddp import process_group
from ..ddp.collectives import Breaker
from ..ddp import membership
from ..ddp.membership import HEARTBEATS
from ..train.events import Listener
from . import markers

log = logging.getLogger(__name__)

BEAT_S = 1.0
"""How often a rank beats and looks at its peer's beat (more often under a short peer_timeout_s)."""
LEFT = -1
"""The counter of a rank that stopped monitoring on purpose."""


class PeerLostSilently(RuntimeError):
    """A peer stopped beating for ``recovery.peer_timeout_s``, or the run's store stopped answering."""


def heartbeat_store(store: dist.Store | None, timeout_s: float) -> dist.Store | None:
    """A client of its own to the TCPStore under ``store`` (the run's, or the default group's),
    whose calls give up after ``timeout_s`` (the process group's client waits ``ddp.timeout_s``),
    with keys of this run and this restart of the group only. None without a TCPStore."""
    if store is None and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    client = dist.TCPStore(store.host, store.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    if process_group.GENERATION is not None:  # where the membership reads a member's beats
        return dist.PrefixStore(f"{HEARTBEATS}heal{process_group.GENERATION.number}/", client)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return dist.PrefixStore(f"ddp_framework/peers/{run}/{process_group.generation_key()}/", client)


class PeerMonitor(Listener):
    """Rank r beats (adds 1 to its counter in the store) every BEAT_S from a daemon thread,
    whatever its main thread does, and reads rank r+1's counter and the announcement key: three
    store operations per rank and beat, so the store's load grows with the world size, not its
    square. A watched peer whose counter has not moved for ``recovery.peer_timeout_s`` by this
    rank's clock (no clocks are compared), once it has beaten at all, is announced in the store, so
    that every rank learns it within a beat; each rank then logs which peer went silent, records
    the error for the restart and calls ``on_lost`` (``os._exit(EXIT_PEER_LOST)``: the main thread
    may be inside a collective that would wait for ``ddp.timeout_s``). A store that stops answering
    for as long means this rank is cut off: the same. A rank that stops monitoring on purpose (its
    training ended, or failed on its own) says so first, and is not missed: a process that exits
    closes its connections, which its peers' collectives see at once.

    Restarting, a silent peer that is stopped (SIGSTOP) on this host is killed as this rank exits
    (``where/<rank>``: each rank says where it runs): torchrun would end it only after its SIGTERM
    grace of 30 s. One still running (cut off, or slow) is left to its own watch.

    Healing in place: ``on_silent`` kills a silent peer on this host (its connections close, and
    the collectives with it fail). One on another host is named lost in ``breaker`` instead, and
    the announcement names its rank, so that every rank names it in its own breaker: their
    step's collectives with it end, and they heal in place. The rank named reads itself in the
    announcement, should it ever run again, and exits. A heal stops this monitor; one that has not
    come within ``peer_timeout_s`` (the main thread in a collective no breaker ends: DDP's buffer
    broadcast, a checkpoint's) ends the rank as above.

    On the event bus: beats from the start of training to its end. Only with a store (under
    torchrun, or a default group on a TCPStore) and more than one rank; ``peer_timeout_s=0`` is
    off. A group the user built on torchrun's agent store (no key prefix per restart) is not
    monitored: an announcement would outlive its restart."""

    Config = RecoverySection

    def __init__(self, section, *, env, store: dist.Store | None, checkpoint_dir: str,
                 on_lost: Callable[[str], None] | None = None, on_silent: Callable[[int], bool] | None = None,
                 breaker: Breaker | None = None):
        self.timeout_s = section.peer_timeout_s
        self.rank, self.world_size = env.rank, env.world_size
        # A group the user built on torchrun's agent store (which outlives restarts) has no key prefix
        # per restart; a default store hosted by rank 0's worker dies with each restart.
        restarts_apart = (process_group.STORE_GENERATION is not None or process_group.GENERATION is not None
                          or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")
        self.enabled = bool(self.timeout_s) and env.distributed and self.world_size > 1 and restarts_apart
        self.store = heartbeat_store(store, self.timeout_s) if self.enabled else None
        self.enabled = self.store is not None
        self.checkpoint_dir = checkpoint_dir
        self.on_lost = on_lost or self._exit
        # Called with a silent rank (healing in place: kill it); True: it was, and the group heals.
        self.on_silent = on_silent
        # Healing in place: where a silent peer is named lost (its generation's: a verdict reaching
        # a later generation's breaker is ignored).
        self.breaker, self._generation = breaker, breaker.generation if breaker is not None else None
        self.watched = (self.rank + 1) % self.world_size
        self.lost: str | None = None
        self._stop = threading.Event()
        self._held = threading.Event()
        self._threads: list[threading.Thread] = []
        # What the beat thread last learned, read by the judge thread (each a plain attribute: one
        # writer, one reader).
        self._seen: int | None = None
        self._changed_at = self._ok_at = time.monotonic()
        self._announced: str | None = None
        self._judged_at = time.monotonic()  # the judge's last round
        self._store_error = ""
        self._kill_at_exit: Where | None = None  # restarting: the silent peer, read when it fell silent

    @contextlib.contextmanager
    def holding(self):
        """While the main thread handles a peer's loss itself (the survivor checkpoint, then exit
        75), a silence found meanwhile is only logged: exiting would cut that checkpoint short."""
        self._held.set()
        try:
            yield
        finally:
            self._held.clear()

    # --- on the event bus ---------------------------------------------------------------------
    def train_start(self) -> None:
        if self.enabled and self._threads == []:
            # The first beat (0: not started yet; -1: left on purpose), never blocking the main thread.
            def first_beat():
                self.store.set(f"where/{self.rank}", where_this_runs())
                self.store.set(f"alive/{self.rank}", "1")
            self._call(first_beat, wait_s=self._period())
            now = time.monotonic()
            self._ok_at = self._changed_at = now
            self._threads = [threading.Thread(target=target, name=f"peer-monitor-{name}", daemon=True)
                             for name, target in (("beat", self._beat), ("judge", self._judge))]
            for thread in self._threads:
                thread.start()

    def train_end(self, summary: dict) -> None:
        self.close()

    def close(self) -> None:
        """Stop beating and say so (-1): the peer watching this rank does not miss it. Once closed,
        the monitor stays off (a trainer's train() runs once)."""
        if self._threads:
            self._stop.set()
            for thread in self._threads:
                thread.join(timeout=2 * BEAT_S)  # a store call that never returns is a daemon's to keep
            self._threads = []
            self._call(lambda: self.store.set(f"alive/{self.rank}", str(LEFT)), wait_s=BEAT_S)
        self.store, self.enabled = None, False

    # --- the threads --------------------------------------------------------------------------
    def _beat(self) -> None:
        """The store's side: beat, read the watched peer's counter and the announcement. A store
        call can block for good (a server that is frozen or cut off keeps no client deadline), so
        only this thread makes them, and the judge watches it."""
        while not self._stop.wait(self._period()):
            try:
                self.store.add(f"alive/{self.rank}", 1)
                value = self.store.add(f"alive/{self.watched}", 0)  # creates it (0) if it never beat
                announced = self.store.get("lost").decode() if self.store.check(["lost"]) else None
            except Exception as err:  # noqa: BLE001  (the judge ends the rank if it lasts)
                self._store_error = f"{type(err).__name__}: {err}"
                continue
            now = time.monotonic()
            if now - self._ok_at > self.timeout_s:  # this process did not run (the job suspended, then
                self._changed_at = now             # continued): a peer not yet beaten again is not silent
            self._ok_at = now
            self._announced = announced
            if value != self._seen or value <= 0:  # moved, left, or not started: a peer frozen before
                self._seen, self._changed_at = value, now  # its first beat is the collective timeout's

    def _judge(self) -> None:
        killed_at, gone = None, ""  # when the group began to heal without a peer, and which one (how)
        named: str | None = None  # the announcement this rank named lost in its breaker
        self._judged_at = time.monotonic()
        while not self._stop.wait(self._period()):
            now = time.monotonic()
            if now - self._judged_at > self.timeout_s:  # this process did not run (suspended, then
                self._ok_at = self._changed_at = now    # continued): neither the store nor the peer is late
            self._judged_at = now
            if self._announced and self._announced != named:
                ranks, what = _parse(self._announced)
                if self.rank in ranks:
                    return self._lose(f"this rank was named lost by its peers ({what})")
                if self.breaker is None or not ranks:
                    return self._lose(what)
                named, killed_at, gone = self._announced, killed_at or now, f"rank(s) {ranks} were named lost"
                log.warning("%s: named lost by a peer; this rank gives up the step's collectives with rank(s) %s "
                            "and heals in place without them", what, ranks)
                self.breaker.name(ranks, self._generation)
                continue
            if self._seen == LEFT:
                continue  # nothing left to watch: the collectives tell of this rank's own peers
            if now - self._ok_at > self.timeout_s:
                return self._lose(f"rank {self.rank} lost the run's store: no answer for {now - self._ok_at:.1f} s "
                                  f"(recovery.peer_timeout_s={self.timeout_s:g}; "
                                  f"{self._store_error or 'a call that did not return'})")
            # Judged on the reads that happened: a beat thread stuck in the store is the rule above's.
            if killed_at is not None:
                if now - killed_at > self.timeout_s:  # the heal stops this monitor: it did not come
                    return self._lose(f"{gone}, but the group did not heal within {self.timeout_s:g} s "
                                      "(recovery.peer_timeout_s)", announce=True)
                continue
            if self._ok_at - self._changed_at > self.timeout_s:
                silent = (f"rank {self.watched} went silent: no heartbeat for {now - self._changed_at:.1f} s "
                          f"(recovery.peer_timeout_s={self.timeout_s:g}; frozen, or cut off)")
                if self.on_silent is not None and self.on_silent(self.watched):
                    # Killed: its connections close, the collective waiting for it fails on the
                    # survivors, and they heal in place as after a kill -9.
                    log.warning("rank %d went silent: no heartbeat for %.1f s (recovery.peer_timeout_s=%g); killed, "
                                "so that the group heals in place", self.watched, now - self._changed_at,
                                self.timeout_s)
                    killed_at, gone = now, f"rank {self.watched} went silent and was killed"
                    continue
                if self.breaker is not None:  # on another host: every rank names it lost in its breaker
                    named, killed_at = _announcement([self.watched], silent), now
                    gone = f"rank {self.watched} went silent and was named lost"
                    self._call(lambda why=silent: self._announce_named([self.watched], why), wait_s=BEAT_S)
                    log.warning("%s; on another host: named lost, so that every rank gives up the step's collectives "
                                "with it and heals in place without it", silent)
                    self.breaker.name([self.watched], self._generation)
                    continue
                if self.on_silent is None:  # restarting: stopped on this host, it is killed as this rank exits
                    self._call(self._read_where, wait_s=BEAT_S)
                return self._lose(silent, announce=True)

    def _read_where(self) -> None:
        key = f"where/{self.watched}"
        self._kill_at_exit = Where.parse(self.store.get(key).decode()) if self.store.check([key]) else None

    def _announce_named(self, ranks: list[int], what: str) -> None:
        """Add ``ranks`` to the ranks the store's announcement names (compare-and-set: two watchers
        that name different ranks at once both stand, where a plain set would keep only the last)."""
        old = self.store.get("lost").decode() if self.store.check(["lost"]) else ""
        for _ in range(20):
            prior = _parse(old)[0] if old else []
            new = _announcement(sorted(set(prior) | set(ranks)), what)
            now = self.store.compare_set("lost", old, new).decode()
            if now == new:
                return
            old = now

    def _period(self) -> float:
        return min(BEAT_S, self.timeout_s / 4)

    @property
    def dead_after_s(self) -> float | None:
        """How long a peer's beat may stand still before a rank that already knows of a loss (one
        healing in place) takes it for dead, not slow: three beats. None with the monitor off."""
        return 3 * self._period() if self.timeout_s else None

    def _call(self, action: Callable[[], object], *, wait_s: float) -> None:
        """``action`` (a store call) from a thread of its own, waited for ``wait_s`` at most."""
        def attempt():
            try:
                action()
            except Exception:  # noqa: BLE001  (best effort: the others learn it from their own watch)
                pass
        thread = threading.Thread(target=attempt, name="peer-monitor-call", daemon=True)
        thread.start()
        thread.join(wait_s)

    def _lose(self, what: str, *, announce: bool = False) -> None:
        if self._stop.is_set():
            return
        self.lost = what
        if self._held.is_set():
            log.warning("%s; this rank is already handling a peer's loss, and ends the restart when done", what)
            return
        if announce:
            self._call(lambda: self.store.set("lost", _announcement([], what)), wait_s=BEAT_S)
            if self._held.is_set() or self._stop.is_set():  # a survivor checkpoint, or the end, came meanwhile
                return
        self.on_lost(what)

    def _exit(self, what: str) -> None:
        # Whatever blocks below (a log handler's lock, checkpoint_dir on a filesystem the cut link
        # also cut), the exit comes.
        deadline = threading.Timer(5.0, os._exit, (process_group.EXIT_PEER_LOST,))
        deadline.daemon = True
        deadline.start()
        log.error("%s: ending this restart with exit %d so that torchrun restarts the group (or the launcher "
                  "ends the run) now, not after ddp.timeout_s", what, process_group.EXIT_PEER_LOST)
        if self._kill_at_exit is not None:  # before the files below, which a slow filesystem may hold
            self._kill_at_exit.kill_if_stopped(f"rank {self.watched} is stopped")
        markers.record_error(self.checkpoint_dir, self.rank, PeerLostSilently(what))
        if self.breaker is not None:  # healing: launch_training.sh exits 75 naming it (a fixed-size
            try:                        # run's launcher would take it for a node that did not rejoin)
                markers.write(self.checkpoint_dir, markers.NODE_LOST, what)
            except OSError:
                pass
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(process_group.EXIT_PEER_LOST)


def where_this_runs() -> str:
    """This process, as its peers read it: ``host pid start pid-namespace`` (``Where``)."""
    return f"{membership.where_this_runs()} {_pid_namespace()}"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


@dataclass(frozen=True)
class Where:
    """Where a rank runs: its host, pid, start time (/proc's, in clock ticks since boot) and pid
    namespace; the four name one process, where a pid alone may name another (reused, or in
    another container on a host of the same name)."""

    host: str
    pid: int
    start: int
    pid_namespace: str

    @classmethod
    def parse(cls, text: str) -> Where | None:
        """``where_this_runs``'s text, or None for any other (a record this version cannot kill by)."""
        fields = text.split(" ")
        if len(fields) != 4 or not fields[1].isdigit() or not fields[2].isdigit() or not fields[3]:
            return None
        return cls(fields[0], int(fields[1]), int(fields[2]), fields[3])

    def kill_if_stopped(self, why: str) -> bool:
        """SIGKILL this process when it runs in this host's pid namespace and is stopped (SIGSTOP:
        it would wait out torchrun's SIGTERM grace); True when it was. A running one (cut off, or
        slow) is not: it learns of the loss from its own watch, or exits on torchrun's SIGTERM."""
        if self.pid_namespace != _pid_namespace() or membership.process_state(self.pid) != "T":
            return False
        return membership.kill((self.host, self.pid, self.start), why)


def _announcement(ranks: list[int], what: str) -> str:
    """The store's ``lost`` value: the ranks named lost (none: every rank ends its restart) and why."""
    return f"{','.join(str(r) for r in ranks)}\t{what}"


def _parse(announced: str) -> tuple[list[int], str]:
    ranks, _, what = announced.partition("\t")
    return [int(r) for r in ranks.split(",") if r], what
