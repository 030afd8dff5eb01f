"""Two tiled-MLP designs that are NOT safe under DDP, kept as test doubles for the failure matrix.

Both compute ``proj(gelu(fc(x)))`` over sequence chunks like framework.model.tiled_mlp.tiled_mlp,
but the MLP weights are not inputs of the autograd Function: backward reaches them through
nested autograd calls on the recomputed chunks.

- ``naive_tiled_mlp``: ``torch.autograd.backward`` once per chunk, so every weight's
  AccumulateGrad (and DDP's hook on it) fires once per chunk.
- ``grad_then_backward_tiled_mlp``: the original design's fix. ``torch.autograd.grad`` on every
  chunk but the last, accumulating into ``.grad`` by hand, and ``backward`` on the last, so each
  hook fires once; but DDP's graph traversal (find_unused_parameters) cannot see the weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _mlp(x: torch.Tensor, fc: nn.Linear, proj: nn.Linear) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, fc.weight, fc.bias)), proj.weight, proj.bias)


class _HiddenWeightsTiledMLP(torch.autograd.Function):
    """Forward over chunks without intermediates; the weights come in as modules, not tensors."""

    last_chunk_uses_backward_only = False  # False: backward per chunk; True: grad, then backward on the last

    @staticmethod
    def forward(ctx, x, chunks: int, fc: nn.Linear, proj: nn.Linear):
        ctx.save_for_backward(x)
        ctx.chunks, ctx.fc, ctx.proj = chunks, fc, proj
        with torch.no_grad():
            return torch.cat([_mlp(c, fc, proj) for c in x.chunk(chunks, dim=1)], dim=1)

    @classmethod
    def backward(cls, ctx, grad_out):
        (x,) = ctx.saved_tensors
        weights = [ctx.fc.weight, ctx.fc.bias, ctx.proj.weight, ctx.proj.bias]
        pieces = list(zip(x.chunk(ctx.chunks, dim=1), grad_out.chunk(ctx.chunks, dim=1), strict=False))
        grad_x = []
        for i, (xc, gc) in enumerate(pieces):
            xc = xc.detach().requires_grad_()
            with torch.enable_grad():
                out = _mlp(xc, ctx.fc, ctx.proj)
            if cls.last_chunk_uses_backward_only and i < len(pieces) - 1:
                gx, *gw = torch.autograd.grad(out, (xc, *weights), gc)
                for w, g in zip(weights, gw, strict=False):
                    if w.grad is None:
                        w.grad = g.clone()
                    else:
                        w.grad.add_(g)
                grad_x.append(gx)
            else:
                torch.autograd.backward(out, gc)  # fires every weight's AccumulateGrad hook
                grad_x.append(xc.grad)
        return torch.cat(grad_x, dim=1), None, None, None


class NaiveTiledMLPFunction(_HiddenWeightsTiledMLP):
    last_chunk_uses_backward_only = False


class GradThenBackwardTiledMLPFunction(_HiddenWeightsTiledMLP):
    last_chunk_uses_backward_only = True


def naive_tiled_mlp(x: torch.Tensor, chunks: int, fc: nn.Linear, proj: nn.Linear) -> torch.Tensor:
    """x (B, T, C) -> (B, T, C); each weight's gradient hook fires once per chunk."""
    return NaiveTiledMLPFunction.apply(x, chunks, fc, proj)


def grad_then_backward_tiled_mlp(x: torch.Tensor, chunks: int, fc: nn.Linear, proj: nn.Linear) -> torch.Tensor:
    """x (B, T, C) -> (B, T, C); hooks fire once, but the weights are invisible to DDP's traversal."""
    return GradThenBackwardTiledMLPFunction.apply(x, chunks, fc, proj)
