"""Memory savers that stay correct under DDP: activation checkpointing (the framework's wrapping
of chosen modules, or a Hugging Face model's own), CPU offload of the tensors that checkpointing
keeps, and tiled MLPs (the built-in GPT's, and SwiGLU MLPs of user models, LoRA included) whose
backward fires each parameter's gradient hook exactly once.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import sys
import typing
from dataclasses import dataclass, field

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


@dataclass
class Checkpointing:
    """The activation checkpointing applied to one model. ``path``: "off"; "framework" (the
    framework wraps the modules named by checkpoint_modules); "hf" (a Hugging Face model's own
    checkpointing, enabled by the framework); "user" (the model's own, enabled by the user and
    kept). ``mode`` is one of MODES ("unknown" for a user's checkpoint function that does not say)."""
    path: str
    mode: str
    wrapped: list[str] = field(default_factory=list)
    stats: OffloadStats = field(default_factory=OffloadStats)
    layers: list[nn.Module] = field(default_factory=list)  # hf/user: the modules holding the checkpoint function
    switched_because: str = ""  # why switch_to_non_reentrant ran, if it did

    def can_switch(self) -> bool:
        """Whether reentrant checkpointing can be re-applied as non_reentrant."""
        if self.mode != "reentrant":
            return False
        return self.path == "framework" or all(isinstance(m._gradient_checkpointing_func, functools.partial)
                                               for m in self.layers)

    def switch_to_non_reentrant(self, reason: str) -> None:
        assert self.can_switch(), (self.path, self.mode)
        for m in self.layers:  # the same checkpoint function with use_reentrant=False; nothing else changes
            f = m._gradient_checkpointing_func
            keywords = {**f.keywords, "use_reentrant": False}
            m._gradient_checkpointing_func = functools.partial(f.func, *f.args, **keywords)
        self.mode, self.switched_because = "non_reentrant", reason
        log.warning("gradient checkpointing switched from reentrant to non_reentrant (%s path, %d modules): %s",
                    self.path, len(self.wrapped), reason)


_APPLIED = "_ddp_framework_checkpointing"  # the model's attribute holding its Checkpointing


def _register(model: nn.Module, plan: Checkpointing) -> Checkpointing:
    setattr(model, _APPLIED, plan)
    return plan


def checkpointing_of(model: nn.Module) -> Checkpointing | None:
    """The checkpointing ``enable_checkpointing`` or ``apply_checkpointing`` applied to ``model``
    (the DDP policy may switch its mode)."""
    return vars(model).get(_APPLIED)


def _offloaded_checkpoint(stats: OffloadStats, function, *args, **kwargs):
    with CpuOffload(stats):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _keyword_bound(forward, kwargs: dict):
    """``forward`` with its keyword arguments bound, for reentrant checkpoint (positional only), as
    Hugging Face does; a keyword tensor that requires grad would get no gradient, so it is refused."""
    for key, value in kwargs.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            raise ValueError(f"gradient_checkpointing=reentrant: keyword argument '{key}' requires grad, but "
                             "reentrant checkpointing passes gradients only to positional arguments; use "
                             "gradient_checkpointing=non_reentrant")
    return functools.partial(forward, **kwargs)


def _reentrant_drops_gradients(module: nn.Module, args: tuple) -> bool:
    """Reentrant checkpoint builds a graph only when a positional tensor argument requires grad
    (torch checks the top level only); otherwise the module's parameters get no gradient, and a
    loss reached only through such modules has no grad_fn at all."""
    return (not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            and any(p.requires_grad for p in module.parameters()))


def _checkpointed_forward(forward, plan: Checkpointing, name: str, module: nn.Module, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if plan.mode == "reentrant" and _reentrant_drops_gradients(module, args):
        plan.switch_to_non_reentrant(
            f"module '{name}' ({type(module).__name__}) receives no input that requires grad (e.g. the model's "
            "input, or a frozen module's output), so reentrant checkpointing would give its parameters no gradient "
            "(or fail with autograd's 'element 0 of tensors does not require grad'); non_reentrant computes them")
    if plan.mode == "reentrant":
        return checkpoint(_keyword_bound(forward, kwargs) if kwargs else forward, *args, use_reentrant=True)
    if plan.mode == "offload":
        return _offloaded_checkpoint(plan.stats, forward, *args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _matches(name: str, module: nn.Module, targets: list[str]) -> bool:
    return type(module).__name__ in targets or any(fnmatch.fnmatchcase(name, t) for t in targets)


def _wrap_modules(model: nn.Module, mode: str, targets: list[str]) -> Checkpointing:
    plan = _register(model, Checkpointing("framework" if mode != "off" else "off", mode))
    if mode == "off":
        return plan
    for name, module in model.named_modules():
        if not name or not _matches(name, module, targets):
            continue
        if any(name.startswith(w + ".") for w in plan.wrapped):
            continue
        module.forward = functools.partial(_checkpointed_forward, module.forward, plan, name, module)
        plan.wrapped.append(name)
    if not plan.wrapped:
        raise ValueError(f"gradient_checkpointing={mode}: no submodule matches checkpoint_modules={targets}")
    log.info("activation checkpointing (%s) on %d modules: %s", mode, len(plan.wrapped),
             ", ".join(plan.wrapped[:4]) + (" ..." if len(plan.wrapped) > 4 else ""))
    return plan


def apply_checkpointing(model: nn.Module, mode: str, targets: list[str]) -> tuple[list[str], OffloadStats]:
    """Checkpoint every submodule whose class name is in ``targets`` or whose qualified name
    matches one of them (fnmatch patterns). The instance's ``forward`` is replaced, so the
    state_dict keys do not change. A match inside an already wrapped module is left alone.
    Returns the wrapped names and the offload counters."""
    assert mode in MODES, mode
    plan = _wrap_modules(model, mode, targets)
    return plan.wrapped, plan.stats


# --- Hugging Face models -----------------------------------------------------------------------

def hf_model_in(model: nn.Module) -> nn.Module | None:
    """The outermost ``transformers.PreTrainedModel`` in ``model``: the model itself, the one a
    PEFT model wraps, or one inside a user's wrapper. None when transformers was never imported."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def _hf_checkpointing_on(hf: nn.Module) -> bool:
    if hasattr(type(hf), "is_activation_checkpointing"):  # transformers 5; is_gradient_checkpointing is its old name
        return bool(hf.is_activation_checkpointing)
    return bool(getattr(hf, "is_gradient_checkpointing", False))


def _hf_enable(hf: nn.Module, use_reentrant: bool) -> None:
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(hf).__name__} has no activation checkpointing of its own; "
                         "name its layers in checkpoint_modules for the framework to wrap them")
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers 5: gradient_checkpointing_enable's new name
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _hf_layers(model: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """The modules that hold a checkpoint function (names of those checkpointing, and all of them)."""
    pretrained = sys.modules["transformers"].PreTrainedModel
    holders = [(n, m) for n, m in model.named_modules() if getattr(m, "_gradient_checkpointing_func", None)]
    names = [n for n, m in holders if getattr(m, "gradient_checkpointing", False) is True
             and not isinstance(m, pretrained)]
    return names, [m for _, m in holders]


def _hf_mode(layers: list[nn.Module]) -> str:
    funcs = [m._gradient_checkpointing_func for m in layers if getattr(m, "gradient_checkpointing", False) is True]
    if not funcs or not all(isinstance(f, functools.partial) for f in funcs):
        return "unknown"
    reentrant = {f.keywords.get("use_reentrant") is not False for f in funcs}  # torch's default is reentrant
    return "unknown" if len(reentrant) > 1 else ("reentrant" if reentrant.pop() else "non_reentrant")


def _inputs_require_grad(hf: nn.Module) -> None:
    """Reentrant checkpointing passes gradients only when a checkpointed layer's input requires
    grad; with frozen embeddings (LoRA) it does not, so, as HF and PEFT do, make it."""
    if not (getattr(hf, "_require_grads_hooks", None) or getattr(hf, "_require_grads_hook", None)):
        hf.enable_input_require_grads()


def _describe(model: nn.Module, hf: nn.Module) -> str:
    return type(hf).__name__ + ("" if model is hf else f" (inside {type(model).__name__})")


def _enable_hf(model: nn.Module, hf: nn.Module, mode: str) -> Checkpointing:
    _hf_enable(hf, use_reentrant=mode == "reentrant")
    if mode == "reentrant":
        _inputs_require_grad(hf)
    plan = Checkpointing("hf", mode)
    plan.wrapped, plan.layers = _hf_layers(model)
    if mode == "offload":  # the framework's hooks, so trainer.offload_stats counts what moves
        for m in plan.layers:
            m._gradient_checkpointing_func = functools.partial(_offloaded_checkpoint, plan.stats)
    log.info("activation checkpointing (%s): %s's own activation checkpointing (use_reentrant=%s%s) on %d "
             "modules: %s", mode, _describe(model, hf), mode == "reentrant",
             ", with the framework's CPU offload" if mode == "offload" else "", len(plan.wrapped),
             ", ".join(plan.wrapped[:4]) + (" ..." if len(plan.wrapped) > 4 else ""))
    return plan


def _keep_users(model: nn.Module, hf: nn.Module, mode: str) -> Checkpointing:
    names, layers = _hf_layers(model)
    plan = Checkpointing("user", _hf_mode(layers), wrapped=names, layers=layers)
    if plan.mode == "reentrant":
        _inputs_require_grad(hf)
    level = logging.INFO if mode in ("off", plan.mode) else logging.WARNING
    log.log(level, "activation checkpointing: %s already checkpoints %d modules (%s), enabled by the user: kept "
            "as it is; gradient_checkpointing=%s and checkpoint_modules are not applied",
            _describe(model, hf), len(names), plan.mode, mode)
    return plan


def _prepare_hf_for_wrapping(model: nn.Module, hf: nn.Module, mode: str, targets: list[str]) -> None:
    if getattr(hf.config, "use_cache", False):  # a recomputed layer would append to the KV cache twice
        hf.config.use_cache = False
        log.info("use_cache turned off in %s's config: checkpointed layers must not write a KV cache",
                 type(hf).__name__)
    if mode == "reentrant":
        _inputs_require_grad(hf)
    log.info("activation checkpointing (%s): checkpoint_modules=%s names modules of %s, so the framework "
             "wraps them (the model's own checkpointing stays off)", mode, ",".join(targets), _describe(model, hf))


def enable_checkpointing(model: nn.Module, mode: str, modules: str) -> Checkpointing:
    """Checkpoint ``model`` in ``mode`` and log which path does it: the framework's wrapping of
    ``modules`` (comma-separated class names or name patterns) or, for a Hugging Face model (also
    under PEFT or inside a wrapper) of which ``modules`` names nothing, the model's own
    checkpointing. Checkpointing the user already enabled on a Hugging Face model is kept."""
    assert mode in MODES, mode
    targets = [t.strip() for t in modules.split(",") if t.strip()]
    hf = hf_model_in(model)
    if hf is not None and _hf_checkpointing_on(hf):
        plan = _keep_users(model, hf, mode)
    elif mode == "off":
        plan = Checkpointing("off", "off")
    elif hf is not None and not any(_matches(n, m, targets) for n, m in model.named_modules() if n):
        plan = _enable_hf(model, hf, mode)
    else:
        if hf is not None:
            _prepare_hf_for_wrapping(model, hf, mode, targets)
        return _wrap_modules(model, mode, targets)
    return _register(model, plan)


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
        raise ValueError(f"tiled_mlp_modules: {type(module).__name__} is not a SwiGLU MLP "
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
        log.warning("tiled_mlp_chunks applies to the built-in model only; set tiled_mlp_modules to your model's "
                    "SwiGLU MLP class (e.g. LlamaMLP) or use framework.activation.tiled_mlp in your model's MLP")
        return []
    tiled, untiled = [], []
    for name, module in model.named_modules():
        if not name or not _matches(name, module, targets) or any(name.startswith(t + ".") for t in tiled):
            continue
        problem = _untileable(module)
        if problem is None:
            module.forward = functools.partial(_tiled_swiglu_forward, module, chunks, module.forward)
            tiled.append(name)
        else:
            untiled.append(f"{name} ({problem})")
    if not tiled and not untiled:
        raise ValueError(f"tiled_mlp_chunks={chunks}: no submodule matches tiled_mlp_modules={targets}")
    if untiled:
        log.warning("tiled MLP: %d modules left untiled: %s", len(untiled), "; ".join(untiled))
    if tiled:
        log.info("tiled MLP (%d chunks) on %d modules: %s", chunks, len(tiled),
                 ", ".join(tiled[:4]) + (" ..." if len(tiled) > 4 else ""))
    return tiled
