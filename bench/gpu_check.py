#!/usr/bin/env python3
"""The GPU path in one command, for the day a GPU is lent: under 10 minutes on one GPU.

Checks, each through ddp_training.py under torchrun (the launch the tests use) or the bench
scripts, each a row of the table and an entry of bench/results/gpu_check.json:
  nccl_1 / nccl_2     NCCL at world size 1 (and 2 with two GPUs): a short run whose loss falls
  bf16                autocast bf16 training, loss falling
  fp16                autocast fp16 + GradScaler training, loss falling
  scaler_overflow     fp16 with a NaN injected into a gradient: the GradScaler skips the step and
                      lowers its scale; it does not count as a non-finite (skipped) step
  oom_halving         a real torch.cuda.OutOfMemoryError (the process limited to a memory fraction
                      a 16x micro-batch cannot fit): oom_recovery halves the micro-batch until it fits
  memory              bench/memory.py --model gpt: torch.cuda.max_memory_allocated per memory mode
  compile             bench/throughput.py --compile: tokens/s eager vs compile=true, 1 process
  throughput          bench/throughput.py --quick: the framework against a bare loop

Without a GPU it prints one line and exits 0.

usage: python bench/gpu_check.py [--only NAME[,NAME...]]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "gpu_check.json"
TINY = dict(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, seq_len=256, dataset_size=4096, batch_size=16,
            dropout=0.0, max_steps=60, log_interval=10, eval_interval=0, eval_steps=2, target_loss=0.0,
            learning_rate=3e-3, warmup_steps=5, num_workers=0, resume="none", export_dir="none")


def train(tmp: Path, name: str, nproc: int = 1, **overrides) -> dict:
    """ddp_training.py under torchrun with TINY + overrides; its summary.json and its log."""
    from tests.dist_helper import cli_args, torchrun_cmd, worker_env
    run = tmp / name
    args = cli_args({**TINY, **overrides, "log_dir": str(run / "logs"), "checkpoint_dir": str(run / "ck")})
    proc = subprocess.run(torchrun_cmd(ROOT / "ddp_training.py", args, nproc=nproc), cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=600)
    log = "".join(p.read_text() for p in sorted((run / "logs").glob("rank_*.log")))
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return {**json.loads((run / "logs" / "summary.json").read_text()), "log": log}


def loss_falls(summary: dict) -> dict:
    ok = summary["final_train_loss"] < summary["first_train_loss"] - 0.5
    return {"ok": ok, "detail": f"loss {summary['first_train_loss']:.3f} -> {summary['final_train_loss']:.3f}, "
                                f"{summary['tokens_per_sec']:.0f} tok/s"}


def check_nccl(tmp: Path, nproc: int) -> dict:
    summary = train(tmp, f"nccl_{nproc}", nproc=nproc, backend="nccl")
    row = loss_falls(summary)
    row["ok"] &= "backend=nccl" in summary["log"] and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in summary["log"]
    return row


def check_amp(tmp: Path, dtype: str) -> dict:
    return loss_falls(train(tmp, dtype, use_amp="true", amp_dtype=dtype))


def check_scaler_overflow(tmp: Path) -> dict:
    summary = train(tmp, "scaler_overflow", use_amp="true", amp_dtype="fp16", fault_inject="nan@step=20")
    ok = summary["skipped_steps"] == 0 and summary["steps"] == TINY["max_steps"] and "nan at step 20" in summary["log"]
    return {"ok": ok, "detail": f"skipped_steps {summary['skipped_steps']} (the GradScaler skipped the step), "
                                f"{summary['steps']} steps"}


def check_oom_halving(tmp: Path) -> dict:
    """In-process, one process: the memory a 2x micro-batch needs, then a fraction of the GPU
    that 16x cannot fit; oom_recovery must halve until it trains."""
    import torch
    from framework.trainer import DDPTrainer
    base = {**TINY, "max_steps": 3, "log_dir": str(tmp / "oom" / "logs"), "checkpoint_dir": str(tmp / "oom" / "ck")}
    probe = DDPTrainer({**base, "batch_size": 2})
    torch.cuda.reset_peak_memory_stats()
    probe.train()
    need = torch.cuda.max_memory_allocated()
    del probe
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 4 * need / total))
    try:
        trainer = DDPTrainer({**base, "batch_size": 32, "oom_recovery": "true", "resume": "none"})
        summary = trainer.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    b, a = trainer.sampler.batch_size, trainer.sampler.accumulation
    return {"ok": summary["steps"] == 3 and b < 32 and b * a == 32,
            "detail": f"limit {4 * need / 2**20:.0f} MiB: micro-batch 32 -> {b} x {a} accumulation"}


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def check_memory(tmp: Path) -> dict:
    out = tmp / "memory.json"
    proc = run_script("bench/memory.py", "--model", "gpt", "--timing-rounds", "0", "--out", str(out), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-1500:] + proc.stderr[-1500:])
    peaks = {r["mode"]: r["cuda_peak_bytes"] for r in json.loads(out.read_text())["modes"]}
    ok = all(peaks.values()) and peaks["non_reentrant"] < peaks["off"]
    return {"ok": ok, "detail": ", ".join(f"{m} {p / 2**20:.0f} MiB" for m, p in peaks.items() if p),
            "peaks_bytes": peaks}


def check_compile(tmp: Path) -> dict:
    out = tmp / "compile.json"
    proc = run_script("bench/throughput.py", "--compile", "--cold-cache", "--repeats", "1", "--steps", "100",
                      "--out", str(out), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-1500:] + proc.stderr[-1500:])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["variants"]}
    one = rows["compiled 1 process"]
    return {"ok": one["median_tokens_per_sec"] > 0,
            "detail": f"compiled/eager {one['vs_eager_paired']:.3f} at 1 process after "
                      f"{one['median_first_step_s']:.0f} s of compilation", "variants": rows}


def check_throughput(tmp: Path) -> dict:
    out = tmp / "throughput.json"
    proc = run_script("bench/throughput.py", "--quick", "--variants", "ab", "--out", str(out), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-1500:] + proc.stderr[-1500:])
    return {"ok": True, "detail": proc.stdout.strip().splitlines()[-2] if proc.stdout.strip() else "",
            "result": json.loads(out.read_text())}


def checks(gpus: int) -> dict:
    rows = {"nccl_1": lambda tmp: check_nccl(tmp, 1)}
    if gpus >= 2:
        rows["nccl_2"] = lambda tmp: check_nccl(tmp, 2)
    rows.update(bf16=lambda tmp: check_amp(tmp, "bf16"), fp16=lambda tmp: check_amp(tmp, "fp16"),
                scaler_overflow=check_scaler_overflow, oom_halving=check_oom_halving, memory=check_memory,
                compile=check_compile, throughput=check_throughput)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated check names")
    args = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): "
              f"nothing to check")
        return 0
    gpus = torch.cuda.device_count()
    selected = checks(gpus)
    if args.only:
        selected = {k: v for k, v in selected.items() if k in args.only.split(",")}
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name, check in selected.items():
            start = time.perf_counter()
            try:
                results[name] = check(Path(tmp))
            except Exception as err:  # the check's failure is its result; the other checks still run
                results[name] = {"ok": False, "detail": f"{type(err).__name__}: {str(err)[-800:]}"}
            results[name]["seconds"] = time.perf_counter() - start
            print(f"{name:<16} {'ok' if results[name]['ok'] else 'FAILED':<7} {results[name]['seconds']:6.0f} s  "
                  f"{results[name]['detail']}", flush=True)
    out = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
           "cuda": torch.version.cuda, "checks": results}
    RESULTS.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {RESULTS}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
