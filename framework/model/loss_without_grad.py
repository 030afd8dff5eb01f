"""Diagnosing autograd's "element 0 of tensors does not require grad and does not have a grad_fn"
at the backward of a loss: which module left the loss without a gradient, why, and the fix.

The usual cause is the user's own ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``
around a module whose inputs need no gradient (the model's input, or a frozen embedding's
output): reentrant checkpoint then runs the module under no_grad and builds no graph, so its
parameters get no gradient, and a loss reached only through such modules has no grad_fn. The
framework cannot intercept that call; it re-runs the forward once, after the error, with a hook on
every module and torch's "None of the inputs have requires_grad=True" warning, to name the module.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from typing import Callable

import torch
import torch.nn as nn

from ..resilience.markers import FatalError

log = logging.getLogger(__name__)

AUTOGRAD_NO_GRAD = "does not require grad and does not have a grad_fn"
CHECKPOINT_WARNING = "None of the inputs have requires_grad=True"  # torch.utils.checkpoint, reentrant only


class LossWithoutGradError(FatalError):
    """The loss has no gradient to propagate; every step would fail the same way."""


def _label(name: str, module: nn.Module) -> str:
    return f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def _checkpointed_module(function, names: dict) -> nn.Module | None:
    """The module that ``function`` (reentrant checkpoint's run_function) runs: the module itself,
    one of its bound methods (``block.forward``), or either inside a functools.partial."""
    while isinstance(function, functools.partial):
        function = function.func
    module = getattr(function, "__self__", function)
    return module if id(module) in names else None


def _run_function_of_warning() -> object | None:
    """Reentrant checkpoint's ``run_function``, read from the frame that is warning (its forward)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "forward" and "run_function" in frame.f_locals:
            return frame.f_locals["run_function"]
        frame = frame.f_back
    return None


def reentrant_without_grad_inputs(model: nn.Module, forward: Callable[[], object]) -> list[str]:
    """Run ``forward()`` (grad enabled) and return, for each reentrant checkpoint that got no input
    requiring grad, the module it ran and the module whose forward called it, as one label."""
    names = {id(m): (n, m) for n, m in model.named_modules()}
    stack: list[nn.Module] = []  # the modules whose forward is running
    pending: list[object] = []  # run_function of a checkpoint that has just warned
    found: list[str] = []

    def caller() -> str:
        return _label(*names[id(stack[-1])]) if stack else "the model"

    def settle(entered: nn.Module | None) -> None:
        """Name the checkpoint that warned: by its function, else the module it entered under no_grad."""
        while pending:
            module = _checkpointed_module(pending.pop(0), names)
            if module is None and not pending and entered is not None and not torch.is_grad_enabled():
                module = entered  # the last checkpoint's function is running it
            what = _label(*names[id(module)]) if module is not None else "a function"
            found.append(f"{what} in the forward of {caller()}")

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if CHECKPOINT_WARNING in str(message):
            pending.append(_run_function_of_warning())

    def pre(module, args):
        settle(module)
        stack.append(module)

    def post(module, args, output):
        settle(None)
        stack.pop()

    handles = [h for _, m in names.values()
               for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post, always_call=True))]
    try:
        with warnings.catch_warnings(), torch.enable_grad():
            warnings.simplefilter("always")
            warnings.showwarning = on_warning  # restored by catch_warnings
            forward()
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(found))


def diagnose_loss_without_grad(err: BaseException, model: nn.Module,
                               forward: Callable[[], object] | None) -> LossWithoutGradError | None:
    """The diagnosis of autograd's raw no-grad error ``err`` (None for any other error): the module,
    the cause and the fix on the first line, autograd's own line after it. The module is found by
    re-running ``forward()`` (the failed forward of ``model``) when it is given."""
    text = str(err)
    if AUTOGRAD_NO_GRAD not in text:
        return None
    raw = f"\nautograd's error: {text.splitlines()[0]}"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return LossWithoutGradError("the loss has no gradient: every parameter of the model has requires_grad=False. "
                                    f"Fix: unfreeze the parameters to train (p.requires_grad_(True)).{raw}")
    found: list[str] = []
    unnamed = "the forward was not re-run"
    if forward is not None:
        try:
            found = reentrant_without_grad_inputs(model, forward)
            unnamed = "a re-run of the forward saw no reentrant checkpoint without such inputs"
        except RuntimeError as rerun_err:  # best effort: the original error is what the user must see
            unnamed = f"re-running the forward failed: {type(rerun_err).__name__}"
            log.debug("re-running the forward to name the module failed", exc_info=True)
    if found:
        few = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        return LossWithoutGradError(
            f"the loss has no gradient: torch.utils.checkpoint.checkpoint(use_reentrant=True) got no input that "
            f"requires grad for {few}, so it built no graph there. Fix: pass use_reentrant=False to that call, or "
            "make its input require grad (inputs.requires_grad_(True); a Hugging Face model: "
            "model.enable_input_require_grads()), or drop the call and set memory.activation_checkpointing="
            f"non_reentrant with memory.activation_checkpointing_modules naming the module.{raw}")
    return LossWithoutGradError(
        f"the loss has no gradient: it reaches none of the {len(trainable)} parameters that require grad, and the "
        f"module cannot be named ({unnamed}). Causes: a reentrant checkpoint (use_reentrant=True) whose inputs need "
        "no grad, a forward under torch.no_grad(), or a .detach() in the model or loss_fn. Fix: use_reentrant=False "
        "or inputs.requires_grad_(True) for such a checkpoint (or memory.activation_checkpointing=non_reentrant "
        f"instead of the model's own call); remove the no_grad or the detach.{raw}")
