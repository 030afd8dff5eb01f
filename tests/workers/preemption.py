"""Run under torchrun with 2 ranks: a preemption request on rank 1 only, at the start of the final
evaluation and of a mid-run one (fault_inject sigterm ... at=eval), each followed by its relaunch.
Each case's outcome goes into result_rank{r}.json for tests/unit/resilience/test_preemption.py."""

from __future__ import annotations

import os

from tests.tiny import tiny as tiny_config
from tests.dist_helper import run_cases

# 40 validation sequences of 16 tokens in batches of 4: 5 batches a rank.
BASE = tiny_config(None, {"eval.interval": 4, "eval.steps": 0, "train.seed": 3, "train.max_steps": 8,
                          "checkpoint.every_steps": 4,
                          "train.deterministic": True}, dataset_size=400, batch_size=4, log_interval=1)

# Each run's directory, and its fault: the relaunches reuse the directory of the run they resume.
CASES = {
    "whole": dict(run="whole"),
    "final": {"run": "final", "recovery.fault_inject": "sigterm@step=8,rank=1,at=eval"},
    "final_relaunch": dict(run="final"),
    "mid": {"run": "mid", "recovery.fault_inject": "sigterm@step=4,rank=1,at=eval"},
    "mid_relaunch": dict(run="mid"),
}


def run_case(name, overrides, out_dir):
    from framework.trainer import DDPTrainer

    overrides = dict(overrides)
    run = out_dir / overrides.pop("run")
    cfg = {**BASE, **overrides, "logging.dir": str(run / "logs"), "checkpoint.dir": str(run / "ck")}
    return {"summary": DDPTrainer(cfg).train(), "log": (run / "logs" / f"rank_{os.environ['RANK']}.log").read_text()}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES, run_case)
