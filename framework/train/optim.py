"""Optimizer construction and the learning-rate schedule (a pure function of the step)."""

from __future__ import annotations

import math

import torch

from .config import PrecisionSection


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    """Linear warmup from 0 to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at
    ``total_steps``; constant ``min_lr`` after that. ``step`` counts from 0."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


class LRSchedule:
    """``lr_at`` with the run's settings; sets the rate on every param group, once per step."""

    def __init__(self, *, lr: float, warmup_steps: int, total_steps: int, min_lr: float):
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr = min_lr

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        rate = lr_at(step, lr=self.lr, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                     min_lr=self.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = rate
        return rate

    def after_step(self) -> None:
        """The rate is a function of the step: nothing to advance."""

    def state_dict(self) -> dict:
        return {"total_steps": self.total_steps, "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to load: the schedule follows the resumed run's configuration (the trainer
        recomputes total_steps after the restore); the saved values are for reading the file."""


class UserSchedule:
    """A user's optimizer keeps its own learning rate, driven by the user's scheduler (if any),
    which steps once per optimizer step, skipped steps included."""

    def __init__(self, scheduler=None):
        self.scheduler = scheduler
        self.total_steps = 0

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        return optimizer.param_groups[0]["lr"]

    def after_step(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)


class Precision:
    """The run's mixed precision, from the ``precision`` section: ``autocast`` (on or off),
    ``dtype`` (bf16 or fp16) and ``scaler`` (a GradScaler, enabled for fp16 only);
    ``context()`` is the autocast context a forward runs in."""

    Config = PrecisionSection  # the configuration's ``precision`` section, its first argument

    def __init__(self, section, *, device: torch.device):
        self.device_type = device.type
        self.autocast = section.autocast == "true" or (section.autocast == "auto" and device.type == "cuda")
        self.dtype = torch.bfloat16 if section.dtype == "bf16" else torch.float16
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.autocast and self.dtype == torch.float16)

    def context(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast)


def optimizer_and_schedule(cfg, model: torch.nn.Module, optimizer=None, lr_scheduler=None):
    """The run's optimizer and LR schedule: the built-in AdamW with warmup and cosine decay, or a
    user's ``optimizer`` (an Optimizer, or a factory ``params -> Optimizer``) with the user's
    ``lr_scheduler`` (a factory ``optimizer -> LRScheduler``), if any."""
    if optimizer is None and lr_scheduler is None:
        built = build_optimizer(model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                betas=(cfg.optim.beta1, cfg.optim.beta2), impl=cfg.optim.impl)
        return built, LRSchedule(lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, total_steps=0,
                                 min_lr=cfg.optim.min_lr)
    if optimizer is None:
        optimizer = build_optimizer(model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                    betas=(cfg.optim.beta1, cfg.optim.beta2), impl=cfg.optim.impl)
    elif not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
    return optimizer, UserSchedule(lr_scheduler(optimizer) if lr_scheduler is not None else None)


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), impl: str = "foreach") -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) only; biases and norms are not decayed.
    ``impl``: fused (one kernel over every parameter), foreach (one kernel per op over a list),
    for_loop, or auto = fused where every parameter is a floating CPU or CUDA tensor."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if impl == "auto":
        impl = "fused" if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) else "foreach"
    kernels = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[impl]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kernels)
