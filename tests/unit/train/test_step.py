"""The step's own logic: halving the micro-batch, the skip budget, the recorded micro-batch."""

import sys

import pytest
import torch

from framework import DDPTrainer
from framework.resilience import markers
from framework.data.sampler import ResumableDistributedSampler
from framework.resilience.markers import FatalError
from framework.train.step import SkipBudget, apply_recorded_micro_batch, halve_micro_batch


def test_halving_keeps_the_global_batch_until_it_cannot():
    sampler = ResumableDistributedSampler(64, 2, 0, batch_size=4, accumulation=1)
    assert halve_micro_batch(sampler, "oom") == (2, 2)
    assert halve_micro_batch(sampler, "oom") == (1, 4)
    assert sampler.global_batch == 8
    with pytest.raises(FatalError, match="oom at micro-batch 1: cannot halve"):
        halve_micro_batch(sampler, "oom")
    odd = ResumableDistributedSampler(64, 1, 0, batch_size=3)
    with pytest.raises(FatalError, match="micro-batch 3"):
        halve_micro_batch(odd, "oom")


def test_skip_budget_allows_the_limit_then_stops_naming_the_steps():
    skips = SkipBudget(limit=2)
    skips.record(3, epoch=0)
    skips.record(5, epoch=0)
    with pytest.raises(FatalError, match=r"steps \[3, 5, 9\]: more than max_errors_per_epoch=2 in epoch 0"):
        skips.record(9, epoch=0)
    restored = SkipBudget(limit=2)
    restored.load_state_dict(skips.state_dict())
    assert restored.steps == [3, 5, 9]
    restored.new_epoch()
    assert restored.steps == []


def test_recorded_micro_batch_is_applied_only_when_the_batch_matches(tmp_path):
    sampler = ResumableDistributedSampler(64, 2, 0, batch_size=8, accumulation=1)
    apply_recorded_micro_batch(sampler, tmp_path)
    assert (sampler.batch_size, sampler.accumulation) == (8, 1)
    markers.record_micro_batch(tmp_path, 4, 2, "oom")
    apply_recorded_micro_batch(sampler, tmp_path)
    assert (sampler.batch_size, sampler.accumulation) == (4, 2)
    other = ResumableDistributedSampler(64, 2, 0, batch_size=16, accumulation=1)  # the user changed batch_size
    apply_recorded_micro_batch(other, tmp_path)
    assert (other.batch_size, other.accumulation) == (16, 1)


class FailsAbove(torch.nn.Module):
    """A linear model whose forward fails like a CUDA library out of memory on batches over ``limit``."""

    def __init__(self, limit: int, error):
        super().__init__()
        self.limit, self.error = limit, error
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise self.error
        return self.lin(x)


def tiny_run(tmp_path, model, overrides: dict | None = None, /, **compact):
    x = torch.randn(64, 4)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    config = {"batch_size": 8, "train.max_steps": 4, "num_workers": 0, "logging.tensorboard": False,
              "eval.interval": 0, "eval.steps": 1, "target_loss": 0.0, "logging.dir": str(tmp_path / "logs"),
              "checkpoint.dir": str(tmp_path / "ck"), **(overrides or {}), **compact}
    return DDPTrainer(config, model=model, train_dataset=data, val_dataset=data,
                      loss_fn=torch.nn.functional.mse_loss)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")])
def test_cuda_library_allocation_failures_are_recovered_as_oom(tmp_path, error):
    trainer = tiny_run(tmp_path, FailsAbove(2, error), {"recovery.oom": "true"})
    summary = trainer.train()
    assert summary["steps"] == 4
    assert (trainer.sampler.batch_size, trainer.sampler.accumulation) == (2, 4)


def test_memory_is_released_after_the_exception_is_gone(tmp_path, monkeypatch):
    from framework.train.step import TrainStep
    seen = []
    original = TrainStep._release_after_oom

    def record(self, micro, step):
        seen.append(sys.exc_info()[0])  # an exception still being handled holds the failed activations
        original(self, micro, step)
    monkeypatch.setattr(TrainStep, "_release_after_oom", record)
    tiny_run(tmp_path, FailsAbove(4, torch.OutOfMemoryError("CUDA out of memory")), {"recovery.oom": "true"}).train()
    assert seen and all(exc is None for exc in seen)


def test_a_non_finite_loss_counts_against_the_budget_with_a_grad_scaler(tmp_path):
    trainer = tiny_run(tmp_path, torch.nn.Linear(4, 1), max_errors_per_epoch=1)
    # fp16's scaler, on CPU
    trainer.train_step.scaler = trainer.precision.scaler = torch.amp.GradScaler("cpu", enabled=True)
    trainer.optimizer.zero_grad()
    trainer.precision.scaler.scale(trainer.raw_model(torch.ones(1, 4)).sum()).backward()
    agreed, _, _ = trainer.train_step.optimizer_step(torch.tensor(float("inf")), 0)
    assert agreed.nonfinite and trainer.skips.steps == [0]
    trainer.precision.scaler.scale(trainer.raw_model(torch.ones(1, 4)).sum()).backward()
    with pytest.raises(markers.FatalError, match="more than max_errors_per_epoch=1"):
        trainer.train_step.optimizer_step(torch.tensor(float("nan")), 1)
    trainer.close()


def test_a_grad_scaler_overflow_is_skipped_by_the_scaler_and_not_counted_as_non_finite(tmp_path):
    """gpu_check's scaler_overflow row on CPU: a finite loss with an inf gradient (what fp16 overflow
    gives) is the GradScaler's to skip; it lowers its scale and the skip budget is untouched."""
    trainer = tiny_run(tmp_path, torch.nn.Linear(4, 1), max_errors_per_epoch=0)
    trainer.train_step.scaler = trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=True)
    before = [p.detach().clone() for p in trainer.raw_model.parameters()]
    trainer.optimizer.zero_grad()
    loss = trainer.raw_model(torch.ones(1, 4)).sum()
    trainer.precision.scaler.scale(loss).backward()
    trainer.raw_model.weight.grad.view(-1)[0] = float("inf")
    agreed, _, grad_norm = trainer.train_step.optimizer_step(loss.detach(), 0)
    assert not agreed.nonfinite and trainer.skips.steps == [] and not torch.isfinite(grad_norm)
    assert trainer.precision.scaler.get_scale() == 512.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.raw_model.parameters(), strict=True))
    trainer.precision.scaler.scale(trainer.raw_model(torch.ones(1, 4)).sum()).backward()
    trainer.train_step.optimizer_step(torch.tensor(1.0), 1)  # a finite step: the scaler steps the optimizer
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.raw_model.parameters(), strict=True))
    trainer.close()


def test_token_averaging_gives_a_micro_batch_without_labels_no_weight_and_skips_no_step(tmp_path):
    """train.loss_average=tokens: a micro-batch whose targets are all -100 has a NaN mean loss
    (0/0) and a zero gradient. Multiplied by its weight of 0 it was still NaN, and the step was
    skipped as non-finite; it now contributes nothing, and every step trains."""
    from torch.utils.data import TensorDataset

    from tests.tiny import tiny

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (16, 16), generator=g), torch.randint(0, 32, (16, 16), generator=g)
    y[::2] = -100  # every other sample has no labelled token: with batch_size=1, a micro-batch of its own
    cfg = tiny(tmp_path, {"data.gradient_accumulation_steps": 2, "train.max_steps": 6}, batch_size=1,
               **{"train.loss_average": "tokens"})
    summary = DDPTrainer(cfg, train_dataset=TensorDataset(x, y)).train()
    assert summary["skipped_steps"] == 0 and summary["steps"] == 6
    assert torch.isfinite(torch.tensor(summary["final_train_loss"]))
