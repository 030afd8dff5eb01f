"""Optimizer construction and the learning-rate schedule (a pure function of the step)."""

from __future__ import annotations

import math

import torch


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

    def state_dict(self) -> dict:
        return {"total_steps": self.total_steps, "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: dict) -> None:
        # The schedule follows the resumed run's configuration: only recorded for inspection.
        self.saved = dict(state)


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) only; biases and norms are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)
