"""Run under torchrun with 2 ranks: a user model whose reentrant-checkpointed modules receive only
inputs that need no grad (a frozen encoder's output), trained through DDPTrainer's DDP policy,
against the plain single-process model on the global batch."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from tests.dist_helper import run_cases

CASES = {"adapter_and_head": {"memory.activation_checkpointing_modules": "adapter,head"},
         "adapter": {"memory.activation_checkpointing_modules": "adapter"}}


class FrozenThenAdapter(nn.Module):
    """A frozen encoder whose output (no grad) feeds a trainable adapter, then a head; the input
    itself needs no grad either. Under reentrant checkpointing of adapter and head, no
    checkpointed module receives an input that needs grad."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 8).requires_grad_(False)
        self.adapter = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.adapter(torch.relu(self.encoder(x)))))


def dataset(n=64):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def run_case(name, overrides, out_dir):
    import torch.distributed as dist

    from framework.data.sampler import ResumableDistributedSampler
    from framework.data.batches import fetch
    from framework.trainer import DDPTrainer

    data = dataset()
    cfg = {"memory.activation_checkpointing": "reentrant", "batch_size": 4, "num_workers": 0,
           "logging.tensorboard": False,
           "logging.dir": str(out_dir / name), "checkpoint.dir": str(out_dir / name / "ck"), **overrides}
    trainer = DDPTrainer(cfg, model=FrozenThenAdapter(), train_dataset=data, loss_fn=nn.functional.mse_loss)
    world = dist.get_world_size()
    glob = ResumableDistributedSampler(len(data), 1, 0, trainer.config.data.batch_size * world, 1,
                                       trainer.config.train.seed)
    mine, full = iter(trainer.stream.loader), iter(glob)
    diffs = []
    for _ in range(3):
        trainer.forward_backward([next(mine)])
        ref = FrozenThenAdapter()
        x, y = fetch(data, next(full))
        nn.functional.mse_loss(ref(x), y).backward()
        for n, p in trainer.raw_model.named_parameters():
            r = ref.get_parameter(n).grad
            diffs.append(0.0 if p.grad is None and r is None else
                         float("inf") if p.grad is None or r is None else (p.grad - r).abs().max().item())
        trainer.optimizer.zero_grad(set_to_none=True)
    out = {"max_abs_diff": max(diffs), "mode": trainer.activation_checkpointing.mode, "unused": trainer.report.unused,
           "find_unused_parameters": trainer.decision.find_unused_parameters, "reasons": trainer.decision.reasons}
    trainer.close()
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES, run_case)
