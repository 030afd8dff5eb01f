"""Tiled MLPs whose backward fires each parameter's gradient hook exactly once: the built-in
GPT's, and SwiGLU MLPs of user models (LoRA included)."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import typing
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .activation_checkpointing import module_matches

log = logging.getLogger(__name__)


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


# --- tiled SwiGLU MLPs of user models (LlamaMLP style), LoRA included ----------------------------

@dataclass(frozen=True)
class SwiGLUPlan:
    """How ``down(act(gate(x)) * up(x))`` is computed from a flat list of tensors: for each of
    gate, up and down, its weight and bias, then per active LoRA adapter A's weight and bias and B's
    weight and bias; ``adapters`` holds each projection's (dropout, scaling) per adapter."""
    act_fn: typing.Callable
    adapters: tuple[tuple[tuple[nn.Module, float], ...], ...]

    def sizes(self) -> list[int]:
        return [2 + 4 * len(a) for a in self.adapters]

    def stochastic(self) -> bool:
        return any(d.training and not isinstance(d, nn.Identity) for a in self.adapters for d, _ in a)


def _project(x, tensors, adapters):
    """The base projection plus B(A(dropout(x))) * scaling per LoRA adapter, as PEFT's lora.Linear computes it."""
    out = F.linear(x, tensors[0], tensors[1])
    dtype = out.dtype
    for i, (dropout, scaling) in enumerate(adapters):
        a_w, a_b, b_w, b_b = tensors[2 + 4 * i:6 + 4 * i]
        out = out + F.linear(F.linear(dropout(x.to(a_w.dtype)), a_w, a_b), b_w, b_b) * scaling
    return out.to(dtype)


def _swiglu(x, plan: SwiGLUPlan, tensors):
    n_gate, n_up, _ = plan.sizes()
    gate, up, down = tensors[:n_gate], tensors[n_gate:n_gate + n_up], tensors[n_gate + n_up:]
    hidden = plan.act_fn(_project(x, gate, plan.adapters[0])) * _project(x, up, plan.adapters[1])
    return _project(hidden, down, plan.adapters[2])


def _rng_state(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _replayed_rng(state, device: torch.device):
    """Run with the RNG as ``state`` left it (None: untouched), then restore the RNG as it was."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class TiledSwiGLUFunction(torch.autograd.Function):
    """``_swiglu`` over ``chunks`` slices of the sequence dimension (-2), like TiledMLPFunction:
    every tensor (frozen or trainable) is an explicit input and each trainable one gets its
    gradient, summed over the chunks, returned once, so DDP's hook fires exactly once. LoRA
    dropout draws its masks chunk by chunk; backward replays the RNG to draw the same ones."""

    @staticmethod
    def forward(ctx, x, chunks: int, plan: SwiGLUPlan, *tensors):
        ctx.save_for_backward(x, *tensors)
        ctx.chunks, ctx.plan = chunks, plan
        ctx.autocast = (x.device.type, torch.is_autocast_enabled(x.device.type),
                        torch.get_autocast_dtype(x.device.type))
        ctx.rng = _rng_state(x.device) if plan.stochastic() else None
        with torch.no_grad():
            return torch.cat([_swiglu(c, plan, tensors) for c in x.chunk(chunks, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad_out):
        x, *tensors = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        need_x, need = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        leaves = [t if t is None else t.detach().requires_grad_(n) for t, n in zip(tensors, need, strict=True)]
        wanted = [i for i, t in enumerate(leaves) if t is not None and need[i]]
        grads: list = [None] * len(tensors)
        for i in wanted:
            grads[i] = torch.zeros_like(tensors[i])
        grad_x = []
        with _replayed_rng(ctx.rng, x.device):
            for xc, gc in zip(x.chunk(ctx.chunks, dim=-2), grad_out.chunk(ctx.chunks, dim=-2), strict=True):
                xc = xc.detach().requires_grad_(need_x)
                with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    out = _swiglu(xc, ctx.plan, leaves)
                inputs = ([xc] if need_x else []) + [leaves[i] for i in wanted]
                got = torch.autograd.grad(out, inputs, gc)
                if need_x:
                    grad_x.append(got[0])
                for i, g in zip(wanted, got[int(need_x):], strict=True):
                    grads[i] += g
        return (torch.cat(grad_x, dim=-2) if need_x else None, None, None, *grads)


SWIGLU_PARTS = ("gate_proj", "up_proj", "down_proj")


def _lora_linear_class():
    layer = sys.modules.get("peft.tuners.lora.layer")
    return None if layer is None else layer.Linear


def _is_plain_linear(m: nn.Module) -> bool:
    # A subclass with its own forward (e.g. a quantized Linear) computes something else than F.linear.
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def _untileable(module: nn.Module) -> str | None:
    """Why ``module``'s projections cannot be tiled, or None. Not a SwiGLU MLP at all is an error."""
    if not all(hasattr(module, a) for a in (*SWIGLU_PARTS, "act_fn")):
        raise ValueError(f"memory.tiled_mlp_modules: {type(module).__name__} is not a SwiGLU MLP "
                         f"(down_proj(act_fn(gate_proj(x)) * up_proj(x)) needs {', '.join(SWIGLU_PARTS)}, act_fn)")
    lora = _lora_linear_class()
    for part in SWIGLU_PARTS:
        proj = getattr(module, part)
        if _is_plain_linear(proj):
            continue
        if lora is None or type(proj) is not lora or not _is_plain_linear(proj.base_layer):
            return f"{part} is a {type(proj).__name__}"
        variants = getattr(proj, "lora_variant", {})
        if variants:
            kinds = sorted({type(v).__name__ for v in variants.values()})
            return f"{part} uses a LoRA variant ({', '.join(kinds)})"
    return None


def _projection(proj: nn.Module) -> tuple[list, tuple]:
    """A projection's tensors and LoRA adapters as PEFT's lora.Linear.forward would use them now."""
    if _is_plain_linear(proj):
        return [proj.weight, proj.bias], ()
    if proj.disable_adapters and proj.merged:
        proj.unmerge()  # what PEFT's forward does
    base = proj.base_layer
    if proj.disable_adapters or proj.merged:
        return [base.weight, base.bias], ()
    tensors, adapters = [base.weight, base.bias], []
    for name in proj.active_adapters:
        if name in proj.lora_A:
            a, b = proj.lora_A[name], proj.lora_B[name]
            tensors += [a.weight, a.bias, b.weight, b.bias]
            adapters.append((proj.lora_dropout[name], proj.scaling[name]))
    return tensors, tuple(adapters)


def _tiled_swiglu_forward(module: nn.Module, chunks: int, original, x: torch.Tensor) -> torch.Tensor:
    projs = [getattr(module, part) for part in SWIGLU_PARTS]
    if any(p._forward_hooks or p._forward_pre_hooks for p in projs):  # e.g. PEFT's adapter_names hooks
        return original(x)
    parts = [_projection(p) for p in projs]
    plan = SwiGLUPlan(module.act_fn, tuple(adapters for _, adapters in parts))
    return TiledSwiGLUFunction.apply(x, chunks, plan, *(t for tensors, _ in parts for t in tensors))


def tile_user_mlps(model: nn.Module, chunks: int, modules: str) -> list[str]:
    """Tile the forward of every SwiGLU MLP of a user's ``model`` whose class name or qualified name
    matches ``modules`` (comma-separated) over ``chunks`` sequence slices. Projections may be
    nn.Linear or PEFT lora.Linear (tiled through, with the LoRA weights as explicit inputs); an MLP
    with another kind (a LoRA variant such as DoRA, a quantized layer) stays untiled, named in one
    warning. Returns the tiled modules' names."""
    targets = [t.strip() for t in modules.split(",") if t.strip()]
    if not chunks:
        return []
    if not targets:
        log.warning("memory.tiled_mlp_chunks applies to the built-in model only; set memory.tiled_mlp_modules to "
                    "your model's SwiGLU MLP class (e.g. LlamaMLP) or use framework.model.tiled_mlp.tiled_mlp in your "
                    "model's MLP")
        return []
    tiled, untiled = [], []
    for name, module in model.named_modules():
        if not name or not module_matches(name, module, targets) or any(name.startswith(t + ".") for t in tiled):
            continue
        problem = _untileable(module)
        if problem is None:
            module.forward = functools.partial(_tiled_swiglu_forward, module, chunks, module.forward)
            tiled.append(name)
        else:
            untiled.append(f"{name} ({problem})")
    if not tiled and not untiled:
        raise ValueError(f"memory.tiled_mlp_chunks={chunks}: no submodule matches memory.tiled_mlp_modules={targets}")
    if untiled:
        log.warning("tiled MLP: %d modules left untiled: %s", len(untiled), "; ".join(untiled))
    if tiled:
        log.info("tiled MLP (%d chunks) on %d modules: %s", chunks, len(tiled),
                 ", ".join(tiled[:4]) + (" ..." if len(tiled) > 4 else ""))
    return tiled
