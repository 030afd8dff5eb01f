"""Who trains together, generation by generation, for a run that heals in place: the members of
each generation agreed through the run's store, and a group formed for them in the same processes.

A generation is a numbered list of replicas (a replica: one rank's process slot, the same across
its restarts); a member's rank is its place in the list. The first to propose generation n+1 (a
survivor that saw a peer lost, or rank 0 letting newcomers in) sets its members with the store's
compare-and-set; everyone else reads that proposal, so all agree even when their views of who is
lost differ. A replica left out of the agreed list is not a member: it ends, and comes back as a
newcomer. Each generation's group lives under a store prefix of its own, so nothing of an old
group's keys can be read by a new one (what ``torch.distributed`` itself does for a restart)."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from .collectives import park

log = logging.getLogger(__name__)

PREFIX = "ddp_framework/heal/"
JOIN_POLL_S = 0.05
"""How often a replica waiting to join (a spare, for hours perhaps) looks for a new generation and
the run's end: two store reads; whether the group died, and that it still asks (``asking/``),
every ``ORPHAN_CHECK_S``."""
ORPHAN_CHECK_S = 0.5
RESTART_SETTLE_S = 2.0
"""When every member is dead, how long the replicas that ask to join wait for the others to ask
too before they form the next generation among themselves (and resume from the checkpoint)."""
REMOTE_SILENT_S = 10.0
"""How long a count that a process on another host keeps moving must stand still, as seen from
here, before the process is known gone: frozen, cut off or dead with its host. The counts: its
peer monitor's heartbeat in a generation's training (framework/resilience/peers.py), its own
(``live/<replica>/<process>``, ``beat``, from its start to its end, the monitor on or off: there
``recovery.peer_timeout_s`` if longer), and a joiner's requests (``asking/<replica>``). A process
whose threads cannot run that long (a C call that holds the GIL, the host swapping) counts as
gone as a frozen one does."""
LIVE_BEAT_S = 1.0
"""How often each process of a run that heals in place counts ``live/<replica>/<process>`` (``beat``)."""
HEARTBEATS = "ddp_framework/peers/heal/"
"""Where the peer monitors of a run that heals in place beat: ``heal<generation>/alive/<rank>``."""
SLOT_ENV = ("HEAL_STORE", "HEAL_REPLICA", "HEAL_REPLICAS", "HEAL_SPARES")
"""Where a process of a run that heals in place learns its place: the run's store (HOST:PORT, a
TCPStore that outlives every training process), its replica (0..N-1), the number of replicas, and
how many of them are spares (the last ones; 0 if unset): ready to step in when a member is lost,
so that the group keeps its size. Set by the launcher for each rank's own torchrun job."""


@dataclass(frozen=True)
class Slot:
    host: str
    port: int
    replica: int
    replicas: int
    spares: int = 0

    @classmethod
    def from_env(cls, environ) -> Slot | None:
        """This process's slot, or None when it was not started to heal in place."""
        if SLOT_ENV[0] not in environ:
            return None
        store, replica, replicas, spares = (environ.get(name, "") for name in SLOT_ENV)
        spares = spares or "0"
        host, _, port = store.rpartition(":")
        if not host or not port.isdigit() or not all(v.isdigit() for v in (replica, replicas, spares)):
            raise ValueError(f"HEAL_STORE={store!r}, HEAL_REPLICA={replica!r}, HEAL_REPLICAS={replicas!r}, "
                             f"HEAL_SPARES={spares!r}: allowed: HOST:PORT, a replica number, the number of replicas "
                             "and of spares (launch_training.sh sets them)")
        if not 0 <= int(replica) < int(replicas) or not 0 <= int(spares) < int(replicas):
            raise ValueError(f"HEAL_REPLICA={replica}, HEAL_SPARES={spares}: must be in [0, HEAL_REPLICAS={replicas})")
        return cls(host, int(port), int(replica), int(replicas), int(spares))


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (field 3 first), or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    end = stat.rindex(b")")  # the command name may hold spaces and parentheses
    return stat[end + 2:].decode().split()


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in /proc (R, S, T, Z, ...), or None when there is none."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc's field 22): with the pid, it
    names one process, where a pid alone may name another once reused."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def where_this_runs() -> str:
    """This process, as the run's store records it: ``host pid start``."""
    return f"{socket.gethostname()} {os.getpid()} {process_start(os.getpid())}"


def kill(where: tuple[str, int, int | None], why: str) -> bool:
    """SIGKILL the process ``where`` (``Membership.process_of``) when it runs on this host, is not
    this process, and is the one recorded (its start time, where recorded); True when it was."""
    host, pid, start = where
    if host != socket.gethostname() or pid == os.getpid() or start not in (None, process_start(pid)):
        return False
    log.warning("%s (pid %d): killing it so that its torchrun starts it again or ends", why, pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone, or another user's: not the run's
        return False
    return True


class RunFinished(SystemExit):
    """A replica started again after the run finished: it ends with 0, saying so."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Superseded(RunFinished):
    """A newer process holds this process's replica (its node launched again while this one was
    frozen): it takes part in nothing and ends with 0, so that its torchrun ends too instead of
    starting it again."""


class ProposerLost(RuntimeError):
    """The member that was to propose the next generation (rank 0, growing) is gone."""


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[int, ...]
    """Replicas, in rank order."""

    def rank(self, replica: int) -> int | None:
        return self.members.index(replica) if replica in self.members else None

    @property
    def world_size(self) -> int:
        return len(self.members)


def _parse_where(text: str) -> tuple[str, int, int | None] | None:
    """The host, pid and start time that ``where_this_runs``'s text names, or None for ""."""
    if not text:
        return None
    host, pid, *start = text.split(" ")
    return host, int(pid), int(start[0]) if start and start[0].isdigit() else None


def _live_key(replica: int, where: tuple[str, int, int | None]) -> str:
    """The key of one process's count (``Membership.beat``): each process of a replica has its own,
    so that an old process that runs on does not keep a dead newer one looking alive."""
    return f"live/{replica}/{where[0]}/{where[1]}/{where[2]}"


def _encode(members) -> str:
    return ",".join(str(m) for m in members)


def _decode(number: int, text: bytes | str) -> Generation:
    text = text.decode() if isinstance(text, bytes) else text
    return Generation(number, tuple(int(m) for m in text.split(",") if m))


class Membership:
    """The generations of one run in ``store`` (a client of the run's TCPStore: torch's EtcdStore
    has no compare_set)."""

    def __init__(self, store: dist.Store, replica: int, *, timeout_s: float = 60.0, launch: str = "",
                 still_s: float = 0.0):
        self.store = dist.PrefixStore(PREFIX, store)
        self.replica = replica
        self.launch = launch  # this node's launch (HEAL_LAUNCH), or "" when unknown
        self.where: str | None = None  # this process, as ``where/<replica>`` records it (``start``)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.formed_s: float | None = None
        # (generation, replica) of a heartbeat, or a ``live/`` key -> (its count, seen since)
        self._counts: dict[tuple[int, int] | str, tuple[int, float]] = {}
        self._asks: dict[int, tuple[int, float, bool]] = {}  # replica -> (its requests' count, seen since, moved)
        self.still_s = still_s
        self._beating: threading.Event | None = None
        self.replicas = self.size = 0  # the slot's replicas, and the group's size (``start``)

    def start(self, replicas: int, spares: int = 0, *, restarted: bool = False) -> tuple[Generation | None, bool]:
        """This process's first generation, or (None, True) when it is to join a running one
        (``join``). The run's first generation holds every replica but the spares (whoever comes
        first proposes it); a replica restarted before forming it forms it; one restarted after,
        and a spare, join. The process takes its replica (``where/<replica>``), and the first one
        of a launch records the launch (``launch/<replica>``); one that its torchrun started again
        (``restarted``) while a newer launch holds the replica ends first (``Superseded``)."""
        self.replicas, self.size = replicas, replicas - spares
        where_key, self.where = f"where/{self.replica}", where_this_runs()
        if self.launch and restarted:
            # Read before the launch: a newer launch that takes the replica from here on changes it,
            # and the compare-and-set below fails (then this process ends, not the newer one).
            before, held = self._read(where_key), self._read(f"launch/{self.replica}")
            if (held and held != self.launch) or self.store.compare_set(where_key, before, self.where).decode() != \
                    self.where:
                raise Superseded(f"replica {self.replica}: this process of launch {self.launch} was started again by "
                                 f"its torchrun, and a newer launch of its node ({held}) holds the replica: it ends")
        else:
            if self.launch:
                self.store.set(f"launch/{self.replica}", self.launch)
            self.store.set(where_key, self.where)
        self.store.delete_key(f"ended/{self.replica}")  # an older process's (or this one's, set up before)
        newest = self.newest() or self.propose(1, range(self.size))
        # The first generation, which it was to form and never did, it forms as its members do,
        # from the start; any later one (a heal's, a grow's, a restart's) it joins.
        if newest.number == 1 and self.replica in newest.members and not self.store.check([f"formed/1/{self.replica}"]):
            return newest, False
        return None, True

    def join(self, timeout_s: float, stop=lambda: False, before_restart=lambda: None) -> tuple[Generation, bool]:
        """Ask to join (``join/<replica>``) and wait for a generation proposed since that takes
        this replica in (rank 0's ``grow`` at a step's end, or the survivors' ``after_loss``);
        returns it, and True when it is a restart instead: every member of the newest generation
        is known dead (each exited after an error no heal covers), so the replicas that asked form
        the next one, to resume from the run's checkpoint (``before_restart()`` first: it raises
        when the run must not restart, e.g. after a FATAL stop). A spare of a whole group waits as
        long as the group stays whole; otherwise ``timeout_s`` without a new generation is an
        error. ``stop()`` true (a preemption signal): withdraw and end."""
        # Read before asking: a generation agreed before this process asked is not its to form, and
        # one proposed from the moment it asks may list it before its first read.
        self.check_current()
        newest = self.newest()
        asked_after = newest.number
        self.store.set(f"join/{self.replica}", f"{os.getpid()} {asked_after}")
        deadline, orphaned_at, next_orphan_check = time.monotonic() + timeout_s, None, 0.0
        next_ask = 0.0
        while True:
            if self.store.check(["finished"]):
                raise RunFinished(f"replica {self.replica}: the run finished at step "
                                  f"{self.store.get('finished').decode()} before it could join: nothing to do")
            now, newer = time.monotonic(), self.newest(after=newest.number)
            if newer.number != newest.number or (newer.world_size >= self.size and self.replica not in newer.members):
                deadline, orphaned_at = now + timeout_s, None
            newest = newer
            if (newest.number > asked_after and self.replica in newest.members
                    and not self.store.check([f"formed/{newest.number}/{self.replica}"])):
                self.store.delete_key(f"join/{self.replica}")
                return newest, self.store.check([f"restart/{newest.number}"])
            if stop():
                self.store.delete_key(f"join/{self.replica}")
                raise RunFinished(f"replica {self.replica}: stopped (a signal) while waiting to join the run")
            if now >= next_ask:  # it asks on: a joiner that stopped asking is not taken in (``asking``)
                self.store.add(f"asking/{self.replica}", 1)
                next_ask = now + ORPHAN_CHECK_S
            if now < next_orphan_check:
                pass
            elif self.superseded():
                self.check_current()
            elif not all([self.gone(m, newest) for m in newest.members if m != self.replica]):  # each looked at
                orphaned_at, next_orphan_check = None, now + ORPHAN_CHECK_S
            else:
                orphaned_at = orphaned_at or now
                asked = [r for r in range(self.replicas) if r == self.replica or self.asking(r)]
                if len(asked) == self.replicas or now - orphaned_at > RESTART_SETTLE_S:
                    before_restart()
                    # Before the proposal, so that whoever reads it reads this too.
                    self.store.set(f"restart/{newest.number + 1}", "1")
                    proposed = self.propose(newest.number + 1, asked[:self.size])
                    for r in proposed.members:
                        self.store.delete_key(f"join/{r}")
                    continue
            if now > deadline:
                raise TimeoutError(f"replica {self.replica} asked to join the run and no generation took it in "
                                   f"within {timeout_s:.0f} s (the newest: {newest.number}, {list(newest.members)})")
            time.sleep(JOIN_POLL_S)

    def outdated(self, generation: Generation) -> bool:
        """Whether a generation after ``generation`` was agreed (one store lookup): a step of
        ``generation`` computed now is not committed (a heal redoes it), nor a grow's (agreed at a
        step's end)."""
        return self.store.check([f"members/{generation.number + 1}"])

    def superseded(self) -> bool:
        """Whether a newer process holds this process's replica (``where/<replica>`` names
        another): its node was launched again while this one was frozen."""
        return self.where is not None and self._read(f"where/{self.replica}") not in ("", self.where)

    def check_current(self) -> None:
        """``Superseded`` when a newer process holds this process's replica; its request to join,
        if any, withdrawn (else the replica would look like a joiner until the newer one asks)."""
        if self.superseded():
            if self._read(f"join/{self.replica}").split(" ")[0] == str(os.getpid()):
                self.store.delete_key(f"join/{self.replica}")
            raise Superseded(f"replica {self.replica}: a newer process of it runs "
                             f"({self._read(f'where/{self.replica}')}; its node was launched again while "
                             "this one was frozen or cut off): this one takes part in nothing and ends")

    def restarts(self, upto: int) -> int:
        """How many generations up to ``upto`` were restarts (every member had died, and the run
        resumed from its checkpoint): the same count for every member of a generation."""
        return sum(self.store.check([f"restart/{n}"]) for n in range(2, upto + 1))

    def finish(self, step: int) -> None:
        """Rank 0, at the run's end: a replica that asks to join from now on ends (``RunFinished``)."""
        self.store.set("finished", str(step))

    def joiners(self, generation: Generation) -> list[int]:
        """The replicas outside ``generation`` that ask to join (``asking``)."""
        return [r for r in range(self.replicas) if r not in generation.members and self.asking(r)]

    def wanted(self, generation: Generation) -> list[int]:
        """The joiners that ``generation``, smaller than the group's size, takes in at a step's end
        (rank 0 looks at each step; spares wait while the group is whole)."""
        missing = self.size - generation.world_size
        return self.joiners(generation)[:missing] if missing > 0 else []

    def grow(self, generation: Generation, joiners: list[int] | None) -> Generation:
        """The next generation: ``generation``'s members (their ranks kept) and then ``joiners``
        (perhaps none: a joiner may have left since); proposed by rank 0 (``joiners`` a list), read
        by the others (None)."""
        number = generation.number + 1
        if joiners is None:
            return self._proposal_of(generation)
        proposed = self.propose(number, [*generation.members, *sorted(joiners)])
        for r in joiners:
            if r in proposed.members:  # a proposal that lost leaves the others' requests alone
                self.store.delete_key(f"join/{r}")
        return proposed

    def _proposal_of(self, generation: Generation) -> Generation:
        """The generation after ``generation`` once its rank 0 proposed it; ``ProposerLost`` once
        that member is known gone (``gone``: it died after the step's agreement to grow, before its
        proposal) instead of waiting the store's timeout for a proposal that never comes."""
        number, proposer = generation.number + 1, generation.members[0]
        deadline, look_at = time.monotonic() + self.timeout.total_seconds(), 0.0
        while not self.store.check([f"members/{number}"]):
            now = time.monotonic()
            if now >= look_at:
                if self.gone(proposer, generation):
                    raise ProposerLost(f"rank 0 of generation {generation.number} (replica {proposer}), which was to "
                                       f"propose generation {number} with the replicas that asked to join, is gone")
                look_at = now + ORPHAN_CHECK_S
            if now > deadline:
                raise TimeoutError(f"generation {number} was not proposed within {self.timeout.total_seconds():.0f} s")
            time.sleep(0.005)
        return _decode(number, self.store.get(f"members/{number}"))

    def process_of(self, replica: int, generation: Generation | None = None) -> tuple[str, int, int | None] | None:
        """The host, pid and start time (``process_start``; None if unrecorded) of the process that
        formed ``generation`` as ``replica`` (or of its newest process, without one), or None when
        none said so."""
        key = f"formed/{generation.number}/{replica}" if generation is not None else f"where/{replica}"
        if generation is not None and not self.store.check([key]):
            key = f"where/{replica}"
        return self._process(key)

    def _process(self, key: str) -> tuple[str, int, int | None] | None:
        """The process a record (``where_this_runs``'s text) names, or None without one."""
        return _parse_where(self._read(key))

    def _read(self, key: str) -> str:
        """``key``'s text in the store, or "" without one."""
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def beat(self, connect: Callable[[], dist.Store] | None = None, period_s: float = LIVE_BEAT_S) -> None:
        """Count this process's ``live/<replica>/<process>`` every ``period_s`` from a thread of
        its own until ``end``: whatever the process does (forming a group, building its model, a
        step, an evaluation, a save), the others on another host know it lives while the count
        moves (``still``). Through a client of the run's store of its own, ``connect()``, made in
        the thread and made again after an error (so that no wait on the main client delays a
        beat, and a broken connection does not make a live process look dead); ``self.store``
        without one."""
        stop = self._beating = threading.Event()
        key = _live_key(self.replica, _parse_where(where_this_runs()))

        def run() -> None:
            beats, failed = (self.store if connect is None else None), False
            while True:
                try:
                    if beats is None:
                        beats = dist.PrefixStore(PREFIX, connect())
                    beats.add(key, 1)
                    failed = False
                except Exception as err:  # noqa: BLE001  (the store lost or cut off: made again at the next beat)
                    if not failed:
                        log.warning("replica %d could not count that it lives in the run's store (%s: %s); "
                                    "trying again every %g s", self.replica, type(err).__name__, err, period_s)
                    beats, failed = (self.store if connect is None else None), True
                if stop.wait(period_s):
                    return

        threading.Thread(target=run, name="heal-live", daemon=True).start()

    def end(self) -> None:
        """This process leaves the run for good (its interpreter exits): its count stops (``beat``)
        and ``ended/<replica>`` names it, so that the others know it gone at once even from another
        host, where its pid cannot be read and its heartbeat says it left on purpose (-1)."""
        if self._beating is not None:
            self._beating.set()
        self.store.set(f"ended/{self.replica}", where_this_runs())

    def gone(self, replica: int, generation: Generation | None = None, *, silent_s: float | None = None) -> bool:
        """Whether ``replica``'s process (see ``process_of``) is known dead: it ran on this host and
        its pid is gone (or names another process since: another start time), a zombie, or stopped
        (SIGSTOP). A stopped one is killed here: it takes part in nothing, and its torchrun (which
        waits for it) and the launcher (which waits for every rank's job) would never end; killed,
        its torchrun starts it again or ends. A member of ``generation`` on another host is known
        gone once its replica has started a newer process there (``where/<replica>``: its torchrun
        starts one only once the old one ended, or was sent SIGKILL), or once its heartbeat in
        ``generation``'s training has stood still for ``silent_s`` (default ``REMOTE_SILENT_S``:
        ``silent``), or once its own count has (``live/<replica>/<process>``, ``beat``: from its
        start to its end, the peer monitor on or off; ``still``), or once it said it ended (``end``: its
        training finished, and no torchrun starts it again); otherwise it is waited for. Wherever
        it ran, a member of ``generation`` is gone once a newer process of its replica asks to
        join having seen that generation (``asked_after``: one whose formation failed has no
        ``formed/`` record to tell it by).
        (A node launched again while its old processes live: they end, ``Superseded``.)"""
        where = self.process_of(replica, generation)
        if where is None:
            return False
        if generation is not None and self.asked_after(replica) >= generation.number:
            return True  # a newer process of the replica asks to join, having seen the generation
        if where[0] != socket.gethostname():
            if self._process(f"ended/{replica}") == where:
                return True
            if self.still(replica, where):
                return True  # dead, frozen or cut off, whatever it was doing
            replaced = self.process_of(replica) != where  # its replica's newer process: the old one ended
            return generation is not None and (replaced or self.silent(replica, generation, silent_s))
        state = process_state(where[1]) if where[2] in (None, process_start(where[1])) else None
        if state == "T":
            kill(where, f"replica {replica} is stopped")
        return state in (None, "Z", "X", "T")

    def asked_after(self, replica: int) -> int:
        """The newest generation that ``replica``'s request to join (``join``) had seen, or -1
        without one. A process asks only at its start: the process that was the replica's member of
        that generation, or of any before, is gone (a member of a generation that never formed,
        whose formation failed, included: no ``formed/`` record tells of it)."""
        fields = self._read(f"join/{replica}").split(" ")
        return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else -1

    def asking(self, replica: int) -> bool:
        """Whether ``replica`` asks to join (``join/<replica>``) and is known to ask on: on this
        host, its newest process lives (``gone``); on another host, its requests' count
        (``asking/<replica>``, counted every ``ORPHAN_CHECK_S`` while it waits) has moved since this
        process first looked (each call looks once), and within ``REMOTE_SILENT_S``. A request left
        by a process killed or cut off while it waited is never taken for one."""
        if not self.store.check([f"join/{replica}"]):
            return False
        where = self.process_of(replica)
        if where is None or where[0] == socket.gethostname():
            return not self.gone(replica)
        if self._process(f"ended/{replica}") == where:
            return False
        key = f"asking/{replica}"
        count = int(self.store.get(key)) if self.store.check([key]) else 0
        now, seen = time.monotonic(), self._asks.get(replica)  # (count, since, moved)
        if seen is None or seen[0] != count:
            self._asks[replica] = (count, now, seen is not None)
            return seen is not None
        return seen[2] and now - seen[1] < REMOTE_SILENT_S

    def still(self, replica: int, where: tuple[str, int, int | None]) -> bool:
        """Whether the count of ``replica``'s process ``where`` (``beat``) has stood still for
        ``REMOTE_SILENT_S``, or ``recovery.peer_timeout_s`` if longer (``still_s``: a pause that
        setting allows is not a loss), since this process first saw its value (each call looks
        once). A process that never counted is not: it may be about to."""
        key = _live_key(replica, where)
        count = int(self.store.get(key)) if self.store.check([key]) else 0
        return self._unchanged_for(key, count, max(REMOTE_SILENT_S, self.still_s))

    def silent(self, replica: int, generation: Generation, for_s: float | None = None) -> bool:
        """Whether ``replica``'s heartbeat in ``generation`` has stood still for ``for_s`` (default
        ``REMOTE_SILENT_S``) since this process first saw its value (each call looks once). One that
        never beat, or that stopped beating on purpose (-1: its training ended, or it is healing),
        is not."""
        rank = generation.rank(replica)
        if rank is None:
            return False
        beats = dist.PrefixStore(f"{HEARTBEATS}heal{generation.number}/", self.store.underlying_store)
        key = f"alive/{rank}"
        beat = int(beats.get(key)) if beats.check([key]) else 0
        return self._unchanged_for((generation.number, replica), beat, REMOTE_SILENT_S if for_s is None else for_s)

    def _unchanged_for(self, key, count: int, for_s: float) -> bool:
        """Whether ``count`` (a positive count another process keeps moving: ``silent``,
        ``still``) is the value this process first saw under ``key`` at least ``for_s`` ago."""
        if count <= 0:
            return False
        now, seen = time.monotonic(), self._counts.get(key)
        if seen is None or seen[0] != count:
            self._counts[key] = (count, now)
            return False
        return now - seen[1] >= for_s

    def after_loss(self, generation: Generation, wait_s: float, lost=(), silent_s: float | None = None) -> Generation:
        """The generation after ``generation`` lost a member: this replica says it is alive, waits
        until each other member has said so too or is known gone (``gone``), for at most
        ``wait_s``, and proposes those alive, then as many replicas that wait to join (spares, or
        lost ones started again) as keep the group its size. The first proposal wins; a replica
        left out of it is not a member (``form`` refuses it). Replicas in ``lost`` (named lost by
        the peer monitor: silent on another host) are not waited for, nor, with ``silent_s``, one on
        another host whose heartbeat has stood still that long: a survivor stops beating on purpose
        (-1) before it gets here, a member still in its step beats on, a dead or frozen one neither."""
        number = generation.number + 1
        self.check_current()
        self.store.set(f"alive/{number}/{self.replica}", "1")
        deadline = time.monotonic() + wait_s
        others = [m for m in generation.members if m != self.replica and m not in lost]
        while not self.store.check([f"members/{number}"]):
            said = {m for m in others if self.store.check([f"alive/{number}/{m}"])}
            # A list, not all()'s short cut: each member's heartbeat is looked at on every round.
            if all([m in said or self.gone(m, generation, silent_s=silent_s) for m in others]) or \
                    time.monotonic() > deadline:
                alive = [m for m in generation.members if m == self.replica or m in said]
                stand_ins = self.joiners(Generation(number, tuple(alive)))[:max(0, self.size - len(alive))]
                proposed = self.propose(number, [*alive, *stand_ins])
                for r in stand_ins:
                    if r in proposed.members:  # a proposal that lost leaves the others' keys alone
                        self.store.delete_key(f"join/{r}")
                return proposed
            time.sleep(0.005)
        return self.wait_for(number)

    def newest(self, after: int = 0) -> Generation | None:
        """The newest agreed generation (scanning up from ``after``), or None before the first."""
        number = after if after and self.store.check([f"members/{after}"]) else 0
        while self.store.check([f"members/{number + 1}"]):
            number += 1
        return _decode(number, self.store.get(f"members/{number}")) if number else None

    def propose(self, number: int, members) -> Generation:
        """Generation ``number`` with ``members``, unless someone proposed it first: then theirs.
        A generation number is never reused: after a group that failed to form, propose the
        newest one's number + 1."""
        if not members:
            raise ValueError(f"generation {number}: no members")
        return _decode(number, self.store.compare_set(f"members/{number}", "", _encode(members)))

    def wait_for(self, number: int, timeout_s: float | None = None) -> Generation:
        """Generation ``number`` once proposed (by anyone)."""
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else self.timeout
        self.store.wait([f"members/{number}"], timeout)
        return _decode(number, self.store.get(f"members/{number}"))

    def form(self, generation: Generation, backend: str, timeout_s: float) -> int:
        """Make ``generation``'s group this process's default group; returns this replica's rank
        in it. The previous default group is parked, not freed (a collective broken on a lost peer
        may hold one of its threads for good)."""
        self.check_current()
        rank = generation.rank(self.replica)
        if rank is None:
            raise ValueError(f"replica {self.replica} is not a member of generation {generation.number} "
                             f"({list(generation.members)})")
        newest = self.newest(after=generation.number)
        if newest is not None and newest.number > generation.number:
            raise ValueError(f"generation {generation.number} is stale: generation {newest.number} was proposed")
        if dist.is_initialized():  # every group, not only the default one: destroying drops them all
            park(*dist.distributed_c10d._world.pg_map)
            dist.destroy_process_group()
        group_store = dist.PrefixStore(f"group/{generation.number}/", self.store)
        started = time.monotonic()
        dist.init_process_group(backend, store=group_store, rank=rank, world_size=generation.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.formed_s = time.monotonic() - started
        self.store.set(f"formed/{generation.number}/{self.replica}", where_this_runs())
        return rank
