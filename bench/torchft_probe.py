#!/usr/bin/env python3
"""Does torchft fit the framework's in-place healing (issue 31), on torch 2.13 and gloo?

A probe outside the framework, of the engine issue 31 names first: torchft's Lighthouse, Manager,
reconfigurable ProcessGroupGloo, DistributedDataParallel and Optimizer wrappers. Each replica is a
plain process of its own (a replica group of one rank: torchft runs each as its own torchrun job,
since torchrun's agent restarts every local worker when one fails). The replicas train a small
model on the same global batch of every step, split among the step's participants; at
``--kill-at`` the parent kills the last replica (kill -9) and starts it again ``--restart-after``
seconds later, and it heals from a live peer. Measured:

- the time from the kill to the survivors' next committed step;
- the newcomer's time from its spawn (imports included) to its first committed step, and the survivors' longest step
  while it joined (their pause);
- the final weights against one process that trained every committed step's whole global batch
  (nothing lost: an uncommitted step is redone with the same batch), and the same without a fault
  on 1 and 2 replicas;
- what does not fit: torchft's DDP always sets ``find_unused_parameters=True`` (it never rebuilds
  buckets), which a model with reentrant activation checkpointing cannot train under; and whether
  torch's own ``dist.shrink_group`` supports gloo.

Writes bench/results/torchft_probe.json. Needs torchft (``pip install torchft-nightly``, torch >= 2.7).

    python bench/torchft_probe.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4: each step's participants split the same batch
DIM = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batch(step: int):
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def make_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def replica(index: int, lighthouse: str, steps: int, out: str, step_s: float, min_replicas: int) -> None:
    """One replica group of one rank: train until the manager's step reaches ``steps``; record each
    step's outcome (committed or not, participants, wall time) in ``out`` as JSON lines."""
    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    port = free_port()
    _store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the manager's, kept alive
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=5)), min_replica_size=min_replicas,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"probe_{index}",
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=port, lighthouse_addr=lighthouse,
                      timeout=datetime.timedelta(seconds=10), quorum_timeout=datetime.timedelta(seconds=30))
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, optimizer)
    with open(out, "a") as log:
        log.write(json.dumps({"event": "start", "t": time.time()}) + "\n")
        while manager.current_step() < steps:
            step = manager.current_step()
            t0 = time.time()
            opt.zero_grad()  # starts the quorum
            try:
                n, rank = manager.num_participants(), manager.participating_rank()
                rank = 0 if rank is None else rank  # healing: not participating, its gradients are zeroed
                step = manager.current_step()  # after the quorum: a newcomer healed from a peer is at its step
                x, y = global_batch(step)
                share = GLOBAL_BATCH // max(n, 1)
                xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
                loss = torch.nn.functional.mse_loss(ddp(xs), ys)
                loss.backward()
                opt.step()  # steps only if every participant committed
                committed = manager.current_step() > step
            except Exception as err:  # noqa: BLE001 - a probe records what happened
                n, committed = -1, False
                log.write(json.dumps({"event": "error", "step": step, "error": repr(err)[:200]}) + "\n")
            log.write(json.dumps({"event": "step", "step": step, "committed": committed, "participants": n,
                                  "t0": t0, "t": time.time()}) + "\n")
            log.flush()
            time.sleep(step_s)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out + ".pt")
        log.write(json.dumps({"event": "done", "t": time.time()}) + "\n")
    manager.shutdown(wait=False)
    os._exit(0)  # the manager's threads would keep the process


def reference(steps: int):
    """One process training every step's whole global batch."""
    import torch
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = global_batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def without_faults(replicas: int, steps: int = 5) -> float:
    """The largest difference from one process after ``steps`` steps of ``replicas`` replicas with no
    fault (the same global batches, split)."""
    import torch
    from torchft.coordination import LighthouseServer
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=replicas, join_timeout_ms=1000)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"torchft_probe_{os.getpid()}_nofault{replicas}"
    work.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    outs = [str(work / f"replica_{i}.jsonl") for i in range(replicas)]
    procs = [ctx.Process(target=replica, args=(i, lighthouse.address(), steps, outs[i], 0.0, replicas))
             for i in range(replicas)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    lighthouse.shutdown()
    ref = reference(steps)
    return max(float((torch.load(o + ".pt", weights_only=True)[k] - ref[k]).abs().max()) for o in outs for k in ref)


def reentrant_under_torchft_ddp() -> str:
    """torchft's DDP with a reentrant-checkpointed block, one replica: the error, or 'trained'."""
    import torch
    from torch.utils.checkpoint import checkpoint
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    import torch.distributed as dist

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = free_port()
    _store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # kept alive
    model = make_model()
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=None, state_dict=None,
                      replica_id="reentrant", rank=0, world_size=1, store_addr="127.0.0.1", store_port=port,
                      lighthouse_addr=lighthouse.address())

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=True) + checkpoint(self.inner, x, use_reentrant=True)

    ddp = DistributedDataParallel(manager, Checkpointed())
    try:
        for step in range(2):
            manager.start_quorum()
            x, y = global_batch(step)
            torch.nn.functional.mse_loss(ddp(x.requires_grad_()), y).backward()
            manager.should_commit()
        outcome = "trained"
    except Exception as err:  # noqa: BLE001
        outcome = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    manager.shutdown(wait=False)
    lighthouse.shutdown()
    return outcome


def _shrink_rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 0:
        try:
            dist.shrink_group([1])
            out.put("shrank")
        except Exception as err:  # noqa: BLE001
            out.put(f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    os._exit(0)


def shrink_group_on_gloo() -> str:
    """torch's own ``dist.shrink_group`` of a 2-rank gloo group, from rank 0."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_shrink_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=5)
            p.kill()


def torchft_version() -> str:
    from importlib import metadata
    for dist_name in ("torchft-nightly", "torchft"):
        try:
            return f"{dist_name} {metadata.version(dist_name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()] \
        if Path(path).exists() else []


def summarize(logs: dict[int, list[dict]], killed: int, kill_t: float, restart_t: float) -> dict:
    survivors = [i for i in logs if i != killed]
    after_kill = [e for i in survivors for e in logs[i] if e["event"] == "step" and e["committed"] and e["t"] > kill_t]
    joined = [e for e in logs[killed] if e["event"] == "step" and e["committed"] and e["t0"] > restart_t]
    start = [restart_t] if any(e["event"] == "start" and e["t"] > restart_t for e in logs[killed]) else []
    during_join = [e["t"] - e["t0"] for i in survivors for e in logs[i] if e["event"] == "step"
                   and start and joined and start[0] <= e["t"] <= joined[0]["t"] + 0.5]
    uncommitted = sorted({e["step"] for i in logs for e in logs[i] if e["event"] == "step" and not e["committed"]})
    return {
        "kill_to_survivors_next_commit_s": round(min(e["t"] for e in after_kill) - kill_t, 3) if after_kill else None,
        "newcomer_spawn_to_first_commit_s": round(joined[0]["t"] - start[0], 3) if joined and start else None,
        "survivors_longest_step_while_it_joined_s": round(max(during_join), 3) if during_join else None,
        "uncommitted_steps": uncommitted,
        "errors": [e["error"] for i in logs for e in logs[i] if e["event"] == "error"][:6],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kill-at", type=int, default=15, help="the manager step at which the last replica is killed")
    ap.add_argument("--restart-after", type=float, default=2.0)
    ap.add_argument("--step-s", type=float, default=0.1, help="a pause after each step (the model is tiny)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "torchft_probe.json"))
    args = ap.parse_args()
    shrink = shrink_group_on_gloo()  # first: before this process imports torchft and holds a lighthouse
    import torch
    from torchft.coordination import LighthouseServer

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"torchft_probe_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    min_replicas = max(1, args.replicas - 1)  # the survivors of one loss may go on
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    outs = {i: str(work / f"replica_{i}.jsonl") for i in range(args.replicas)}
    procs = {i: ctx.Process(target=replica, args=(i, lighthouse.address(), args.steps, outs[i], args.step_s,
                                                                   min_replicas))
             for i in range(args.replicas)}
    for p in procs.values():
        p.start()
    killed = args.replicas - 1
    kill_t = restart_t = 0.0
    deadline = time.time() + 300
    while time.time() < deadline:
        steps = [e["step"] for e in read(outs[0]) if e["event"] == "step" and e["committed"]]
        if steps and max(steps) >= args.kill_at:
            break
        time.sleep(0.05)
    os.kill(procs[killed].pid, signal.SIGKILL)
    kill_t = time.time()
    procs[killed].join()
    time.sleep(args.restart_after)
    restart_t = time.time()
    procs[killed] = ctx.Process(target=replica, args=(killed, lighthouse.address(), args.steps, outs[killed],
                                                      args.step_s, min_replicas))
    procs[killed].start()
    for i, p in procs.items():  # the newcomer, if it never joined, cannot finish once the others have
        p.join(timeout=max(1.0, deadline - time.time()) if i != killed else 0)
    procs[killed].join(timeout=20)
    hung = [i for i, p in procs.items() if p.is_alive()]
    for i in hung:
        procs[i].kill()
    lighthouse.shutdown()
    logs = {i: read(outs[i]) for i in outs}
    result = {"torch": torch.__version__, "torchft": torchft_version(),
              "replicas": args.replicas, "steps": args.steps, "killed_at_step": args.kill_at, "hung": hung,
              **summarize(logs, killed, kill_t, restart_t)}
    ref = reference(args.steps)
    finals = {i: torch.load(outs[i] + ".pt", weights_only=True) for i in outs if Path(outs[i] + ".pt").exists()}
    result["max_diff_vs_one_process"] = max((float((w[k] - ref[k]).abs().max()) for w in finals.values() for k in ref),
                                           default=None)
    result["replicas_finished"] = sorted(finals)
    result["shrink_group_on_gloo"] = shrink
    for name, probe in (("no_fault_1_replica_max_diff_after_5_steps", lambda: without_faults(1)),
                        ("no_fault_2_replicas_max_diff_after_5_steps", lambda: without_faults(2)),
                        ("reentrant_checkpointing_under_torchft_ddp", reentrant_under_torchft_ddp)):
        try:
            result[name] = probe()
        except Exception:  # noqa: BLE001
            result[name] = traceback.format_exc(limit=1).splitlines()[-1]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    sys.exit(0 if not hung else 1)


if __name__ == "__main__":
    main()
