#!/usr/bin/env python3
"""The GPU path in one command, for the day a GPU is lent: under 10 minutes on one GPU.

Checks, each through ddp_training.py under torchrun (the launch the tests use) or the bench
scripts, each a row of the table and an entry of bench/results/gpu_check.json:
  nccl_1 / nccl_2     NCCL at world size 1 (and 2 with two GPUs): a short run whose loss falls
  bf16                autocast bf16 training, loss falling
  fp16                autocast fp16 + GradScaler training, loss falling
  scaler_overflow     fp16 with a NaN injected into a gradient: the GradScaler skips the step and
                      lowers its scale; it does not count as a non-finite (skipped) step
  oom_halving         a real torch.cuda.OutOfMemoryError (the process limited to the memory of an
                      8-sample micro-batch, measured): recovery.oom halves 32 until it fits
  memory              bench/memory.py --model gpt: torch.cuda.max_memory_allocated per memory mode
  comm_hook           ddp.comm_hook=bf16 on NCCL (1 process, or 2 with two GPUs), loss falling
  compile             bench/throughput.py --compile: tokens/s eager vs compile=true, 1 process
  throughput          bench/throughput.py --quick: the framework against a bare loop

A row whose config keys this version lacks says "not available in this version" (never silently
skipped). Without a GPU it prints one line and exits 0.

usage: python bench/gpu_check.py [--only NAME[,NAME...]]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "gpu_check.json"
BUDGET_S = 600  # the whole check on one GPU
TINY = {"vocab_size": 256, "hidden_size": 256, "num_layers": 4, "num_heads": 4, "seq_len": 256, "dataset_size": 4096,
        "batch_size": 16, "dropout": 0.0, "train.max_steps": 60, "log_interval": 10, "eval.interval": 0,
        "eval.steps": 2, "target_loss": 0.0, "learning_rate": 3e-3, "optim.warmup_steps": 5, "num_workers": 0,
        "checkpoint.resume": "none", "checkpoint.export_dir": "none"}


def train(tmp: Path, name: str, overrides: dict | None = None, /, nproc: int = 1, **keys) -> dict:
    """ddp_training.py under torchrun with TINY + overrides (dotted keys) + keys (compact ones); its
    summary.json and its log."""
    from harness.launch import cli_args, torchrun_cmd, worker_env
    run = tmp / name
    args = cli_args({**TINY, **(overrides or {}), **keys, "logging.dir": str(run / "logs"),
                     "checkpoint.dir": str(run / "ck")})
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
    summary = train(tmp, f"nccl_{nproc}", {"ddp.backend": "nccl"}, nproc=nproc)
    row = loss_falls(summary)
    row["ok"] &= "backend=nccl" in summary["log"] and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in summary["log"]
    return row


def check_amp(tmp: Path, dtype: str) -> dict:
    summary = train(tmp, dtype, {"precision.dtype": dtype}, use_amp="true")
    row = loss_falls(summary)
    row["ok"] &= f"amp=on ({dtype})" in summary["log"]
    return row


def check_scaler_overflow(tmp: Path) -> dict:
    """fp16 with a NaN put into a gradient at step 20: the GradScaler skips that step and halves
    its scale (the final checkpoint's scale is below the initial 2**16, which 60 steps cannot grow
    past), and the framework does not count it as a non-finite step."""
    from framework.state.checkpoint_files import load_file, step_file
    summary = train(tmp, "scaler_overflow", {"recovery.fault_inject": "nan@step=20", "precision.dtype": "fp16"},
                    use_amp="true")
    scale = load_file(tmp / "scaler_overflow" / "ck" / step_file(summary["steps"]))["scaler"]["scale"]
    ok = (summary["skipped_steps"] == 0 and summary["steps"] == TINY["train.max_steps"]
          and "nan at step 20" in summary["log"] and scale < 2.0**16)
    return {"ok": ok, "detail": f"skipped_steps {summary['skipped_steps']}, {summary['steps']} steps, "
                                f"final GradScaler scale {scale:g} (initial 65536)"}


def check_oom_halving(tmp: Path) -> dict:
    """In-process, one process: the memory of a 2- and a 4-sample micro-batch gives the fixed part
    and the part per sample; limited to what 8 samples need (and 3 more), a 32-sample micro-batch hits a real
    OOM and oom_recovery must halve it until it trains, keeping 32 samples per step."""
    import torch
    from framework.trainer import DDPTrainer
    base = {**TINY, "train.max_steps": 3}
    peaks = {}
    for batch in (2, 4):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()  # what an earlier probe may still hold
        DDPTrainer({**base, "batch_size": batch, "logging.dir": str(tmp / f"oom{batch}" / "logs"),
                    "checkpoint.dir": str(tmp / f"oom{batch}" / "ck")}).train()
        peaks[batch] = torch.cuda.max_memory_allocated() - held
    gc.collect()
    torch.cuda.empty_cache()
    per_sample = (peaks[4] - peaks[2]) / 2
    limit = torch.cuda.memory_reserved() + peaks[2] + 9 * per_sample  # 8 samples and some slack; 16 do not fit
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / torch.cuda.get_device_properties(0).total_memory))
    try:
        trainer = DDPTrainer({**base, "batch_size": 32, "recovery.oom": "true",
                              "logging.dir": str(tmp / "oom" / "logs"), "checkpoint.dir": str(tmp / "oom" / "ck")})
        summary = trainer.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    b, a = trainer.sampler.batch_size, trainer.sampler.accumulation
    return {"ok": summary["steps"] == 3 and b < 32 and b * a == 32,
            "detail": f"limit {limit / 2**20:.0f} MiB ({per_sample / 2**20:.1f} MiB per sample): "
                      f"micro-batch 32 -> {b} x {a} accumulation"}


def check_comm_hook(tmp: Path, nproc: int) -> dict:
    return loss_falls(train(tmp, "comm_hook", {"ddp.backend": "nccl", "ddp.comm_hook": "bf16"}, nproc=nproc))


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def check_memory(tmp: Path, *extra: str) -> dict:
    """bench/memory.py's GPT table (``extra``: more of its flags, e.g. --quick in the CPU test)."""
    out = tmp / "memory.json"
    proc = run_script("bench/memory.py", "--model", "gpt", "--timing-rounds", "0", "--out", str(out), *extra,
                      timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-1500:] + proc.stderr[-1500:])
    peaks = {r["mode"]: r["cuda_peak_bytes"] for r in json.loads(out.read_text())["modes"]}
    if missing := [m for m, p in peaks.items() if not p]:
        return {"ok": False, "detail": f"no torch.cuda peak recorded for {', '.join(missing)}", "peaks_bytes": peaks}
    return {"ok": peaks["non_reentrant"] < peaks["off"],
            "detail": ", ".join(f"{m} {p / 2**20:.0f} MiB" for m, p in peaks.items()), "peaks_bytes": peaks}


def check_compile(tmp: Path, gpus: int) -> dict:
    out = tmp / "compile.json"
    proc = run_script("bench/throughput.py", "--compile", "--cold-cache", "--repeats", "1", "--steps", "100",
                      "--max-procs", str(min(gpus, 2)), "--out", str(out), timeout=900)
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
    result = json.loads(out.read_text())
    ratio = result["ratios"]["a/b"]
    return {"ok": ratio > 0, "detail": f"a/b = {ratio:.3f} (DDPTrainer / bare loop tokens/s, 1 process; "
                                       f"{result['variants']['a']['median_tokens_per_sec']:.0f} tok/s)",
            "result": result}


@dataclass(frozen=True)
class Row:
    check: Callable[[Path], dict]
    keys: tuple[str, ...] = ()  # the config keys the check needs


def checks(gpus: int) -> dict[str, Row]:
    """The rows, in order: one check each, with the config keys it needs."""
    amp = ("use_amp", "amp_dtype")
    rows = {"nccl_1": Row(partial(check_nccl, nproc=1), ("backend",))}
    if gpus >= 2:
        rows["nccl_2"] = Row(partial(check_nccl, nproc=2), ("backend",))
    rows.update(bf16=Row(partial(check_amp, dtype="bf16"), amp), fp16=Row(partial(check_amp, dtype="fp16"), amp),
                scaler_overflow=Row(check_scaler_overflow, (*amp, "fault_inject")),
                oom_halving=Row(check_oom_halving, ("oom_recovery",)),
                memory=Row(check_memory, ("gradient_checkpointing",)),
                comm_hook=Row(partial(check_comm_hook, nproc=min(gpus, 2)), ("backend", "ddp_comm_hook")),
                compile=Row(partial(check_compile, gpus=gpus), ("compile",)), throughput=Row(check_throughput))
    return rows


def missing_keys(keys: tuple[str, ...]) -> list[str]:
    from framework.config import ALIASES, FIELDS
    known = set(FIELDS) | set(ALIASES)  # a row may name a key by section or by its old flat name
    return [k for k in keys if k not in known]


def run_row(name: str, row: Row, tmp: Path) -> dict:
    """One row's result: ok True/False, or None when this version lacks the row's config keys."""
    start = time.perf_counter()
    if missing := missing_keys(row.keys):
        result = {"ok": None, "detail": f"not available in this version (no config key {', '.join(missing)})"}
    else:
        try:
            result = row.check(tmp)
        except Exception as err:  # the check's failure is its result; the other checks still run
            result = {"ok": False, "detail": f"{type(err).__name__}: {str(err)[-800:]}"}
    result["seconds"] = time.perf_counter() - start
    status = {True: "ok", False: "FAILED", None: "n/a"}[result["ok"]]
    print(f"{name:<16} {status:<7} {result['seconds']:6.0f} s  {result['detail']}", flush=True)
    return result


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
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        results = {name: run_row(name, row, Path(tmp)) for name, row in selected.items()}
    total = time.perf_counter() - start
    out = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
           "cuda": torch.version.cuda, "total_seconds": total, "checks": results}
    RESULTS.write_text(json.dumps(out, indent=2, default=str) + "\n")
    over = f" (over the {BUDGET_S} s target: report it)" if total > BUDGET_S else ""
    print(f"total {total:.0f} s{over}; wrote {RESULTS}")
    return 0 if all(r["ok"] is not False for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
