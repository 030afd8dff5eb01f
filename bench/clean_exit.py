#!/usr/bin/env python3
"""How often a finished 2-rank run that simply ends (no ``os._exit``) fails to exit 0.

Launches tests/workers/clean_exit.py N times with ``torchrun --nproc-per-node 2 --standalone``
(gloo, OMP_NUM_THREADS=1), the cases taking turns (default: the built-in GPT and a tiny
LlamaForCausalLM under PEFT LoRA; ``manual`` steps a trainer by hand and never closes it); each
launch trains 3 steps and returns. Counts, per case: the launches, those that exited 0, those where
a worker aborted (SIGABRT: exit code -6 or 134), the "terminate called" lines (what torch 2.13
prints when it aborts during the interpreter's finalisation), and the ranks whose gloo threads
were still alive after the exit handlers (their process group is freed during the finalisation).
Prints a table and writes JSON to bench/results/clean_exit.json.

usage: python bench/clean_exit.py [-n 50] [--models gpt,lora,manual] [--out FILE] [--cores DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.launch import kill_matching, worker_env  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "clean_exit.py"
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
TERMINATE = "terminate called"
LEFT_AT_EXIT = re.compile(r"gloo threads at exit: \[.+\]")  # a rank whose process group outlived the exit handlers


def one_launch(model: str, run_dir: Path, *, timeout: float, cores: Path | None) -> dict:
    """One torchrun launch; its exit code, the failed workers' exit codes and the abort evidence."""
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    env = worker_env({"TEST_OUT_DIR": str(run_dir), "CLEAN_EXIT_CASES": model})

    def unlimited_cores() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cores or run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=unlimited_cores if cores else None)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        output += f"\n[clean_exit] timed out after {timeout} s"
    finally:
        kill_matching(str(run_dir))
    worker_codes = [int(c) for c in EXITCODE.findall(output)]
    return {"model": model, "returncode": proc.returncode, "worker_exitcodes": worker_codes,
            "aborted": any(c in (-6, 134) for c in worker_codes) or "SIGABRT" in output,
            "terminate_called": output.count(TERMINATE), "trained": output.count(f"{model} trained"),
            "gloo_threads_at_exit": len(LEFT_AT_EXIT.findall(output)),
            "seconds": round(time.monotonic() - start, 1),
            "tail": None if proc.returncode == 0 else output[-3000:]}


def summarize(launches: list[dict]) -> dict:
    return {"launches": len(launches), "exit_0": sum(r["returncode"] == 0 for r in launches),
            "aborted": sum(r["aborted"] for r in launches),
            "terminate_called": sum(r["terminate_called"] for r in launches),
            "both_ranks_trained": sum(r["trained"] == 2 for r in launches),
            "ranks_with_gloo_threads_at_exit": sum(r["gloo_threads_at_exit"] for r in launches)}


def write_json(out: Path, label: str, models: list[str], launches: list[dict]) -> dict:
    rows = {m: summarize([r for r in launches if r["model"] == m]) for m in models}
    rows["all"] = summarize(launches)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps({"label": label, "summary": rows, "launches": launches}, indent=1))
    tmp_out.replace(out)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=50, help="launches in all, the models taking turns")
    parser.add_argument("--models", default="gpt,lora")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "clean_exit.json"))
    parser.add_argument("--label", default="", help="recorded in the JSON, e.g. the commit measured")
    parser.add_argument("--cores", help="let aborting workers dump core into this directory (gdb)")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    cores = Path(args.cores).resolve() if args.cores else None
    if cores:
        cores.mkdir(parents=True, exist_ok=True)
    launches: list[dict] = []
    rows = write_json(Path(args.out), args.label, models, launches)
    with tempfile.TemporaryDirectory(prefix="clean_exit_") as tmp:
        for i in range(args.n):
            record = one_launch(models[i % len(models)], Path(tmp) / f"launch_{i}", timeout=args.timeout,
                                cores=cores)
            launches.append(record)
            print(f"launch {i + 1}/{args.n} {record['model']}: exit {record['returncode']}, worker exit codes "
                  f"{record['worker_exitcodes'] or '-'}, terminate called x{record['terminate_called']}, "
                  f"{record['seconds']} s", flush=True)
            rows = write_json(Path(args.out), args.label, models, launches)  # an interrupted run keeps its launches
    print("\n| model | launches | exit 0 | aborts | \"terminate called\" | both ranks trained "
          "| ranks with gloo threads at exit |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['launches']} | {row['exit_0']} | {row['aborted']} | {row['terminate_called']} "
              f"| {row['both_ranks_trained']} | {row['ranks_with_gloo_threads_at_exit']} |")
    print(f"written: {args.out}")
    return 0 if rows["all"]["exit_0"] == rows["all"]["launches"] else 1


if __name__ == "__main__":
    sys.exit(main())
