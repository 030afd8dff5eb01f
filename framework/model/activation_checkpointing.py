"""Activation checkpointing that stays correct under DDP: the framework's wrapping of chosen
modules, or a Hugging Face model's own (framework/model/hf_checkpointing.py), optionally with
the tensors it keeps offloaded to the CPU (framework/model/offload.py)."""

from __future__ import annotations

import fnmatch
import functools
import logging
import typing
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..config import GradientCheckpointing
from .hf_checkpointing import enable_hf, hf_checkpointing_on, hf_model_in, keep_users, prepare_hf_for_wrapping
from .offload import OffloadStats, offloaded_checkpoint

log = logging.getLogger(__name__)

MODES = typing.get_args(GradientCheckpointing)


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


def _keyword_bound(forward, kwargs: dict):
    """``forward`` with its keyword arguments bound, for reentrant checkpoint (positional only), as
    Hugging Face does; a keyword tensor that requires grad would get no gradient, so it is refused."""
    for key, value in kwargs.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            raise ValueError(f"memory.activation_checkpointing=reentrant: keyword argument '{key}' requires grad, but "
                             "reentrant checkpointing passes gradients only to positional arguments; use "
                             "memory.activation_checkpointing=non_reentrant")
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
        return offloaded_checkpoint(plan.stats, forward, *args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def module_matches(name: str, module: nn.Module, targets: list[str]) -> bool:
    """Whether ``targets`` (class names, or fnmatch patterns of qualified names) name ``module``."""
    return type(module).__name__ in targets or any(fnmatch.fnmatchcase(name, t) for t in targets)


def _wrap_modules(model: nn.Module, mode: str, targets: list[str]) -> Checkpointing:
    plan = _register(model, Checkpointing("framework" if mode != "off" else "off", mode))
    if mode == "off":
        return plan
    for name, module in model.named_modules():
        if not name or not module_matches(name, module, targets):
            continue
        if any(name.startswith(w + ".") for w in plan.wrapped):
            continue
        module.forward = functools.partial(_checkpointed_forward, module.forward, plan, name, module)
        plan.wrapped.append(name)
    if not plan.wrapped:
        raise ValueError(f"memory.activation_checkpointing={mode}: no submodule matches "
                         f"memory.activation_checkpointing_modules={targets}")
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


def enable_checkpointing(model: nn.Module, mode: str, modules: str) -> Checkpointing:
    """Checkpoint ``model`` in ``mode`` and log which path does it: the framework's wrapping of
    ``modules`` (comma-separated class names or name patterns) or, for a Hugging Face model (also
    under PEFT or inside a wrapper) of which ``modules`` names nothing, the model's own
    checkpointing. Checkpointing the user already enabled on a Hugging Face model is kept."""
    assert mode in MODES, mode
    targets = [t.strip() for t in modules.split(",") if t.strip()]
    hf = hf_model_in(model)
    if hf is not None and hf_checkpointing_on(hf):
        names, layers, users_mode = keep_users(model, hf, mode)
        plan = Checkpointing("user", users_mode, wrapped=names, layers=layers)
    elif mode == "off":
        plan = Checkpointing("off", "off")
    elif hf is not None and not any(module_matches(n, m, targets) for n, m in model.named_modules() if n):
        plan = Checkpointing("hf", mode)
        plan.wrapped, plan.layers = enable_hf(model, hf, mode, plan.stats)
    else:
        if hf is not None:
            prepare_hf_for_wrapping(model, hf, mode, targets)
        return _wrap_modules(model, mode, targets)
    return _register(model, plan)
