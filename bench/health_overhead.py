#!/usr/bin/env python3
"""Per-step cost of the run-health machinery at the nanoGPT CPU size, as a share of step time.

Times, on a trained-for-a-few-steps model in one process (1 thread): a step; one memory reading
(psutil RSS + available memory, every memory_check_interval steps); one young-generation
gc.collect(1) after cleanup_interval steps with automatic gc off (as in training); a full
gc.collect() for comparison; the watchdog's per-step arm/disarm; and the parameter hashing of the
divergence check (every consistency_check_interval steps; its all-reduce, about 0.75 ms on 2 gloo ranks here, is added);
the straggler scores' section timing (every step on the CPU) and their
all-gather with the scoring (every straggler_interval steps; the all-gather is measured on 2 gloo
ranks under torchrun). Targets: memory manager <= 1%, straggler scores <= 0.5% of step time.

usage: python bench/health_overhead.py
"""

from __future__ import annotations

import gc
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
ALLREDUCE_S = 0.00075


def timed(fn, repeat=50) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def allgather_ms() -> float:
    """The median time of the straggler check's all-gather (4 float64 per rank) on 2 gloo ranks."""
    import subprocess
    from harness.launch import torchrun_cmd, worker_env
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "allgather.json"
        subprocess.run(torchrun_cmd(Path(__file__), ["--allgather-worker", str(out)], nproc=2), cwd=ROOT,
                       env=worker_env(), check=True, capture_output=True, timeout=300)
        return json.loads(out.read_text())["ms"]


def allgather_worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    mine = torch.zeros(4, dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(2)]
    dist.barrier()
    seconds = timed(lambda: dist.all_gather(gathered, mine), 200)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"ms": seconds * 1e3}))
    dist.destroy_process_group()


def straggler_costs(device) -> tuple[float, float]:
    """Seconds per timed step of the section laps, and of one check's medians and scoring."""
    from framework.resilience.straggler import SECTIONS, TIMED_STEPS, SectionTimer, scores, slow_sections
    timer = SectionTimer(device)

    def timed_step():
        timer.begin(True)
        # A DDP step of a model with buffers, micro-step 0 of 1 (the laps of the training step):
        for section in ("data", "forward_backward", None, "forward_backward", "synced_backward", "optimizer", None,
                        "optimizer"):
            timer.lap(section)
        timer.end()

    lap_s = timed(timed_step, 200)
    for _ in range(TIMED_STEPS):
        timed_step()

    def scoring():
        medians = [timer.medians_ms(), [1.0] * len(SECTIONS)]
        scores(medians)
        slow_sections(medians, threshold=1.3, min_ms=5.0)
    return lap_s, timed(scoring, 200)


def main() -> None:
    if sys.argv[1:2] == ["--allgather-worker"]:
        return allgather_worker(sys.argv[2])
    import torch
    torch.set_num_threads(1)
    from framework.config import parse_command_line
    from framework.resilience.config import RecoverySection
    from framework.resilience.watchdog import Watchdog
    from framework.resilience.consistency import parameter_hashes
    from framework.resilience.memory import memory_stats
    from framework.trainer import DDPTrainer

    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, _ = parse_command_line(["--config", "configs/nanogpt_shakespeare_char.toml", "--checkpoint.resume", "none",
                                     "--logging.dir", f"{tmp}/logs", "--checkpoint.dir", f"{tmp}/ck"], env={})
        trainer = DDPTrainer(cfg)
        trainer.stream.start_epoch()

        def step():
            loss = trainer.forward_backward(trainer.stream.next_step())
            trainer.optimizer_step(loss)
            trainer.sampler.advance()
            trainer.step += 1

        for _ in range(5):
            step()
        step_s = timed(step, 30)
        memory_s = timed(lambda: memory_stats(trainer.env.device))
        gc.disable()  # as in training: one young collection after cleanup_interval steps of garbage
        gc1 = []
        for _ in range(3):
            for _ in range(cfg.memory.cleanup_interval):
                step()
            t0 = time.perf_counter()
            gc.collect(1)
            gc1.append(time.perf_counter() - t0)
        gc.enable()
        gc1_s = statistics.median(gc1)
        gc_full_s = timed(gc.collect, 5)
        dog = Watchdog(RecoverySection(step_timeout_s=600, step_timeout_factor=10), log_file=sys.stderr, rank=0,
                       world_size=1)
        arm_s = timed(lambda: (dog.arm(1), dog.disarm()), 200)
        dog.close()
        hash_s = timed(lambda: parameter_hashes(trainer.raw_model), 20)
        lap_s, scoring_s = straggler_costs(trainer.env.device)
        trainer.close()
    gather_s = allgather_ms() / 1e3
    rows = {
        "memory reading": (memory_s, cfg.memory.check_interval),
        "gc.collect(1)": (gc1_s, cfg.memory.cleanup_interval),
        "watchdog arm+disarm": (arm_s, 1),
        "divergence check": (hash_s + ALLREDUCE_S, cfg.recovery.consistency_check_interval),
        "straggler timing": (lap_s, 1),
        "straggler all-gather": (gather_s + scoring_s, cfg.straggler.interval),
    }
    result = {"median_step_ms": step_s * 1e3, "full_gc_ms": gc_full_s * 1e3, "items": {}}
    print(f"median step {step_s * 1e3:.1f} ms; a full gc.collect() costs {gc_full_s * 1e3:.1f} ms")
    print(f"{'item':<22}{'ms per call':>12}{'every':>7}{'share of step':>15}")
    for name, (seconds, every) in rows.items():
        share = seconds / every / step_s
        result["items"][name] = {"ms": seconds * 1e3, "every_steps": every, "share": share}
        print(f"{name:<22}{seconds * 1e3:>12.3f}{every:>7}{share:>15.3%}")
    memory_share = sum(result["items"][k]["share"] for k in ("memory reading", "gc.collect(1)"))
    result["memory_manager_share"] = memory_share
    print(f"memory manager (reading + gc): {memory_share:.3%} of step time (target <= 1%: "
          f"{'met' if memory_share <= 0.01 else 'NOT met'})")
    straggler_share = sum(result["items"][k]["share"] for k in ("straggler timing", "straggler all-gather"))
    result["straggler_share"] = straggler_share
    print(f"straggler scores (timing + all-gather): {straggler_share:.3%} of step time (target <= 0.5%: "
          f"{'met' if straggler_share <= 0.005 else 'NOT met'})")
    out = ROOT / "bench" / "results" / "health_overhead.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
