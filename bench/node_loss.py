#!/usr/bin/env python3
"""Whole-node loss: a node's torchrun agent and its workers killed together (kill -9), as a power
cut, a kernel panic or a VM's preemption would, on 2 nodes on loopback.

Cells: topology (2x1: 2 nodes x 1 process; 2x2: 2 nodes x 2 processes) x rendezvous (c10d, whose
store lives in node 0's agent; etcd-v2, a real etcd server that no training node owns) x the node
lost (node 0, which hosts the c10d store; node 1) x the moment (mid_step: after rank 0 logs step
12; ckpt_write: while a checkpoint's temp file exists; eval: in the evaluation after step 16).
Every run is elastic (``--nnodes 1:2 --max-restarts 2``).

Each cell reports:

- outcome: ``survived`` (the nodes left finished the run, alone, with each step's samples those
  of an uninterrupted run and the final weights within WEIGHTS_TOLERANCE of its), ``relaunched`` (the job
  stopped cleanly; one relaunch of the surviving node's command, as a scheduler would do,
  finished it, with nothing lost), ``clean stop`` (a stop with a one-line reason and no relaunch
  could finish), ``HANG`` or ``FAILED``;
- seconds from the loss to the moment every surviving process has ended or the new restart's
  rank 0 has ended its first step ("to training or stop"), the issue's bound being 30 s;
- left: processes of the cell still alive after it (must be 0).

usage: python bench/node_loss.py [--topologies 2x1,2x2] [--backends c10d,etcd-v2] [--moments a,b] [--out node_loss.json]
Needs etcd (Debian's etcd-server) and python-etcd for the etcd-v2 cells; they are skipped, and say
so, without them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from framework.observability.metrics import read_samples  # noqa: E402
from harness.launch import (cli_args, free_port, kill_matching, processes_matching,  # noqa: E402
                                      torchrun_cmd, worker_env)

# 512 samples, 16 a step (data.global_batch_size: 4 ranks x 4, or 2 ranks x 4 x 2 accumulation,
# whatever world size a launch or restart starts at), 32 steps an epoch, 40 steps in all; a
# checkpoint every 8 steps, an evaluation every 16.
STEPS = 40
CONFIG = {"vocab_size": 64, "hidden_size": 64, "num_heads": 2, "num_layers": 2, "seq_len": 32, "dataset_size": 512,
          "dropout": 0.0, "batch_size": 4, "data.global_batch_size": 16, "train.max_steps": STEPS,
          "checkpoint.every_steps": 8, "checkpoint.keep_last": 10, "log_interval": 1, "eval.interval": 16,
          "eval.steps": 8, "num_workers": 0, "train.deterministic": True, "logging.record_samples": True,
          "logging.tensorboard": False, "target_loss": 0.0, "learning_rate": 2e-3, "optim.warmup_steps": 4,
          "train.seed": 5, "ddp.timeout_s": 30, "straggler.interval": 0,
          "recovery.fault_inject": "slow@step=0,ms=40,restart=*"}
RDZV_CONF = "join_timeout=20,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
MOMENTS = {"mid_step": "after rank 0 logs step 12", "ckpt_write": "a checkpoint temp file exists (step 8 first)",
           "eval": "rank 0 logged 'evaluating at step 16'"}
BOUND_S = 30.0
# The weights of a run that changed its world size differ from the uninterrupted run's only by the
# order of the gradient summation, which Adam amplifies over the steps: about 1e-5 after 40 steps
# here (tests/integration/test_elastic.py holds 1e-5 on shorter runs). A run that trained other samples, or
# another global batch, differs by 1e-2 and more.
WEIGHTS_TOLERANCE = 1e-4
TMP = re.compile(r"\.step_\d{8}\.pt\.tmp")


def rank0_log(run_dir: Path) -> str:
    path = run_dir / "logs" / "rank_0.log"
    return path.read_text(errors="replace") if path.exists() else ""


class Cluster:
    """Two nodes of one run: a torchrun agent each, with ``nproc`` workers."""

    def __init__(self, run_dir: Path, nproc: int, backend: str, endpoint_port: int):
        self.dir, self.nproc = run_dir, nproc
        cfg = {**CONFIG, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck")}
        cmd = torchrun_cmd(ROOT / "ddp_training.py", cli_args(cfg), nproc=nproc, port=endpoint_port,
                           extra=["--rdzv-id", run_dir.name, "--max-restarts", "2", "--rdzv-conf", RDZV_CONF])
        cmd[cmd.index("--nnodes") + 1] = "1:2"
        cmd[cmd.index("--rdzv-backend") + 1] = backend
        self.cmd = cmd
        self.env = worker_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # as launch_training.sh sets them
                               "RDZV_STORE_ENDPOINT": f"{backend}://127.0.0.1:{endpoint_port}"})
        self.procs: list[subprocess.Popen] = []
        self.launches = 0

    def start(self) -> subprocess.Popen:
        with open(self.dir / f"agent.{self.launches}.out", "wb") as out:
            proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.launches += 1
        self.procs.append(proc)
        return proc

    @staticmethod
    def workers(agent: subprocess.Popen) -> list[psutil.Process]:
        try:
            return [c for c in psutil.Process(agent.pid).children() if "RANK" in c.environ()]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return []

    def lose(self, agent: subprocess.Popen) -> None:
        workers = self.workers(agent)
        os.kill(agent.pid, signal.SIGKILL)
        for w in workers:
            w.kill()
        agent.wait()

    def kill_everything(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        kill_matching(f"{self.dir}/")


def epoch_steps(log_dir: Path) -> dict:
    out: dict = {}
    for path in log_dir.glob("samples_rank_*.jsonl"):
        for rec in read_samples(path):
            out.setdefault(rec["epoch"], {}).setdefault(rec["step"], []).extend(rec["indices"])
    return {e: {s: sorted(i) for s, i in steps.items()} for e, steps in out.items()}


def weights_diff(a: Path, b: Path) -> float:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return max((x[k] - y[k]).abs().max().item() for k in x)


def reference(topology: str, workdir: Path) -> Path:
    """An uninterrupted run at the topology's full world size (one node of 2 or 4 processes)."""
    run_dir = workdir / f"reference-{topology}"
    world = 2 if topology == "2x1" else 4
    cfg = {**CONFIG, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck")}
    cfg.pop("fault_inject")
    proc = subprocess.run(torchrun_cmd(ROOT / "ddp_training.py", cli_args(cfg), nproc=world), cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the {topology} reference failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    kill_matching(f"{run_dir}/")
    return run_dir


def moment_reached(moment: str, run_dir: Path) -> bool:
    if moment == "mid_step":
        return "step 12/" in rank0_log(run_dir)
    if moment == "eval":
        return "evaluating at step 16" in rank0_log(run_dir)
    ck = run_dir / "ck"
    return ck.is_dir() and any(TMP.search(p.name) for p in ck.iterdir())


def ended(agent: subprocess.Popen, res: dict, what: str, timeout: float = 180) -> bool:
    """Whether ``agent`` ended within ``timeout`` s; if not, ``res`` says HANG."""
    try:
        agent.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        res.update(outcome="HANG", reason=f"{what} still ran {timeout:.0f} s later")
        return False


def run_finished(run_dir: Path) -> bool:
    summary = run_dir / "logs" / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("steps") == STEPS


def run_cell(topology: str, backend: str, lost: int, moment: str, port: int, ref: Path, workdir: Path) -> dict:
    run_dir = workdir / f"{topology}-{backend}-node{lost}-{moment}"
    (run_dir / "logs").mkdir(parents=True)
    cluster = Cluster(run_dir, 2 if topology == "2x2" else 1, backend, port if backend == "etcd-v2" else free_port())
    res: dict = {"topology": topology, "backend": backend, "lost": f"node {lost}" + (
        " (c10d store host)" if lost == 0 and backend == "c10d" else ""), "moment": moment}
    try:
        cluster.start()
        time.sleep(0.5)  # node 0 starts first: under c10d it hosts the store
        cluster.start()
        deadline = time.monotonic() + 120
        while not moment_reached(moment, run_dir):
            if time.monotonic() > deadline or all(p.poll() is not None for p in cluster.procs):
                res.update(outcome="FAILED", reason="the moment never came")
                return res
            time.sleep(0.001)
        victim = cluster.procs[lost]
        survivor = cluster.procs[1 - lost]
        survivors = [survivor.pid] + [w.pid for w in cluster.workers(survivor)]
        before = rank0_log(run_dir)
        cluster.lose(victim)
        lost_at = time.monotonic()
        # To training again (a step line after a resume in rank 0's log), or every survivor ended.
        settled = None
        while time.monotonic() - lost_at < 120:
            # A new restart's rank 0 logs its start-up at the end of its first step.
            if "start-up took" in rank0_log(run_dir)[len(before):]:
                settled = "training again"
                break
            if all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in survivors):
                settled = "every surviving process ended"
                break
            time.sleep(0.01)
        res["to_settled_s"] = round(time.monotonic() - lost_at, 1)
        res["settled"] = settled or "neither within 120 s"
        if not ended(survivor, res, "the surviving node"):
            return res
        res["exit"] = survivor.returncode
        finished = run_finished(run_dir)
        if not finished:
            # A scheduler relaunches the node that is left (alone: the range admits one node).
            relaunch = cluster.start()
            if not ended(relaunch, res, "the relaunch"):
                return res
            res["relaunch_exit"] = relaunch.returncode
            finished = run_finished(run_dir)
            res["outcome"] = "relaunched" if finished else "clean stop"
            stopped = [line for line in (run_dir / "agent.1.out").read_text(errors="replace").splitlines()
                       if line.startswith(("error:", "fatal:"))] if (run_dir / "agent.1.out").exists() else []
            res["first_stop"] = (stopped[-1][:200] if stopped else "")
        else:
            res["outcome"] = "survived"
        if finished:
            got, want = epoch_steps(run_dir / "logs"), epoch_steps(ref / "logs")
            res["samples_exact"] = got == want
            res["max_weight_diff"] = weights_diff(run_dir / "ck" / "final_model.pt", ref / "ck" / "final_model.pt")
            if not res["samples_exact"] or res["max_weight_diff"] > WEIGHTS_TOLERANCE:
                res["outcome"] = "FAILED"
                res["reason"] = "something lost: samples or weights differ from the uninterrupted run"
        if res["to_settled_s"] > BOUND_S and res["outcome"] != "FAILED":
            res["reason"] = f"settled after {res['to_settled_s']} s, over {BOUND_S:.0f} s"
    finally:
        cluster.kill_everything()
        time.sleep(0.5)
        res["left"] = len(processes_matching(f"{run_dir}/"))
        kill_matching(f"{run_dir}/")
    return res


def start_etcd(workdir: Path) -> tuple[subprocess.Popen | None, int, str]:
    if shutil.which("etcd") is None:
        return None, 0, "etcd is not installed (apt-get install etcd-server)"
    try:
        import etcd  # noqa: F401
    except ImportError:
        return None, 0, "python-etcd is not installed (pip install python-etcd)"
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(["etcd", "--enable-v2", "--data-dir", str(workdir / "etcd"), "--name", "bench",
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"bench=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)
    return proc, client, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default="2x1,2x2")
    parser.add_argument("--backends", default="c10d,etcd-v2")
    parser.add_argument("--moments", default=",".join(MOMENTS))
    parser.add_argument("--out", default="node_loss.json", help="a file name under bench/results/, or a path")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="node-loss-"))
    etcd_proc, etcd_port, why = start_etcd(workdir)
    cells, skipped = [], []
    try:
        refs = {t: reference(t, workdir) for t in args.topologies.split(",")}
        for topology, backend, lost, moment in itertools.product(args.topologies.split(","), args.backends.split(","),
                                                                 (0, 1), args.moments.split(",")):
            if backend == "etcd-v2" and etcd_proc is None:
                skipped.append(f"{topology} {backend} node {lost} {moment}: {why}")
                continue
            res = run_cell(topology, backend, lost, moment, etcd_port, refs[topology], workdir)
            cells.append(res)
            print(json.dumps(res), flush=True)
    finally:
        if etcd_proc is not None:
            etcd_proc.kill()
            etcd_proc.wait()
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n| topology | rendezvous | node lost | moment | outcome | to training or stop, s | exits | left |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        exits = f"{c.get('exit')}" + (f", relaunch {c['relaunch_exit']}" if "relaunch_exit" in c else "")
        print(f"| {c['topology']} | {c['backend']} | {c['lost']} | {c['moment']} | {c['outcome']} | "
              f"{c.get('to_settled_s')} ({c.get('settled', '')}) | {exits} | {c.get('left')} |")
    for s in skipped:
        print(f"skipped: {s}")
    out = Path(args.out) if "/" in args.out else ROOT / "bench" / "results" / args.out
    out.write_text(json.dumps({"config": CONFIG, "bound_s": BOUND_S, "cells": cells, "skipped": skipped},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
