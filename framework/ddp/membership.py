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
import time
from dataclasses import dataclass

import torch.distributed as dist

from .collectives import park

PREFIX = "ddp_framework/heal/"


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


def _encode(members) -> str:
    return ",".join(str(m) for m in members)


def _decode(number: int, text: bytes | str) -> Generation:
    text = text.decode() if isinstance(text, bytes) else text
    return Generation(number, tuple(int(m) for m in text.split(",") if m))


class Membership:
    """The generations of one run in ``store`` (a client of the run's TCPStore: torch's EtcdStore
    has no compare_set)."""

    def __init__(self, store: dist.Store, replica: int, *, timeout_s: float = 60.0):
        self.store = dist.PrefixStore(PREFIX, store)
        self.replica = replica
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.formed_s: float | None = None

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
        return rank
