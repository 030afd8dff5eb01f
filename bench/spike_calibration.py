#!/usr/bin/env python3
"""The loss-spike guard's z-scores at the nanoGPT CPU size (configs/nanogpt_shakespeare_char.toml,
2 gloo ranks x batch 6, the same 12 samples per step): the largest z-score of clean runs, which
sets the default spike.threshold, and the z-score of a real spike (bad_data: one rank's batch
with random targets) in a run with the guard at warn.

usage: python bench/spike_calibration.py [--steps 300] [--spike-step 250]
Prints a table and writes bench/results/spike_calibration.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(tmp: Path, name: str, steps: int, extra: list[str]) -> dict:
    from framework.observability.metrics import read_metrics
    from harness.launch import torchrun_cmd, worker_env

    logs = tmp / name / "logs"
    args = ["--config", "configs/nanogpt_shakespeare_char.toml", "--batch-size", "6", "--train.max_steps", str(steps),
            "--eval.interval", "0", "--eval.steps", "1", "--log-interval", "1", "--checkpoint.resume", "none",
            "--logging.dir", str(logs), "--checkpoint.dir", str(tmp / name / "ck"), "--checkpoint.export_dir", "none",
            *extra]
    proc = subprocess.run(torchrun_cmd(ROOT / "ddp_training.py", args, nproc=2), cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    summary = json.loads((logs / "summary.json").read_text())
    zs = [(r["step"], r["health/loss_z"]) for r in read_metrics(logs / "metrics.jsonl") if "health/loss_z" in r]
    top = sorted(zs, key=lambda x: -x[1])[:3]
    return {"steps": steps, "loss_spikes": summary["loss_spikes"], "max_loss_z": summary["max_loss_z"],
            "top_z": top, "final_train_loss": summary["final_train_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--spike-step", type=int, default=250)
    args = parser.parse_args()
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "clean": run(Path(tmp), "clean", args.steps, []),
            "bad_data": run(Path(tmp), "bad_data", args.steps,
                            ["--recovery.fault_inject", f"bad_data@step={args.spike_step},rank=1"]),
        }
    print(f"{'run':10} {'steps':>6} {'spikes':>7} {'max z':>7}  top z (step, z)")
    for name, r in results.items():
        top = ", ".join(f"({s}, {z:.2f})" for s, z in r["top_z"])
        print(f"{name:10} {r['steps']:>6} {r['loss_spikes']:>7} {r['max_loss_z']:>7.2f}  {top}")
    out = ROOT / "bench" / "results" / "spike_calibration.json"
    out.write_text(json.dumps({"default_threshold": 6.0, **results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
