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
    from framework.ddp.collectives import PARKED, Breaker, PeerLostError

    def pair(name, timeout_s=30.0):
        store, groups = dist.HashStore(), [None, None]
        def make(rank):
            groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, 2,
                                                 datetime.timedelta(seconds=timeout_s))
        threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
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
    out["frozen"] = outcome(lambda: breaker.wait(g[0].allreduce([torch.ones(3)]), "the step's agreement"))
    out["parked"] = len(PARKED)
    out["already_lost"] = outcome(lambda: breaker.wait(g[0].allreduce([torch.ones(3)])))

    g, breaker = pair("hook/"), Breaker()
    fut = breaker.future(g[0].allreduce([torch.ones(3)]).get_future())
    threading.Timer(0.5, breaker.name, args=([1],)).start()
    out["hook_frozen"] = outcome(lambda: fut.wait())

    g, breaker = pair("hook_ok/"), Breaker()
    c, d = torch.ones(2), torch.ones(2)
    fut = breaker.future(g[0].allreduce([c]).get_future())
    g[1].allreduce([d]).wait()
    out["hook_ok"] = outcome(lambda: [t.tolist() for t in fut.wait()])
    breaker.name([1])  # after completion: changes nothing
    out["hook_ok_after"] = outcome(lambda: [t.tolist() for t in fut.wait()])

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
    assert seen["parked"] >= 1  # the broken work is kept, never freed


def test_a_wait_after_a_peer_was_named_ends_at_once(seen):
    assert seen["already_lost"]["error"] == "PeerLostError" and seen["already_lost"]["s"] < 0.5


def test_a_comm_hooks_future_fails_when_the_peer_is_named_and_completes_otherwise(seen):
    assert seen["hook_frozen"]["error"] == "PeerLostError" and 0.4 < seen["hook_frozen"]["s"] < 3.0
    assert seen["hook_ok"]["ok"] == [[2.0, 2.0]] and seen["hook_ok_after"]["ok"] == [[2.0, 2.0]]


def test_the_collectives_own_error_is_not_taken_for_a_lost_peer(seen):
    own = seen["own_error"]
    assert own["error"] == "RuntimeError" and "Timed out" in own["message"] and own["s"] < 10  # gloo's 1 s
