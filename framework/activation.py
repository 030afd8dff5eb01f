"""Memory savers that stay correct under DDP: activation checkpointing, CPU offload of the
tensors that checkpointing keeps, and a tiled MLP whose backward fires each parameter's
gradient hook exactly once.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import typing
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import GradientCheckpointing

log = logging.getLogger(__name__)

MODES = typing.get_args(GradientCheckpointing)


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


def _checkpointed_forward(forward, mode: str, stats: OffloadStats, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if mode == "reentrant":
        return checkpoint(forward, *args, use_reentrant=True, **kwargs)
    if mode == "offload":
        with CpuOffload(stats):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _matches(name: str, module: nn.Module, targets: list[str]) -> bool:
    return type(module).__name__ in targets or any(fnmatch.fnmatchcase(name, t) for t in targets)


def apply_checkpointing(model: nn.Module, mode: str, targets: list[str]) -> tuple[list[str], OffloadStats]:
    """Checkpoint every submodule whose class name is in ``targets`` or whose qualified name
    matches one of them (fnmatch patterns). The instance's ``forward`` is replaced, so the
    state_dict keys do not change. A match inside an already wrapped module is left alone.
    Returns the wrapped names and the offload counters."""
    assert mode in MODES, mode
    stats = OffloadStats()
    if mode == "off":
        return [], stats
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if not name or not _matches(name, module, targets):
            continue
        if any(name.startswith(w + ".") for w in wrapped):
            continue
        module.forward = functools.partial(_checkpointed_forward, module.forward, mode, stats)
        wrapped.append(name)
    if not wrapped:
        raise ValueError(f"gradient_checkpointing={mode}: no submodule matches checkpoint_modules={targets}")
    log.info("activation checkpointing (%s) on %d modules: %s", mode, len(wrapped),
             ", ".join(wrapped[:4]) + (" ..." if len(wrapped) > 4 else ""))
    return wrapped, stats


def _mlp(x, fc_w, fc_b, proj_w, proj_b):
    return F.linear(F.gelu(F.linear(x, fc_w, fc_b)), proj_w, proj_b)


class TiledMLPFunction(torch.autograd.Function):
    """``proj(gelu(fc(x)))`` over ``chunks`` slices of the sequence dimension.

    Forward keeps no intermediates; backward recomputes one chunk at a time. The weights are
    explicit inputs, and their gradients, summed over the chunks, are returned once: autograd
    then accumulates each weight's gradient once per backward, so DDP's hook fires exactly once,
    whatever find_unused_parameters or static_graph say and however the chunk count changes."""

    @staticmethod
    def forward(ctx, x, chunks: int, fc_w, fc_b, proj_w, proj_b):
        ctx.save_for_backward(x, fc_w, fc_b, proj_w, proj_b)
        ctx.chunks = chunks
        ctx.autocast = (x.device.type, torch.is_autocast_enabled(x.device.type),
                        torch.get_autocast_dtype(x.device.type))
        with torch.no_grad():
            return torch.cat([_mlp(c, fc_w, fc_b, proj_w, proj_b) for c in x.chunk(chunks, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        weights = [w.detach().requires_grad_() for w in weights]
        grad_x = []
        grad_w = [torch.zeros_like(w) for w in weights]
        for xc, gc in zip(x.chunk(ctx.chunks, dim=1), grad_out.chunk(ctx.chunks, dim=1), strict=False):
            xc = xc.detach().requires_grad_()
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                out = _mlp(xc, *weights)
            gx, *gw = torch.autograd.grad(out, (xc, *weights), gc)
            grad_x.append(gx)
            for acc, g in zip(grad_w, gw, strict=False):
                acc += g
        return (torch.cat(grad_x, dim=1), None, *grad_w)


def tiled_mlp(x: torch.Tensor, chunks: int, fc: nn.Linear, proj: nn.Linear) -> torch.Tensor:
    """x (B, T, C) -> (B, T, C) through fc, GELU, proj, ``chunks`` sequence slices at a time."""
    return TiledMLPFunction.apply(x, chunks, fc.weight, fc.bias, proj.weight, proj.bias)
