"""The per-step agreement: one fused all-reduce of a small tensor, so every rank takes the
same path. Each slot is summed across ranks; a flag slot is "set" when any rank set it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ddp import collectives

SLOTS = ("loss_sum", "stop", "nonfinite", "oom", "preempt", "agent_lost", "save_due", "grow")


@dataclass(frozen=True)
class Agreement:
    loss: float  # mean of the ranks' losses
    stop: bool
    nonfinite: bool
    oom: bool
    preempt: bool
    agent_lost: bool = False  # some rank's torchrun agent died (framework/ddp/process_group.agent_gone)
    save_due: bool = False  # rank 0's clock says a timed checkpoint is due (checkpoint.every_minutes)
    grow: bool = False  # rank 0 saw a replica ask to join (healing in place): the group grows after this step


def spread(values: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The values that differ between ranks, as ``name -> (min, max)``; one all-reduce (MAX of the
    values and of their negations). Every rank gets the same answer."""
    names = list(values)
    mine = torch.tensor([float(values[n]) for n in names], dtype=torch.float64)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    n = len(names)
    return {name: (-both[n + i].item(), both[i].item()) for i, name in enumerate(names) if both[i] != -both[n + i]}


def agree(*, loss: torch.Tensor, world_size: int, distributed: bool, **flags: bool | torch.Tensor) -> Agreement:
    """All-reduce this rank's loss and flags (unknown flag names are an error) in one call.
    ``loss`` may be a device tensor: nothing is synchronised before the collective. Healing in
    place, a peer named lost ends the wait (``collectives.PeerLostError``)."""
    unknown = set(flags) - set(SLOTS[1:])
    assert not unknown, f"unknown control flags {unknown}"
    values = [loss.detach().to(torch.float64).reshape(())]
    for name in SLOTS[1:]:
        flag = flags.get(name, False)
        values.append(flag.detach().to(device=loss.device, dtype=torch.float64).reshape(())
                      if isinstance(flag, torch.Tensor)
                      else torch.tensor(float(flag), dtype=torch.float64, device=loss.device))
    buf = torch.stack(values)
    if distributed:
        collectives.all_reduce(buf, breaker=collectives.BREAKER, what="the agreement")
    out = buf.tolist()
    return Agreement(out[0] / world_size, *(v > 0 for v in out[1:]))
