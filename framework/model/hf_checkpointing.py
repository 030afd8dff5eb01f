"""A Hugging Face model's own activation checkpointing: finding the model (also under PEFT or
inside a wrapper), enabling its checkpointing, keeping the user's."""

from __future__ import annotations

import functools
import inspect
import logging
import sys

import torch.nn as nn

from .offload import OffloadStats, offloaded_checkpoint

log = logging.getLogger(__name__)


def hf_model_in(model: nn.Module) -> nn.Module | None:
    """The outermost ``transformers.PreTrainedModel`` in ``model``: the model itself, the one a
    PEFT model wraps, or one inside a user's wrapper. None when transformers was never imported."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (or a PEFT model around one) whose forward takes
    transformers' loss keyword arguments (``num_items_in_batch``), decided as transformers.Trainer
    decides it: the model's ``accepts_loss_kwargs``, else a ``**kwargs`` in its forward. Its loss
    need not use them: see ``divides_by_num_items``."""
    hf = hf_model_in(model)
    get_base = getattr(model, "get_base_model", None)
    if hf is None or not (model is hf or (callable(get_base) and get_base() is hf)):
        return False  # a user's wrapper around it may not pass the keyword on
    flag = getattr(hf, "accepts_loss_kwargs", None)
    if flag is not None:
        return bool(flag)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(hf.forward).parameters.values())


def _loss_function(hf: nn.Module | None):
    """The transformers loss function ``hf`` computes its loss with (its ``loss_type`` in
    transformers' LOSS_MAPPING), or None."""
    if hf is None:
        return None
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # a transformers without the loss mapping
        return None
    return LOSS_MAPPING.get(getattr(hf, "loss_type", None))


def divides_by_num_items(model: nn.Module) -> bool:
    """Whether ``model`` takes ``num_items_in_batch`` (``accepts_loss_kwargs``) and its loss
    function divides its summed loss by it: a causal or masked LM's does; a classifier's, which
    takes ``**kwargs`` too, ignores it and returns its mean (transformers.Trainer then leaves the
    gradient n x W too large; the framework weighs that mean by its share of the labels instead)."""
    loss_function = _loss_function(hf_model_in(model))
    return (loss_function is not None and accepts_loss_kwargs(model)
            and "num_items_in_batch" in inspect.signature(loss_function).parameters)


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the transformers model in ``model`` computes a causal LM's loss, which shifts the
    labels inside (position 0 is never a target), so that its tokens are counted over
    ``labels[..., 1:]``: transformers.Trainer's rule (its LOSS_MAPPING; never an encoder-decoder)."""
    hf = hf_model_in(model)
    loss_function = _loss_function(hf)
    if loss_function is None:
        return False
    from transformers.loss.loss_utils import ForCausalLMLoss
    return loss_function is ForCausalLMLoss and not getattr(getattr(hf, "config", None), "is_encoder_decoder", False)


def hf_checkpointing_on(hf: nn.Module) -> bool:
    if hasattr(type(hf), "is_activation_checkpointing"):  # transformers 5; is_gradient_checkpointing is its old name
        return bool(hf.is_activation_checkpointing)
    return bool(getattr(hf, "is_gradient_checkpointing", False))


def _hf_enable(hf: nn.Module, use_reentrant: bool) -> None:
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"memory.activation_checkpointing: {type(hf).__name__} has no activation checkpointing of "
                         "its own; name its layers in memory.activation_checkpointing_modules for the framework to "
                         "wrap them")
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


def enable_hf(model: nn.Module, hf: nn.Module, mode: str, stats: OffloadStats) -> tuple[list[str], list[nn.Module]]:
    """Turn on ``hf``'s own checkpointing in ``mode`` (offload: with the framework's hooks, counting
    into ``stats``); returns the names of the checkpointing modules, and the modules holding a
    checkpoint function."""
    _hf_enable(hf, use_reentrant=mode == "reentrant")
    if mode == "reentrant":
        _inputs_require_grad(hf)
    wrapped, layers = _hf_layers(model)
    if mode == "offload":  # the framework's hooks, so the plan's stats count what moves
        for m in layers:
            m._gradient_checkpointing_func = functools.partial(offloaded_checkpoint, stats)
    log.info("activation checkpointing (%s): %s's own activation checkpointing (use_reentrant=%s%s) on %d "
             "modules: %s", mode, _describe(model, hf), mode == "reentrant",
             ", with the framework's CPU offload" if mode == "offload" else "", len(wrapped),
             ", ".join(wrapped[:4]) + (" ..." if len(wrapped) > 4 else ""))
    return wrapped, layers


def keep_users(model: nn.Module, hf: nn.Module, mode: str) -> tuple[list[str], list[nn.Module], str]:
    """The checkpointing the user enabled on ``hf``, kept: the checkpointing modules' names, the
    modules holding a checkpoint function, and its mode."""
    names, layers = _hf_layers(model)
    users_mode = _hf_mode(layers)
    if users_mode == "reentrant":
        _inputs_require_grad(hf)
    level = logging.INFO if mode in ("off", users_mode) else logging.WARNING
    log.log(level, "activation checkpointing: %s already checkpoints %d modules (%s), enabled by the user: kept "
            "as it is; memory.activation_checkpointing=%s and memory.activation_checkpointing_modules are not "
            "applied", 
            _describe(model, hf), len(names), users_mode, mode)
    return names, layers, users_mode


def prepare_hf_for_wrapping(model: nn.Module, hf: nn.Module, mode: str, targets: list[str]) -> None:
    if getattr(hf.config, "use_cache", False):  # a recomputed layer would append to the KV cache twice
        hf.config.use_cache = False
        log.info("use_cache turned off in %s's config: checkpointed layers must not write a KV cache",
                 type(hf).__name__)
    if mode == "reentrant":
        _inputs_require_grad(hf)
    log.info("activation checkpointing (%s): memory.activation_checkpointing_modules=%s names modules of %s, so "
             "the framework wraps them (the model's own checkpointing stays off)", mode, ",".join(targets),
             _describe(model, hf))
