"""CPU offload of the tensors that activation checkpointing keeps for the recomputation."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """What the offload hooks moved: tensors and bytes packed in forward, unpacked in backward."""
    packed: int = 0
    packed_bytes: int = 0
    unpacked: int = 0
    unpacked_bytes: int = 0


class CpuOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors go to (pinned) CPU memory in forward and come back in backward.

    Wrapped around a non-reentrant ``checkpoint`` call, it sees exactly the tensors checkpointing
    keeps for the recomputation (the block's inputs); the block's inner activations are not
    saved at all. On CPU the round trip is the identity, so only the counts change."""

    def __init__(self, stats: OffloadStats):
        def pack(t: torch.Tensor):
            nbytes = t.numel() * t.element_size()
            stats.packed += 1
            stats.packed_bytes += nbytes
            if t.device.type == "cuda":
                host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
                host.copy_(t, non_blocking=True)
                return t.device, host, nbytes
            return t.device, t, nbytes

        def unpack(packed) -> torch.Tensor:
            device, t, nbytes = packed
            stats.unpacked += 1
            stats.unpacked_bytes += nbytes
            return t.to(device, non_blocking=True)

        super().__init__(pack, unpack)


def offloaded_checkpoint(stats: OffloadStats, function, *args, **kwargs):
    """Non-reentrant checkpoint of ``function`` with its kept tensors offloaded, counted in ``stats``."""
    with CpuOffload(stats):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
