"""Run under torchrun with 2 ranks: the run-health cases that need no restart, one after another
in the same process group. Each case's outcome goes into result_rank{r}.json for
tests/unit/resilience/test_run_health.py."""

from __future__ import annotations

import os
import resource
import signal
import traceback

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from tests.tiny import tiny as tiny_config
from tests.dist_helper import finish_worker, recorded, register_worker

BASE = tiny_config(None, {"eval.interval": 0, "train.seed": 3, "train.max_steps": 10, "checkpoint.resume": "none",
                          "recovery.consistency_check_interval": 2,
                          "logging.record_samples": True}, num_layers=2, batch_size=4, learning_rate=2e-3,
                   log_interval=1)

CASES = {
    # NaN in rank 1's gradients after DDP's all-reduce: both ranks skip the step.
    "nan_skip": {"recovery.fault_inject": "nan@step=4,rank=1"},
    # The same without the agreement: rank 1 skips alone, and the divergence check catches it.
    "nan_no_agreement": {"recovery.fault_inject": "nan@step=4,rank=1", "recovery.agree_nonfinite": False},
    # One ulp on one rank, caught by the next check (interval 2: step 6 after the nudge at 5).
    "ulp": {"recovery.fault_inject": "ulp@step=5,rank=1"},
    # OOM in the backward of a no_sync() micro-step: agreed, micro-batch halved, step retried.
    "oom_no_sync": {"recovery.fault_inject": "oom@step=3,rank=1,micro=0", "data.gradient_accumulation_steps": 2,
                    "recovery.oom": "true"},
    "oom_no_sync_reference": {"batch_size": 2, "data.gradient_accumulation_steps": 4},
    # A DataLoader worker SIGKILLed while the main thread is in backward.
    "kill_worker": {"recovery.fault_inject": "kill_worker@step=3,rank=0", "num_workers": 1, "dataset": "plain"},
    # The naive tiled MLP (backward per chunk) desynchronises the ranks silently; the check sees it.
    # A user's per-rank datasets of different lengths: a clear error on every rank, not a hang.
    "uneven_datasets": dict(dataset="uneven"),
    # Out of memory in the DDP preflight probe on rank 1 only: agreed, the micro-batch halved, probed again.
    "oom_in_preflight": {"model": "oom_above_2_on_rank_1", "recovery.oom": "true"},
    # Rank 0 cannot write the final checkpoint (a 64 KiB file-size limit): every rank stops with the error.
    "final_save_fails_on_rank_0": {"checkpoint.every_steps": 0, "logging.record_samples": False,
                                   "file_size_limit": 64 * 1024},
    "naive_tiled": {"model": "naive_tiled", "ddp.static_graph": "false", "ddp.find_unused_parameters": "false"},
}


class PlainTokens(Dataset):
    """The synthetic data as a plain map-style dataset (no batched read), so it goes through
    DataLoader worker processes."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


class FailsAbove(torch.nn.Module):
    """Runs out of memory (as CUDA would say it) on batches larger than ``limit``."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        return self.lin(x)


def run_case(name, overrides, out_dir, rank):
    from framework.data.datasets import build_datasets
    from framework.config import resolve_config
    from framework.trainer import DDPTrainer

    overrides = dict(overrides)
    file_size_limit = overrides.pop("file_size_limit", None)
    dataset = overrides.pop("dataset", None)
    model_kind = overrides.pop("model", None)
    cfg = {**BASE, **overrides, "logging.dir": str(out_dir / name / "logs"),
           "checkpoint.dir": str(out_dir / name / "ck")}
    kwargs = {}
    if dataset == "plain":
        bundle = build_datasets(resolve_config(cfg))
        kwargs = dict(train_dataset=PlainTokens(bundle.train), val_dataset=bundle.val)
    if dataset == "uneven":
        bundle = build_datasets(resolve_config(cfg))
        train = torch.utils.data.Subset(bundle.train, range(128 - 32 * rank))
        kwargs = dict(train_dataset=train, val_dataset=bundle.val)
    if model_kind == "oom_above_2_on_rank_1":
        torch.manual_seed(BASE["train.seed"])
        x = torch.randn(64, 8)
        data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
        kwargs = dict(model=FailsAbove(2 if rank == 1 else 10**6), train_dataset=data, val_dataset=data,
                      loss_fn=torch.nn.functional.mse_loss)
    if model_kind == "naive_tiled":
        from tests.workers.failure_matrix import TiledMLPNet, sequences
        torch.manual_seed(BASE["train.seed"])
        data = sequences()
        kwargs = dict(model=TiledMLPNet("naive", 4, False), train_dataset=data, val_dataset=None,
                      loss_fn=torch.nn.functional.mse_loss)
    try:
        trainer = DDPTrainer(cfg, **kwargs)
    except Exception as err:  # the case's outcome, asserted by the test
        return {"error": f"{type(err).__name__}: {err}", "steps_per_epoch": None}
    worker_pids = []
    if dataset == "plain":
        original = trainer.stream.kill_a_worker

        def kill_and_remember():
            pid = original()
            worker_pids.append(pid)
            return pid
        trainer.stream.kill_a_worker = kill_and_remember
    out = {}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if file_size_limit and rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, limit[1]))
    try:
        out["summary"] = trainer.train()
    except Exception as err:  # the case's outcome, asserted by the test
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    out["killed_worker_pids"] = worker_pids
    out["killed_alive"] = [psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                           for p in worker_pids]
    out["steps_per_epoch"] = trainer.sampler.steps_per_epoch
    out["micro_batch"] = [trainer.sampler.batch_size, trainer.sampler.accumulation]
    return out


def main():
    out_dir = register_worker()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name, overrides in CASES.items():
        results[name] = recorded(run_case, name, overrides, out_dir, rank)
        dist.barrier()
    finish_worker(out_dir, rank, {"cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
