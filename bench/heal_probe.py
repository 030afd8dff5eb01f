#!/usr/bin/env python3
"""Can survivors of a lost peer keep training in the same processes, on torch 2.13 and gloo?

A probe of the primitives issue 31 ("Heal in place") would build on, outside the framework: N
processes (plain multiprocessing, not torchrun, whose agent restarts every local worker when one
fails) train a small DDP model. At step K the parent kills the last rank (kill -9) or freezes it
(SIGSTOP). Each survivor:

- names the lost peer from heartbeats it reads through the rendezvous TCPStore (a thread with its
  own client, outside the training collectives), within ``--peer-timeout`` seconds;
- never waits inside a collective it cannot leave: DDP's gradient all-reduce goes through a comm
  hook whose future the heartbeat monitor fails when a peer is lost, so backward raises;
- keeps the old process group referenced ("parked": its gloo threads may still be blocked on the
  frozen peer, and freeing it would join them), destroys the default group, and joins a new one at
  the smaller world size on a fresh store prefix, in the same process;
- wraps the model in DDP again and redoes the interrupted step with the same global batch (the
  survivors split it), from the parameters every rank holds: the optimizer never stepped.

It also checks, on its own, whether ``ProcessGroupGloo.abort()`` ends a collective blocked on a
frozen peer. Writes bench/results/heal_probe.json: for each fault, the time from the fault to the
peer's loss being named, to the new group, and to the survivors' next committed step; and whether
the survivors' parameters match a run that trained the same global batches on N-1 ranks from the
start of the interrupted step.

    python bench/heal_probe.py                       # 3 ranks, kill -9 and SIGSTOP
    python bench/heal_probe.py --world 4 --steps 12
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4: the survivors split the same global batch
CONFIRM_S = 0.3  # after a closed connection: a peer whose heartbeat (every 0.1 s) stopped this long is gone


class PeerLost(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Heartbeat:
    """Each rank sets ``hb/<rank>`` every ``every`` s through its own store client; the monitor
    names the ranks whose beat is older than ``timeout`` (a dead, frozen or cut-off process)."""

    def __init__(self, port: int, rank: int, members: list[int], timeout: float, every: float = 0.1):
        import torch.distributed as dist
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        self.rank, self.members, self.timeout, self.every = rank, list(members), timeout, every
        self.lost: list[int] = []
        self.generation = 0
        self.lost_at: float | None = None
        self.on_loss: list = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.store.set(f"hb/{self.rank}", f"{time.time():.3f}")
            key = f"lost/{self.generation}"
            named = self.store.get(key).decode() if self.store.check([key]) else ""
            stale = [int(r) for r in named.split(",")] if named else self.stale(self.timeout)
            if stale and not self.lost:
                self._name(stale)

    def stale(self, older_than: float) -> list[int]:
        now, stale = time.time(), []
        for r in self.members:
            if r == self.rank:
                continue
            try:
                beat = float(self.store.get(f"hb/{r}").decode()) if self.store.check([f"hb/{r}"]) else now
            except Exception:  # noqa: BLE001  (the store is the parent's: it outlives every rank)
                beat = now
            if now - beat > older_than:
                stale.append(r)
        return stale

    def _name(self, stale: list[int]) -> None:
        """Fail this rank's collectives, and tell the others: a survivor whose ring neighbour is
        alive waits on it without any error, and learns of the loss here within one beat."""
        self.lost, self.lost_at = stale, time.monotonic()
        self.store.compare_set(f"lost/{self.generation}", "", ",".join(map(str, stale)))
        for callback in self.on_loss:
            callback(stale)

    def confirm(self, older_than: float, within: float) -> list[int]:
        """After a collective failed with a closed connection (a process died: its heartbeat thread
        died with it), the peers whose beat stops for ``older_than`` s, waiting ``within`` s at most;
        a live peer beats on from its own thread, however busy its main thread is."""
        deadline = time.monotonic() + within
        while not self.lost and time.monotonic() < deadline:
            stale = self.stale(older_than)
            if stale and not self.lost:
                self._name(stale)
            time.sleep(0.02)
        return self.lost

    def reset(self, members: list[int]) -> None:
        self.members, self.lost, self.lost_at = list(members), [], None
        self.generation += 1

    def close(self) -> None:
        self._stop.set()


def breakable_allreduce(monitor: Heartbeat):
    """A DDP comm hook: the bucket's all-reduce, averaged, whose future the monitor fails when a
    peer is lost, so that backward raises instead of waiting in a collective that never ends."""
    import torch
    import torch.distributed as dist

    def hook(state, bucket):
        out = torch.futures.Future()
        buffer = bucket.buffer()
        world = dist.get_world_size()
        work = dist.all_reduce(buffer, async_op=True)

        def done(fut):
            if not out.done():
                try:
                    out.set_result(fut.value()[0] / world)
                except Exception as err:  # noqa: BLE001
                    out.set_exception(err)

        def lost(ranks):
            if not out.done():
                out.set_exception(PeerLost(f"peer(s) {ranks} lost"))

        monitor.on_loss[:] = [lost]
        if monitor.lost:
            lost(monitor.lost)
        work.get_future().then(done)
        return out

    return hook


def build(seed: int = 0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def batch(step: int):
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def worker(rank: int, world: int, port: int, steps: int, fault_step: int, peer_timeout: float, out_q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)

    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    members = list(range(world))
    gen = 0

    def join(gen: int, members: list[int]):
        store = dist.PrefixStore(f"gen{gen}/", base)
        # A collective waits at most 2 x the peer timeout: a backstop behind the heartbeat.
        dist.init_process_group("gloo", store=store, rank=members.index(rank), world_size=len(members),
                                timeout=datetime.timedelta(seconds=2 * peer_timeout + 5))

    join(gen, members)
    monitor = Heartbeat(port, rank, members, peer_timeout)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = DDP(model)
    ddp.register_comm_hook(None, breakable_allreduce(monitor))
    parked, events, step, before = [], {}, 0, None
    base.set(f"ready/{rank}", "1")
    while step < steps:
        x, y = batch(step)
        share = GLOBAL_BATCH // len(members)
        i = members.index(rank)
        xs, ys = x[i * share:(i + 1) * share], y[i * share:(i + 1) * share]
        try:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        except Exception as err:  # noqa: BLE001
            # A closed connection (kill -9) fails at once; the heartbeat names the peer (and a
            # frozen one's loss is what failed the hook's future). No peer named: a real error.
            if not monitor.confirm(CONFIRM_S, within=2 * peer_timeout):
                raise
            lost, t_named = monitor.lost, monitor.lost_at
            parked.append((ddp, dist.group.WORLD))  # never freed: its gloo threads may be blocked for good
            dist.destroy_process_group()
            members = [m for m in members if m not in lost]
            gen += 1
            # The last step every survivor finished: a peer's all-reduce may have completed on some
            # survivors and not on others (the ring broke mid-way); one that stepped undoes it.
            base.set(f"gen{gen}/done/{rank}", str(step))
            base.wait([f"gen{gen}/done/{m}" for m in members], datetime.timedelta(seconds=30))
            agreed = min(int(base.get(f"gen{gen}/done/{m}")) for m in members)
            undone = step - agreed
            if undone == 1 and before is not None and before[1] == agreed:
                with torch.no_grad():
                    for param, saved in zip(model.parameters(), before[0], strict=True):
                        param.copy_(saved)  # plain SGD without momentum: the parameters are the whole state
                step = agreed
            elif undone:
                raise RuntimeError(f"rank {rank} is {undone} steps past the survivors' last common step") from err
            join(gen, members)
            t_joined = time.monotonic()
            monitor.reset(members)
            ddp = DDP(model)
            ddp.register_comm_hook(None, breakable_allreduce(monitor))
            events = {"error": f"{type(err).__name__}: {str(err)[:120]}", "lost": lost, "redo_step": step,
                      "undone": undone,
                      "named_at": t_named, "joined_at": t_joined, "world": len(members)}
            continue  # redo the step at the new world size, the same global batch
        before = ([p.detach().clone() for p in model.parameters()], step)  # to undo a step a peer did not take
        opt.step()
        if events and "next_step_at" not in events:
            events["next_step_at"] = time.monotonic()
        step += 1
        if step == fault_step:
            base.set(f"at_fault/{rank}", f"{time.monotonic():.6f}")
        if events.get("next_step_at") is None:
            time.sleep(0.02)  # a step of about 20 ms: the fault lands mid-step
    monitor.close()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    out_q.put({"rank": rank, "events": events, "params": params.tolist(), "members": members})
    out_q.close()
    out_q.join_thread()  # the queue's feeder thread must flush before os._exit
    os._exit(0)  # not the interpreter's exit: it would free the parked group and join its blocked threads


def reference(steps: int) -> list[float]:
    """One process, the same global batches: whatever the world size, each step's gradient is the
    mean over the whole global batch (equal shares, averaged), so the survivors must end here."""
    import torch
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def trial(fault: str, world: int, steps: int, fault_step: int, peer_timeout: float) -> dict:
    import torch.distributed as dist
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, steps, fault_step, peer_timeout, q))
             for r in range(world)]
    for p in procs:
        p.start()
    victim = procs[-1]
    store.wait([f"at_fault/{world - 1}"], datetime.timedelta(seconds=120))
    time.sleep(0.011)  # into the next step's forward or backward
    t_fault = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL if fault == "kill9" else signal.SIGSTOP)
    results = []
    deadline = time.monotonic() + 120
    while len(results) < world - 1 and time.monotonic() < deadline:
        try:
            results.append(q.get(timeout=1))
        except Exception:  # noqa: BLE001  (queue.Empty)
            pass
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    print(f"{fault}: {len(results)} of {world - 1} survivors reported", file=sys.stderr, flush=True)
    if len(results) < world - 1:
        return {"fault": fault, "world": world, "survived": False, "note": f"{len(results)} survivors reported"}
    ev = [r["events"] for r in results]
    want = reference(steps)
    diff = max(max(abs(a - b) for a, b in zip(r["params"], want, strict=True)) for r in results)
    same = all(r["params"] == results[0]["params"] for r in results)
    return {"fault": fault, "world": world, "survivors": world - 1, "survived": True,
            "lost": ev[0]["lost"], "errors_seen": sorted({e["error"] for e in ev}),
            "redone_step": min(e["redo_step"] for e in ev), "steps_undone": [e["undone"] for e in ev],
            "fault_to_named_s": round(max(e["named_at"] for e in ev) - t_fault, 3),
            "fault_to_new_group_s": round(max(e["joined_at"] for e in ev) - t_fault, 3),
            "fault_to_next_step_s": round(max(e["next_step_at"] for e in ev) - t_fault, 3),
            "survivors_identical": same, "max_diff_vs_one_process": diff}


def abort_check(peer_timeout: float) -> dict:
    """Does ProcessGroupGloo.abort(), from another thread, end an all-reduce blocked on a frozen
    peer? Two processes; rank 1 stops itself before the collective."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_abort_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = q.get(timeout=60)
    except Exception:  # noqa: BLE001
        out = {"abort_ended_the_wait": False, "note": "no answer within 60 s"}
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    return out


def _abort_worker(rank: int, port: int, q) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    work = dist.all_reduce(torch.ones(4), async_op=True)
    threading.Timer(1.0, backend.abort).start()
    start = time.monotonic()
    ended = work.get_future()
    while not ended.done() and time.monotonic() - start < 10:
        time.sleep(0.05)
    q.put({"abort_ended_the_wait": ended.done(), "waited_s": round(time.monotonic() - start, 2),
           "torch": torch.__version__})
    q.close()
    q.join_thread()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=3, choices=(3, 4))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fault-step", type=int, default=4)
    parser.add_argument("--peer-timeout", type=float, default=2.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "heal_probe.json"))
    args = parser.parse_args()
    rows = [trial(f, args.world, args.steps, args.fault_step, args.peer_timeout) for f in ("kill9", "sigstop")]
    result = {"torch": __import__("torch").__version__, "peer_timeout_s": args.peer_timeout,
              "trials": rows, "abort": abort_check(args.peer_timeout)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
