"""Run under torchrun with 2 ranks: the straggler scores' cases, one after another in the same
process group. Each case's outcome goes into result_rank{r}.json for tests/unit/resilience/test_straggler.py."""

from __future__ import annotations

import os
import traceback

import torch

from tests.tiny import tiny as tiny_config
from tests.dist_helper import run_cases

BASE = tiny_config(None, {"eval.interval": 0, "train.seed": 3, "train.max_steps": 20, "checkpoint.resume": "none",
                          "straggler.interval": 5}, num_layers=2, dataset_size=4096, batch_size=4,
                   learning_rate=1e-4, log_interval=5)

CASES = {
    # Rank 1's forward takes 40 ms longer from step 5 on: named at the second check after it (step 15).
    "slow": {"recovery.fault_inject": "slow@step=5,rank=1,ms=40"},
    "fatal": {"recovery.fault_inject": "slow@step=5,rank=1,ms=40", "straggler.action": "fatal"},
    "clean": {"train.max_steps": 200, "straggler.interval": 10, "log_interval": 10},
    # A model with a buffer: DDP broadcasts it at each forward, where the fast rank waits for the slow one.
    "slow_buffered": {"recovery.fault_inject": "slow@step=5,rank=1,ms=40"},
    # Not a straggler case, but a cheap place for it: the init timeout, then the steady one on gloo.
    "steady_timeout": {"train.max_steps": 3, "ddp.init_timeout_s": 60, "ddp.timeout_s": 30},
}


def buffered_model(cfg):
    from framework.config import resolve_config
    from framework.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig.from_train_config(resolve_config(cfg)))
    model.register_buffer("seen", torch.zeros(1))
    return model


def run_case(name, overrides, out_dir):
    from framework.trainer import DDPTrainer

    cfg = {**BASE, **overrides, "logging.dir": str(out_dir / name / "logs"),
           "checkpoint.dir": str(out_dir / name / "ck")}
    out = {}
    try:
        out["summary"] = DDPTrainer(cfg, model=buffered_model(cfg) if name == "slow_buffered" else None).train()
    except Exception as err:  # the case's outcome, asserted by the test
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES, run_case)
