#!/usr/bin/env python3
"""Goodput under repeated faults: train for a few minutes with a fault every T seconds and report
the ideal time for the steps done (steps x the uninterrupted run's step time) divided by the wall
time, and where each recovery's seconds went.

Variants (each a fresh run of --minutes, the same model and data):

- ``none``: no fault, the baseline (its goodput < 1 only by start-up and the final save);
- ``kill9_worker``: 1 node x 2 processes under ``torchrun --max-restarts 100``; every T s a
  kill -9 of one worker (rank 1, then rank 0, ...): the survivor saves the last finished step
  alone (checkpoint.save_on_peer_loss), and torchrun restarts the group, which resumes from it;
- ``kill9_worker_nosave``: the same with ``checkpoint.save_on_peer_loss=false``: the restart
  redoes the steps since the last periodic checkpoint;
- ``sigterm``: 1 node x 2; every T s a SIGTERM to a worker: the ranks save and exit, and the
  bench relaunches the same command at once (a scheduler's requeue);
- ``node_loss``: 2 nodes x 1 process, ``--nnodes 1:2`` (c10d; node 0 hosts the store); every T s
  node 1 (its agent and worker, kill -9) is lost and a replacement node 1 is started at once: the
  survivor re-forms the group alone, then grows back to 2 ranks when the new node joins;
- ``kill9_heal``: ``launch_training.sh --heal --max-restarts 100`` (recovery.heal=in_place, one
  torchrun job per rank); every T s a kill -9 of replica 1's worker: the survivors go on in their
  processes at once, and the worker its torchrun starts again rejoins at the end of a step;
- ``kill9_heal_random``: the same, the kills at random (exponential intervals of mean T, seeded);
- ``kill9_heal_spare``, ``kill9_heal_spare_random``: the same with one more process, a spare
  (``--spares 1``) that steps in at once for the lost rank; the killed worker, started again,
  becomes the next spare. The victim is a training member other than replica 0 (whose log the
  bench reads).

``--nproc`` sets the processes of the kill9 variants (2 by default). Besides the goodput (steps x
step time / wall), each result has torchft's accounting: the steps weighted by the share of the
replicas that took part (a step on 1 of 2 replicas counts 0.5), x step time / wall.

Each recovery: seconds from the fault to rank 0's first step after it resumed (or healed in place),
and to its next new step; and the restarted rank 0's own account of its start-up (the "start-up
took" line: interpreter and imports, process group, model and data, checkpoint load, DDP preflight,
first step).

usage: python bench/goodput.py [--minutes 3] [--every 60] [--nproc 2]
                               [--variants none,kill9_worker,kill9_worker_nosave,sigterm,node_loss,kill9_heal,
                                kill9_heal_random] [--save-every 40] [--out goodput.json]
Run it alone: the figures are times on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from fault_campaign import LogWatch  # noqa: E402  (tails the rank logs, timing each line)
from harness.launch import cli_args, free_port, kill_matching, torchrun_cmd, worker_env  # noqa: E402

# The fault campaign's model (about 60 ms a step on 2 ranks here), trained without end: the bench
# stops it. A checkpoint every 40 steps (about 3 s), asynchronous.
CONFIG = {"vocab_size": 64, "hidden_size": 96, "num_heads": 2, "num_layers": 2, "seq_len": 48, "dataset_size": 2560,
          "batch_size": 40, "dropout": 0.0, "train.max_steps": 10**6, "num_epochs": 10**4,
          "checkpoint.every_steps": 40, "checkpoint.keep_last": 2, "log_interval": 1, "eval.interval": 0,
          "num_workers": 0, "train.deterministic": True, "logging.tensorboard": False, "target_loss": 0.0,
          "learning_rate": 2e-3, "optim.warmup_steps": 4, "train.seed": 5, "straggler.interval": 0}
RDZV_CONF = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
STEP_LINE = re.compile(r"step (\d+)/")
STARTUP_LINE = re.compile(r"start-up took ([\d.]+) s to the end of the first step: (.*)")
WORLD_LINE = re.compile(r"goes on with (\d+) of|trains on (\d+) ranks")
MEMBERS_LINE = re.compile(r"generation \d+ of the run \(replicas \[([\d, ]+)\]\)")


class Job:
    """The agents of one variant's run, each in a session of its own."""

    def __init__(self, variant: str, run_dir: Path, nproc: int = 2):
        self.variant, self.dir, self.nproc = variant, run_dir, nproc
        args = cli_args({**CONFIG, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck"),
                         "checkpoint.save_on_peer_loss": variant != "kill9_worker_nosave"})
        self.port = free_port()
        script = ROOT / "ddp_training.py"
        if variant == "node_loss":
            cmd = torchrun_cmd(script, args, nproc=1, port=self.port,
                               extra=["--rdzv-id", "goodput", "--max-restarts", "100", "--rdzv-conf", RDZV_CONF])
            cmd[cmd.index("--nnodes") + 1] = "1:2"
            self.cmds = [cmd, cmd]
            # As launch_training.sh sets them for a node range.
            self.env = worker_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                   "RDZV_STORE_ENDPOINT": f"c10d://127.0.0.1:{self.port}"})
        elif variant.startswith("kill9_heal"):
            spares = ["--nproc", str(nproc + 1), "--spares", "1"] if "_spare" in variant else ["--nproc", str(nproc)]
            self.cmds = [[str(ROOT / "launch_training.sh"), "--cpu", *spares, "--heal", "--max-restarts", "100", "--",
                          *args]]
            self.env = worker_env()
        else:
            self.cmds = [torchrun_cmd(script, args, nproc=nproc, port=self.port, extra=["--max-restarts", "100"])]
            self.env = worker_env()
        self.procs: list[subprocess.Popen | None] = [None] * len(self.cmds)
        self.launches = 0

    def start(self, node: int) -> None:
        with open(self.dir / f"agent{node}.{self.launches}.out", "wb") as out:
            self.procs[node] = subprocess.Popen(self.cmds[node], cwd=ROOT, env=self.env, stdout=out,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        self.launches += 1

    def workers(self, node: int) -> list[psutil.Process]:
        """The training processes (torchrun's workers; under the launcher, its jobs' workers)."""
        try:
            children = psutil.Process(self.procs[node].pid).children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return []
        out = []
        for child in children:
            try:
                if "RANK" in child.environ() and "ddp_training.py" in " ".join(child.cmdline()):
                    out.append(child)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def done(self) -> bool:
        return all(p is None or p.poll() is not None for p in self.procs)

    def kill_everything(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        kill_matching(f"{self.dir}/")


def last_step(watch: LogWatch) -> int:
    steps = [int(m.group(1)) for _, r, line in watch.lines if r == 0 and (m := STEP_LINE.search(line))]
    return steps[-1] if steps else 0


def run_variant(variant: str, minutes: float, every: float, workdir: Path, step_s: float | None,
                nproc: int = 2) -> dict:
    run_dir = workdir / variant
    (run_dir / "logs").mkdir(parents=True)
    job, watch = Job(variant, run_dir, nproc), LogWatch(run_dir)
    draw = random.Random(0)
    interval = (lambda: draw.expovariate(1 / every)) if variant.endswith("_random") else (lambda: every)
    start = time.monotonic()
    for node in range(len(job.cmds)):
        job.start(node)
    stop_at, next_fault = start + 60 * minutes, start + interval()
    faults: list[dict] = []
    victim = 1
    try:
        while time.monotonic() < stop_at:
            watch.poll()
            now = time.monotonic()
            if variant == "sigterm" and job.done():  # saved and exited: the scheduler requeues at once
                job.start(0)
            if variant != "none" and now >= next_fault and last_step(watch) > 0:
                fault = {"at_s": round(now - start, 1), "step": last_step(watch)}
                if variant.startswith("kill9_worker"):
                    workers = {int(w.environ()["RANK"]): w for w in job.workers(0)}
                    if victim in workers:
                        workers[victim].kill()
                        fault["what"] = f"kill -9 of rank {victim}"
                        victim = 1 - victim
                elif variant.startswith("kill9_heal"):
                    workers = {int(w.environ()["HEAL_REPLICA"]): w for w in job.workers(0)}
                    members = [[int(m) for m in found.group(1).split(",")] for _, r, line in watch.lines
                               if r == 0 and (found := MEMBERS_LINE.search(line))]
                    victim = (members[-1] if members else [0, 1])[-1]  # replica 0 stays rank 0 (its log is read)
                    if victim in workers and victim != 0:
                        workers[victim].kill()
                        fault["what"] = f"kill -9 of replica {victim}"
                elif variant == "sigterm":
                    workers = job.workers(0)
                    if workers:
                        workers[-1].send_signal(signal.SIGTERM)
                        fault["what"] = "SIGTERM to a worker; relaunched when the job ended"
                elif variant == "node_loss":
                    workers = job.workers(1)
                    os.kill(job.procs[1].pid, signal.SIGKILL)
                    for w in workers:
                        w.kill()
                    job.procs[1].wait()
                    job.start(1)  # a replacement node joins at once
                    fault["what"] = "node 1 lost (agent and worker, kill -9), a replacement node started"
                if "what" in fault:
                    fault["t"] = now
                    faults.append(fault)
                next_fault = now + interval()
            time.sleep(0.01)
        # The end: every worker saves and exits (a preemption), as at the end of an allocation.
        end = time.monotonic()
        for node in range(len(job.cmds)):
            for w in job.workers(node):
                w.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not job.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.poll()
    finally:
        job.kill_everything()
        watch.close()
    summary = json.loads((run_dir / "logs" / "summary.json").read_text())
    # Each fault's recovery: from the fault to rank 0's first step after its resume, and to the first
    # step beyond what was done before the fault (the work lost since the checkpoint is redone first).
    for fault in faults:
        t = fault.pop("t")
        before = max([int(m.group(1)) for ts, r, line in watch.lines if ts < t and r == 0
                      and (m := STEP_LINE.search(line))] or [0])
        resumed = next((ts for ts, r, line in watch.lines if ts >= t and r == 0
                        and ("resumed from step" in line or "healed in place at step" in line)), None)
        steps_after = [(ts, int(m.group(1))) for ts, r, line in watch.lines if ts >= t and r == 0
                       and (m := STEP_LINE.search(line))]
        first = next((ts for ts, _ in steps_after if resumed is not None and ts >= resumed), None)
        fault["to_first_step_s"] = round(first - t, 2) if first is not None else None
        fault["to_new_progress_s"] = next((round(ts - t, 2) for ts, s in steps_after if s > before), None)
        startups = [m for ts, r, line in watch.lines if ts >= t and r == 0 and (m := STARTUP_LINE.search(line))]
        if startups:
            fault["startup_s"], fault["startup"] = float(startups[0].group(1)), startups[0].group(2)
    wall = end - start
    steps = int(summary["steps"])
    gaps = []
    if variant == "none":
        seen = {}
        for ts, r, line in watch.lines:
            if r == 0 and (m := STEP_LINE.search(line)):
                seen.setdefault(int(m.group(1)), ts)
        times = [seen[k] for k in sorted(seen)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        step_s = statistics.median(gaps)
    # torchft's accounting: each step counts by the share of the replicas that took part in it.
    world, weighted, counted = nproc, 0.0, set()
    for _, r, line in watch.lines:
        if r != 0:
            continue
        if m := WORLD_LINE.search(line):
            world = int(m.group(1) or m.group(2))
        elif (m := STEP_LINE.search(line)) and int(m.group(1)) not in counted:
            counted.add(int(m.group(1)))
            weighted += world / nproc
    weighted *= steps / max(len(counted), 1)  # the steps rank 0 did not log (none at log_interval 1)
    result = {"variant": variant, "wall_s": round(wall, 1), "steps": steps, "step_s": step_s,
              "goodput": round(steps * step_s / wall, 4) if step_s else None,
              "goodput_torchft": round(weighted * step_s / wall, 4) if step_s else None, "faults": faults,
              "startup_first_launch": next((m.group(0) for _, r, line in watch.lines
                                            if r == 0 and (m := STARTUP_LINE.search(line))), None)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--every", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--variants", default="none,kill9_worker,kill9_worker_nosave,sigterm,node_loss")
    parser.add_argument("--out", default="goodput.json", help="a file name under bench/results/, or a path")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--baseline-minutes", type=float, default=0.0,
                        help="minutes of the fault-free run that gives the step time (default: --minutes)")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the kill9 variants")
    parser.add_argument("--batch-size", type=int, default=CONFIG["batch_size"],
                        help="per-rank batch; the global batch must split over the ranks a heal leaves")
    parser.add_argument("--save-every", type=int, default=CONFIG["checkpoint.every_steps"],
                        help="steps between checkpoints (the work a fault loses is redone from the last one)")
    args = parser.parse_args()
    CONFIG["checkpoint.every_steps"] = args.save_every
    CONFIG["batch_size"] = args.batch_size
    variants = args.variants.split(",")
    if variants[0] != "none":
        variants.insert(0, "none")  # the step time every goodput is computed with
    workdir = Path(tempfile.mkdtemp(prefix="goodput-"))
    results, step_s = [], None
    try:
        for variant in variants:
            minutes = args.baseline_minutes if variant == "none" and args.baseline_minutes else args.minutes
            result = run_variant(variant, minutes, args.every, workdir, step_s, args.nproc)
            step_s = result["step_s"]
            results.append(result)
            print(f"{variant}: {result['steps']} steps in {result['wall_s']} s, goodput {result['goodput']}, "
                  f"recoveries {[f.get('to_new_progress_s') for f in result['faults']]}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n| variant | faults | steps | wall s | goodput | torchft's accounting | vs none | fault -> first step s "
          "(each) | fault -> new progress s (each) |\n|---|---|---|---|---|---|---|---|---|")
    baseline = results[0]["goodput"]
    for r in results:
        firsts = ", ".join(str(f.get("to_first_step_s")) for f in r["faults"]) or "-"
        news = ", ".join(str(f.get("to_new_progress_s")) for f in r["faults"]) or "-"
        r["vs_none"] = round(r["goodput"] / baseline, 4)
        print(f"| {r['variant']} | {len(r['faults'])} | {r['steps']} | {r['wall_s']} | {r['goodput']:.3f} | "
              f"{r['goodput_torchft']:.3f} | {r['vs_none']:.3f} | {firsts} | {news} |")
    out = Path(args.out) if "/" in args.out else ROOT / "bench" / "results" / args.out
    out.write_text(json.dumps({"minutes": args.minutes, "every_s": args.every, "nproc": args.nproc, "config": CONFIG,
                               "machine": f"{os.cpu_count()} CPUs", "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
