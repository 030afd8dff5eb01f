"""framework/ddp/collectives.py: a collective blocked on a silent peer ends as soon as the peer is
named lost, and only then. Two gloo groups of one process, one per thread, stand for two ranks;
a rank that never joins the collective stands for a frozen one. They run in a child process that
ends with os._exit: a group whose collective was given up cannot be freed (its gloo thread waits
for good), and pytest's own exit would free it."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow  # a child process, and waits of seconds

SCENARIOS = textwrap.dedent("""
    import datetime, json, os, threading, time
    import torch, torch.distributed as dist
    from framework.ddp.collectives import PARKED, Breaker

    def pair(name, timeout_s=30.0, size=2):
        store, groups = dist.HashStore(), [None] * size
        def make(rank):  # a ProcessGroup over gloo, as init_process_group makes one (DDP takes only that)
            prefixed = dist.PrefixStore(name, store)
            gloo = dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=timeout_s))
            group = dist.ProcessGroup(prefixed, rank, size)
            group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
            groups[rank] = group
        threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
        [t.start() for t in threads]; [t.join() for t in threads]
        return groups

    def outcome(call):
        start = time.monotonic()
        try:
            value = call()
            return {"ok": value, "s": time.monotonic() - start}
        except Exception as err:
            return {"error": type(err).__name__, "message": str(err)[:200], "s": time.monotonic() - start}

    out = {}
    g = pair("both/")
    a, b, breaker = torch.ones(3), torch.ones(3), Breaker()
    peer = threading.Thread(target=lambda: g[1].allreduce([b]).wait()); peer.start()
    out["both"] = outcome(lambda: (breaker.wait(g[0].allreduce([a])), a.tolist())[1])
    peer.join()

    g, breaker = pair("frozen/"), Breaker()
    threading.Timer(0.5, breaker.name, args=([1],)).start()
    out["frozen"] = outcome(lambda: breaker.wait(g[0].allreduce([torch.ones(3)]), "the step's agreement",
                                                 group=g[0]))
    out["parked_with_its_group"] = any(p is g[0] for p in PARKED)
    out["stale_verdict"] = outcome(lambda: (breaker.reset(1), breaker.name([0], generation=0), breaker.lost())[2])
    breaker.name([1])
    out["already_lost"] = outcome(lambda: breaker.wait(g[0].allreduce([torch.ones(3)])))

    def tensor_future(work):  # what a comm hook's inner future holds: the bucket's tensor
        return work.get_future().then(lambda f: f.value()[0])

    g, breaker = pair("hook/"), Breaker()
    fut = breaker.future(tensor_future(g[0].allreduce([torch.ones(3)])))
    threading.Timer(0.5, breaker.name, args=([1],)).start()
    out["hook_frozen"] = outcome(lambda: fut.wait())

    g, breaker = pair("hook_ok/"), Breaker()
    c, d = torch.ones(2), torch.ones(2)
    fut = breaker.future(tensor_future(g[0].allreduce([c])))
    g[1].allreduce([d]).wait()
    out["hook_ok"] = outcome(lambda: fut.wait().tolist())
    breaker.name([1])  # after completion: changes nothing
    out["hook_ok_after"] = outcome(lambda: fut.wait().tolist())

    # DDP itself, each rank a thread with its group: rank 1 takes no step (frozen), rank 0's
    # backward must end once rank 1 is named lost, with an error its caller can tell.
    g, breaker = pair("ddp/"), Breaker()
    from torch.nn.parallel import DistributedDataParallel as DDP
    models = [None, None]
    def wrap(rank):
        torch.manual_seed(0)
        models[rank] = DDP(torch.nn.Linear(4, 1), process_group=g[rank])
    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(2)]
    [t.start() for t in threads]; [t.join() for t in threads]
    def hook(state, bucket):
        return breaker.future(tensor_future(g[0].allreduce([bucket.buffer()])), group=g[0])
    models[0].register_comm_hook(None, hook)
    threading.Timer(0.5, breaker.name, args=([1],)).start()
    out["ddp_backward"] = outcome(lambda: models[0](torch.ones(2, 4)).sum().backward())
    out["ddp_lost"] = breaker.lost()

    # The hook DDP gets when healing in place, against DDP's built-in all-reduce on 3 ranks (a world
    # size whose 1/W is inexact): the same gradients, bit for bit.
    from framework.ddp.comm_hooks import allreduce_hook, breakable
    builtin, hooked = pair("builtin/", size=3), pair("hooked/", size=3)
    grads = [None] * 3
    def train(rank):
        got = []
        for groups, hook in ((builtin, None), (hooked, breakable(allreduce_hook))):
            net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
            init = torch.Generator().manual_seed(0)  # the threads share torch's global generator
            with torch.no_grad():
                for param in net.parameters():
                    param.copy_(torch.randn(param.shape, generator=init))
            model = DDP(net, process_group=groups[rank])
            if hook is not None:
                model.register_comm_hook(groups[rank], hook)
            model(torch.randn(5, 16, generator=torch.Generator().manual_seed(rank + 1))).pow(2).sum().backward()
            got.append([p.grad.clone() for p in model.parameters()])
        grads[rank] = got
    threads = [threading.Thread(target=train, args=(r,)) for r in range(3)]
    [t.start() for t in threads]; [t.join() for t in threads]
    out["hook_vs_builtin"] = [[bool(torch.equal(a, b)) for a, b in zip(*grads[r])] for r in range(3)]
    out["hook_vs_builtin_max"] = max((a - b).abs().max().item() for r in range(3) for a, b in zip(*grads[r]))

    g, breaker = pair("own/", timeout_s=1.0), Breaker()
    out["own_error"] = outcome(lambda: breaker.wait(g[0].allreduce([torch.ones(3)])))
    print(json.dumps(out), flush=True)
    os._exit(0)
""")


@pytest.fixture(scope="module")
def seen():
    proc = subprocess.run([sys.executable, "-c", SCENARIOS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_collective_every_rank_joins_completes_as_usual(seen):
    assert seen["both"]["ok"] == [2.0, 2.0, 2.0]


def test_a_collective_blocked_on_a_silent_peer_ends_when_the_peer_is_named(seen):
    frozen = seen["frozen"]
    assert frozen["error"] == "PeerLostError"
    assert "the step's agreement given up: peer rank(s) [1] lost" in frozen["message"]
    assert 0.4 < frozen["s"] < 3.0  # named after 0.5 s; the group's own timeout is 30 s
    assert seen["parked_with_its_group"]  # the broken work is kept with its group, never freed


def test_a_verdict_about_an_older_generation_is_ignored(seen):
    assert seen["stale_verdict"]["ok"] == []


def test_a_wait_after_a_peer_was_named_ends_at_once(seen):
    assert seen["already_lost"]["error"] == "PeerLostError" and seen["already_lost"]["s"] < 0.5


def test_a_comm_hooks_future_fails_when_the_peer_is_named_and_completes_otherwise(seen):
    frozen = seen["hook_frozen"]  # a real failure of the future (what DDP's reducer reads), naming the loss
    assert frozen["error"] == "RuntimeError" and "peer rank(s) [1] lost" in frozen["message"]
    assert 0.4 < frozen["s"] < 3.0
    assert seen["hook_ok"]["ok"] == [2.0, 2.0] and seen["hook_ok_after"]["ok"] == [2.0, 2.0]


def test_ddps_backward_ends_when_a_peer_is_named_and_says_why(seen):
    backward = seen["ddp_backward"]
    assert backward["error"] == "RuntimeError" and "peer rank(s) [1] lost" in backward["message"]
    assert 0.4 < backward["s"] < 3.0 and seen["ddp_lost"] == [1]


def test_the_collectives_own_error_is_not_taken_for_a_lost_peer(seen):
    own = seen["own_error"]
    assert own["error"] == "RuntimeError" and "Timed out" in own["message"] and own["s"] < 10  # gloo's 1 s


def test_the_hook_healing_in_place_gives_ddps_own_gradients_bit_for_bit(seen):
    """comm_hooks.allreduce_hook (made breakable) on 3 ranks, whose 1/3 is inexact: DDP's reducer
    multiplies by 1/W, torch's default hook divides by W (1 ulp apart on 12,902 of 33,088 entries)."""
    assert seen["hook_vs_builtin"] == [[True] * 4] * 3, seen["hook_vs_builtin_max"]
