"""Run under torchrun with 2 ranks: the loss-spike guard's cases, one after another in the same
process group. Each case's outcome goes into result_rank{r}.json for tests/unit/resilience/test_spike.py."""

from __future__ import annotations

import os
import traceback


from tests.tiny import tiny as tiny_config
from tests.dist_helper import run_cases

# The spike: rank 1's first micro-batch of step 30 gets random targets. At this size a clean run's
# largest z-score is about 4, the spike's about 14 (the test's threshold is 8; the default 6 is
# for the nanoGPT size, measured in the README).
BASE = tiny_config(None, {"eval.interval": 0, "train.seed": 3, "train.max_steps": 50, "checkpoint.resume": "none",
                          "checkpoint.every_steps": 10, "spike.warmup": 10, "spike.window": 20, "spike.threshold": 8.0,
                          "logging.record_samples": True}, num_layers=2, dataset_size=1024, batch_size=4,
                   log_interval=1)
FAULT = "bad_data@step=30,rank=1"

CASES = {
    "rollback": {"spike.guard": "rollback", "recovery.fault_inject": FAULT},
    # The same run with the rollback's samples excluded from the start, and no fault.
    "reference": {"spike.guard": "rollback", "data.exclude_samples": "rollback/ck/EXCLUDED_SAMPLES.json"},
    "warn": {"spike.guard": "warn", "recovery.fault_inject": FAULT},
    "too_many_rollbacks": {"spike.guard": "rollback", "recovery.fault_inject": FAULT, "spike.max_rollbacks": 0},
    "cooldown": {"spike.guard": "rollback", "recovery.fault_inject": FAULT, "spike.lr_cooldown": 4},
    "clean": {"spike.guard": "rollback"},
}


def run_case(name, overrides, out_dir):
    from framework.trainer import DDPTrainer

    cfg = {**BASE, **overrides, "logging.dir": str(out_dir / name / "logs"),
           "checkpoint.dir": str(out_dir / name / "ck")}
    if "data.exclude_samples" in overrides:
        cfg["data.exclude_samples"] = str(out_dir / overrides["data.exclude_samples"])
    out = {}
    try:
        trainer = DDPTrainer(cfg)
        out["summary"] = trainer.train()
        out["excluded"] = sorted(trainer.sampler.excluded)
    except Exception as err:  # the case's outcome, asserted by the test
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_cases(CASES, run_case)
