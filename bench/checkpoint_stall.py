#!/usr/bin/env python3
"""Training stall per checkpoint save, as a share of training time between saves.

At the nanoGPT CPU size (configs/nanogpt_shakespeare_char.toml), one process, one thread, it
trains with checkpoint.every_steps=N and times, on the training thread, every ``save_checkpoint()``
call (gathering the RNG states, building the state dict, copying it to CPU memory and waiting
for the previous write; the file itself is written by a background thread) and every step.
Share = median stall per save / (N x median step time). Target: <= 2% at N = 100.

usage: python bench/checkpoint_stall.py [--steps 400] [--every 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()

    import torch
    torch.set_num_threads(1)
    from framework.config import parse_command_line
    from framework.trainer import DDPTrainer

    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, _ = parse_command_line(["--config", "configs/nanogpt_shakespeare_char.toml",
                                     "--train.max_steps", str(args.steps), "--checkpoint.every_steps", str(args.every),
                                     "--eval.interval", "0", "--eval.steps", "1", "--checkpoint.resume", "none",
                                     "--logging.dir", f"{tmp}/logs", "--checkpoint.dir", f"{tmp}/ck"], env={})
        trainer = DDPTrainer(cfg)
        stalls, steps = [], []
        save, step = trainer.save_checkpoint, trainer.optimizer_step
        last = [time.perf_counter()]

        def timed_save(**kw):
            t0 = time.perf_counter()
            save(**kw)
            stalls.append((time.perf_counter() - t0, kw.get("blocking", False)))

        def timed_step(*a, **kw):
            out = step(*a, **kw)
            now = time.perf_counter()
            steps.append(now - last[0])
            last[0] = now
            return out

        trainer.save_checkpoint, trainer.optimizer_step = timed_save, timed_step
        trainer.train()
        periodic = [s for s, blocking in stalls if not blocking]
        step_s = statistics.median(steps[5:])
        stall_s = statistics.median(periodic)
        share = stall_s / (args.every * step_s)
        size = sum(p.stat().st_size for p in Path(f"{tmp}/ck").glob("step_*.pt")) / max(
            1, len(list(Path(f"{tmp}/ck").glob("step_*.pt"))))
    result = {"steps": args.steps, "save_every_steps": args.every, "median_step_ms": step_s * 1e3,
              "periodic_saves": len(periodic), "median_stall_ms": stall_s * 1e3,
              "max_stall_ms": max(periodic) * 1e3, "checkpoint_mb": size / 2**20,
              "stall_share": share, "target": 0.02, "met": share <= 0.02}
    print(f"{'median step':>22}: {result['median_step_ms']:.1f} ms")
    print(f"{'periodic saves':>22}: {len(periodic)} (checkpoint {result['checkpoint_mb']:.1f} MiB)")
    print(f"{'stall per save':>22}: median {result['median_stall_ms']:.1f} ms, max {result['max_stall_ms']:.1f} ms")
    print(f"{'stall share':>22}: {share:.3%} of the training time between saves "
          f"(target <= 2%: {'met' if result['met'] else 'NOT met'})")
    out = ROOT / "bench" / "results" / "checkpoint_stall.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
