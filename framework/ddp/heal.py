"""Healing in place (``recovery.heal=in_place``): after a peer is lost mid-step, the survivors form
the next generation of the group in their processes (framework/ddp/membership.py) and continue
from the newest state one of them holds, sent to the others by broadcast; nothing is read from
disk and no process restarts. The trainer rebuilds what depends on the world size around it."""

from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger(__name__)


class Healing(Exception):
    """A peer was lost in step ``step + 1``: this rank holds ``state``, the whole state of ``step``
    (None: it holds none it can give, and why not in ``why_not``)."""

    def __init__(self, step: int, state: dict | None, why_not: str | None, cause: BaseException):
        super().__init__(f"a peer was lost in step {step + 1}: healing in place")
        self.step, self.state, self.why_not, self.cause = step, state, why_not, cause


class Growing(Exception):
    """Rank 0 saw a replica ask to join; every rank agreed at step ``step``, which is done."""

    def __init__(self, step: int):
        super().__init__(f"replicas join after step {step}")
        self.step = step


class NothingToHealFrom(RuntimeError):
    """No survivor holds a state to continue from."""


def newest_state(own: dict | None, step: int, *, rank: int, world_size: int) -> tuple[dict, int]:
    """Every member's step, then the state of the newest step any member holds, from the first
    member that holds it (one broadcast, skipped when every member holds it); returns the state and
    the rank it came from. A collective of the new generation."""
    mine = (step if own is not None else -1, rank)
    held: list = [None] * world_size
    dist.all_gather_object(held, mine)
    newest = max(s for s, _ in held)
    if newest < 0:
        raise NothingToHealFrom("no survivor holds a state to continue from")
    source = min(r for s, r in held if s == newest)
    if all(s == newest for s, _ in held):
        return own, source
    box = [own if rank == source else None]
    dist.broadcast_object_list(box, src=source)
    return box[0], source
