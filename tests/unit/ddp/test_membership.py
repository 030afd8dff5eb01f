"""framework/ddp/membership.py: generations agreed through the store, and the group re-formed in
the same processes: three replicas, one leaves (its process ends), the two survivors go on as
generation 2 without a restart, and the replica's new process joins them as generation 3."""

import contextlib
import datetime
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from framework.ddp.membership import Generation, Membership, process_start, process_state

ROOT = Path(__file__).resolve().parents[3]


def test_the_first_proposal_of_a_generation_is_everyones():
    store = dist.HashStore()
    a, b = Membership(store, 0), Membership(store, 1)
    assert a.newest() is None
    assert a.propose(1, [0, 1, 2]) == Generation(1, (0, 1, 2))
    seen = []
    threads = [threading.Thread(target=lambda m=m, p=p: seen.append(m.propose(2, p)))
               for m, p in ((a, [0, 1]), (b, [1, 2]))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert seen[0] == seen[1] and seen[0].members in ((0, 1), (1, 2))
    assert b.newest() == seen[0] and b.newest(after=2) == seen[0]
    assert seen[0].rank(1) in (0, 1) and Generation(2, (0, 1)).rank(2) is None


REPLICA = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    from framework.ddp.membership import Membership
    replica, port, plan = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=60))
    m = Membership(client, replica, timeout_s=60)
    pid = os.getpid()

    def total(gen):
        m.form(gen, "gloo", 30)
        t = torch.tensor([float(replica + 1)])
        dist.all_reduce(t)
        return {"generation": gen.number, "members": list(gen.members), "rank": dist.get_rank(),
                "sum": t.item(), "pid": pid}

    out = []
    if plan == "newcomer":
        client.set(f"join/{replica}", "1")
        out.append(total(m.wait_for(3)))
    else:
        out.append(total(m.propose(1, [0, 1, 2])))
        if plan == "leaves":
            print(json.dumps(out), flush=True)
            os._exit(0)
        survivors = [r for r in (0, 1, 2) if r != 2]  # the peer monitor would name replica 2
        out.append(total(m.propose(2, survivors)))
        client.wait(["join/2"])  # rank 0 would see this at a step boundary, and tell the others
        out.append(total(m.propose(3, survivors + [2])))
    print(json.dumps(out), flush=True)
    os._exit(0)
""")


@pytest.mark.slow
def test_survivors_go_on_in_their_processes_and_a_newcomer_joins_them():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def start(replica, plan):
        return subprocess.Popen([sys.executable, "-c", REPLICA, str(replica), str(store.port), plan], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [start(0, "stays"), start(1, "stays"), start(2, "leaves")]
    leaver_out, leaver_err = procs[2].communicate(timeout=120)
    assert procs[2].returncode == 0, leaver_err[-2000:]
    newcomer = start(2, "newcomer")
    outs = []
    for proc in (procs[0], procs[1], newcomer):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    first = json.loads(leaver_out.strip().splitlines()[-1])[0]
    zero, one, new = outs
    assert first["sum"] == zero[0]["sum"] == 6.0  # replicas 0, 1, 2 add 1 + 2 + 3
    assert [g["sum"] for g in zero] == [6.0, 3.0, 6.0] and [g["sum"] for g in one] == [6.0, 3.0, 6.0]
    assert [g["generation"] for g in zero] == [1, 2, 3] and zero[1]["members"] == [0, 1]
    assert len({g["pid"] for g in zero}) == 1 and len({g["pid"] for g in one}) == 1  # the same processes
    assert new == [{"generation": 3, "members": [0, 1, 2], "rank": 2, "sum": 6.0, "pid": new[0]["pid"]}]
    assert new[0]["pid"] != first["pid"]


def test_a_stale_generation_is_not_formed_and_an_empty_one_not_proposed():
    store = dist.HashStore()
    m = Membership(store, 0)
    first = m.propose(1, [0, 1])
    m.propose(2, [0])
    with pytest.raises(ValueError, match="generation 1 is stale: generation 2 was proposed"):
        m.form(first, "gloo", 5)
    with pytest.raises(ValueError, match="generation 3: no members"):
        m.propose(3, [])
    assert m.newest(after=7) == Generation(2, (0,))  # a number never proposed: scanned from the start


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid

def test_after_a_loss_the_survivors_agree_at_once_when_the_lost_process_is_known_dead():
    """Replica 2's process on this host is dead (a pid that exited): replicas 0 and 1 need not wait
    for it (they are given an hour); each says it is alive, and the first to see every other member
    alive or dead proposes them. A member on another host that says nothing is waited for, up to
    wait_s, then left out."""
    import os
    import socket

    store = dist.HashStore()
    first = [Membership(store, r) for r in range(3)]
    for m in first:
        m.start(3)
    first[0].store.set("where/2", f"{socket.gethostname()} {dead_pid()}")
    assert first[2].gone(2) and not first[0].gone(1)  # replica 1 is this process: alive
    gen1 = first[0].newest()
    seen = []
    threads = [threading.Thread(target=lambda m=m: seen.append(m.after_loss(gen1, wait_s=3600)), daemon=True)
               for m in first[:2]]
    [t.start() for t in threads]
    [t.join(60) for t in threads]  # a guard against a hang, not a timing: waiting for the dead is an hour
    assert seen == [Generation(2, (0, 1))] * 2

    first[0].store.set("where/1", f"elsewhere-{os.getpid()} 1")  # on another host, silent
    assert first[0].after_loss(seen[0], wait_s=0.5) == Generation(3, (0,))



def test_a_replica_started_again_forms_only_a_first_or_restart_generation_and_joins_any_other():
    """Listed in an unformed generation 1 (it died before forming it), a replica forms it as its
    members do; listed in an unformed heal or grow generation, it joins (its members are past their
    start); a replica started after everyone of the newest generation died forms the next one with
    the others that asked: a restart, counted the same for all."""
    import socket

    store = dist.HashStore()
    a, b = Membership(store, 0), Membership(store, 1)
    assert a.start(2) == (Generation(1, (0, 1)), False)
    assert b.start(2) == (Generation(1, (0, 1)), False)  # listed, never formed: it forms it
    for m in (a, b):
        m.store.set(f"formed/1/{m.replica}", f"{socket.gethostname()} {dead_pid()}")
    a.propose(2, [0, 1])  # a heal's generation, formed by nobody yet
    assert Membership(store, 1).start(2) == (None, True)  # it joins
    again = [Membership(store, r) for r in (0, 1)]
    for m in again:
        m.replicas = m.size = 2
    for m in (a, b):
        m.store.set(f"formed/2/{m.replica}", f"{socket.gethostname()} {dead_pid()}")
    seen = []
    threads = [threading.Thread(target=lambda m=m: seen.append(m.join(30))) for m in again]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert seen == [(Generation(3, (0, 1)), True)] * 2 and again[0].restarts(3) == again[1].restarts(3) == 1


def test_rank_0_grows_only_with_joiners_that_live_and_proposes_even_with_none():
    import os
    import socket

    store = dist.HashStore()
    rank0, other = Membership(store, 0), Membership(store, 1)
    gen = rank0.start(3)[0]
    rank0.store.set("join/2", "1")
    rank0.store.set("where/2", f"{socket.gethostname()} {dead_pid()}")
    assert rank0.joiners(Generation(1, (0, 1))) == []  # its process is dead: not taken in
    rank0.store.set("where/2", f"{socket.gethostname()} {os.getpid()}")
    assert rank0.joiners(Generation(1, (0, 1))) == [2]
    assert rank0.grow(Generation(4, (0, 1)), []) == Generation(5, (0, 1))  # the joiner left: the same members
    assert other.grow(Generation(4, (0, 1)), None) == Generation(5, (0, 1))
    assert gen.number == 1


def test_a_spare_waits_while_the_group_is_whole_and_steps_in_for_a_lost_member():
    import socket

    store = dist.HashStore()
    members = [Membership(store, r) for r in range(3)]
    assert members[0].start(3, spares=1) == (Generation(1, (0, 1)), False)
    assert members[2].start(3, spares=1) == (None, True)  # a spare: it joins
    members[2].store.set("join/2", "1")
    assert members[0].wanted(Generation(1, (0, 1))) == []  # whole: the spare waits
    members[1].store.set("formed/1/1", f"{socket.gethostname()} {dead_pid()}")
    assert members[0].after_loss(Generation(1, (0, 1)), wait_s=30) == Generation(2, (0, 2))
    assert not members[0].store.check(["join/2"])


def test_a_spare_outwaits_its_timeout_while_the_group_is_whole_and_a_refused_restart_raises():
    import os
    import socket

    import pytest

    from framework.ddp.membership import RunFinished

    store = dist.HashStore()
    rank0, spare = Membership(store, 0), Membership(store, 2)
    rank0.start(3, spares=1)
    spare.start(3, spares=1)
    rank0.store.set("formed/1/0", f"{socket.gethostname()} {os.getpid()}")  # the members live
    rank0.store.set("formed/1/1", f"{socket.gethostname()} {os.getpid()}")
    ended = []

    def wait():
        try:
            spare.join(timeout_s=0.2)
        except BaseException as err:  # noqa: BLE001
            ended.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive() and not ended  # 5 timeouts passed: a spare of a whole group waits on
    rank0.finish(40)
    thread.join(5)
    assert isinstance(ended[0], RunFinished) and "finished at step 40" in str(ended[0])

    store = dist.HashStore()
    first, again = Membership(store, 0), Membership(store, 0)
    first.start(1)
    first.store.set("formed/1/0", f"{socket.gethostname()} {dead_pid()}")
    again.start(1)

    def fatal():
        raise RuntimeError("FATAL: an earlier restart failed")

    with pytest.raises(RuntimeError, match="FATAL"):
        again.join(timeout_s=30, before_restart=fatal)


def test_a_generation_proposed_the_moment_a_replica_asks_takes_it_in():
    """The proposal that reads a replica's ``join`` key may land before the replica's own first
    read of the newest generation: that generation is the replica's to form (CI once saw one of
    two replicas started again left out of the restart that listed it, and time out)."""
    import socket

    store = dist.HashStore()
    a, b = Membership(store, 0), Membership(store, 1)
    a.start(2), b.start(2)
    for m in (a, b):
        m.store.set(f"formed/1/{m.replica}", f"{socket.gethostname()} {dead_pid()}")
    again = Membership(store, 1)
    prefixed = again.store

    class ProposingStore:  # the other replica proposes as soon as it sees the key
        def __getattr__(self, name):
            return getattr(prefixed, name)

        def set(self, key, value):
            prefixed.set(key, value)
            if key == "join/1":
                a.propose(2, [0, 1])

    again.store = ProposingStore()
    again.replicas = again.size = 2
    assert again.join(5) == (Generation(2, (0, 1)), False)


def started(replicas: int) -> list[Membership]:
    """``replicas`` members of one run on an in-memory store, each past its start."""
    store = dist.HashStore()
    members = [Membership(store, r) for r in range(replicas)]
    for m in members:
        m.start(replicas)
    return members


@contextlib.contextmanager
def stopped_process():
    """A process stopped with SIGSTOP (once the kernel shows it stopped), killed at the end."""
    import signal

    frozen = subprocess.Popen(["sleep", "60"])
    try:
        frozen.send_signal(signal.SIGSTOP)
        while process_state(frozen.pid) != "T":  # the signal is delivered asynchronously
            time.sleep(0.01)
        yield frozen
    finally:
        frozen.kill()
        frozen.wait()


def test_a_silent_member_is_killed_only_on_this_host(monkeypatch):
    """stop_silent_peer (the peer monitor's on_silent when healing in place): a member on this host
    is killed, so that the collective waiting for it fails and the group heals; one on another host
    (or this process itself) is left, and the monitor's loss ends the group instead."""
    import os
    import signal
    import socket

    from framework.ddp import process_group

    members = started(3)
    with stopped_process() as frozen:
        members[0].store.set("formed/1/1", f"{socket.gethostname()} {frozen.pid}")
        members[0].store.set("formed/1/2", f"elsewhere-{socket.gethostname()} {frozen.pid}")
        members[0].store.set("formed/1/0", f"{socket.gethostname()} {os.getpid()}")
        monkeypatch.setattr(process_group, "MEMBERSHIP", members[0])
        monkeypatch.setattr(process_group, "GENERATION", Generation(1, (0, 1, 2)))
        assert not process_group.stop_silent_peer(2) and frozen.poll() is None  # another host's
        assert not process_group.stop_silent_peer(0)  # this process
        assert process_group.stop_silent_peer(1)
        assert frozen.wait(10) == -signal.SIGKILL


def test_a_stopped_member_counts_as_gone_and_is_killed_so_that_its_job_ends():
    """A member stopped for good (SIGSTOP) takes part in nothing, and neither its torchrun (which
    waits for it) nor the launcher (which waits for every rank's job) would ever end: found stopped
    by the others' membership, it is killed, so that its torchrun starts it again, or ends
    (an explorer trial of a stopped worker under --heal with the peer monitor off hung until its bound)."""
    import signal
    import socket

    members = started(2)
    with stopped_process() as frozen:
        # its pid recorded with another start time: another process since (the pid reused), gone
        # for the run, and not killed
        members[0].store.set("where/1", f"{socket.gethostname()} {frozen.pid} {process_start(frozen.pid) + 1}")
        assert members[0].gone(1) and frozen.poll() is None
        members[0].store.set("where/1", f"{socket.gethostname()} {frozen.pid} {process_start(frozen.pid)}")
        assert members[0].gone(1)
        assert frozen.wait(10) == -signal.SIGKILL
    with stopped_process() as frozen:  # it formed generation 1, and its replica has started again since:
        gen1 = members[0].newest()      # on this host its pid tells, and it is still killed
        members[0].store.set("formed/1/1", f"{socket.gethostname()} {frozen.pid} {process_start(frozen.pid)}")
        members[0].store.set("where/1", f"{socket.gethostname()} {frozen.pid + 1} 1")
        assert members[0].gone(1, gen1)
        assert frozen.wait(10) == -signal.SIGKILL


def replica_1_elsewhere():
    """Two replicas past their start on an in-memory store, and generation 1, which replica 1
    formed on another host with its newest process: (store, members, generation 1)."""
    import os

    store = dist.HashStore()
    members = [Membership(store, r) for r in range(2)]
    for m in members:
        m.start(2)
    for key in ("formed/1/1", "where/1"):
        members[0].store.set(key, f"elsewhere-{os.getpid()} 1")
    return store, members, members[0].newest()


def test_a_member_on_another_host_is_gone_once_its_heartbeat_stood_still():
    """No pid can be read on another host: there a member is known gone once its peer monitor's
    heartbeat (framework/resilience/peers.py) has stood still for REMOTE_SILENT_S, as seen from
    here. A member that never beat (the monitor off), or that stopped beating on purpose (-1: its
    training ended, or it heals), is not; one that beats again is not."""

    from framework.ddp import membership as module

    store, members, gen1 = replica_1_elsewhere()
    beats = dist.PrefixStore(f"{module.HEARTBEATS}heal1/", store)
    assert not members[0].gone(1, gen1, silent_s=0.3)  # no beat yet
    for beat in ("-1", "0"):
        beats.set("alive/1", beat)
        assert not members[0].gone(1, gen1, silent_s=0.3)
        time.sleep(0.4)
        assert not members[0].gone(1, gen1, silent_s=0.3)
    beats.set("alive/1", "7")
    assert not members[0].gone(1, gen1, silent_s=0.3)  # first seen now
    time.sleep(0.4)
    beats.add("alive/1", 1)  # it beat again: alive
    assert not members[0].gone(1, gen1, silent_s=0.3)
    time.sleep(0.4)
    assert members[0].gone(1, gen1, silent_s=0.3)  # 0.4 s without a beat
    assert not members[0].gone(1, gen1) and module.REMOTE_SILENT_S == 10  # by default: 10 s
    assert not members[0].gone(1)  # without a generation: no heartbeat to read, waited for


def test_after_a_loss_two_silent_members_on_another_host_are_looked_at_together():
    """Both processes of a lost node on another host: each one's heartbeat is watched from the
    first round, so the survivor proposes itself once both have stood still for silent_s, not
    after twice that (all()'s short cut looked at the second only once the first was gone: 6.3 s
    instead of 3 s on 2 nodes of 2, bench-free: the order of the looks tells it)."""
    import os

    from framework.ddp import membership as module

    store = dist.HashStore()
    members = [Membership(store, r) for r in range(3)]
    for m in members:
        m.start(3)
    gen1 = members[0].newest()
    beats = dist.PrefixStore(f"{module.HEARTBEATS}heal1/", store)
    for replica in (1, 2):
        for key in (f"formed/1/{replica}", f"where/{replica}"):
            members[0].store.set(key, f"elsewhere-{os.getpid()} {replica}")
        beats.set(f"alive/{replica}", "5")
    looks = []  # (replica, found silent), in the order the survivor looked
    look = members[0].silent
    members[0].silent = lambda replica, *a: looks.append((replica, look(replica, *a))) or looks[-1][1]
    assert members[0].after_loss(gen1, wait_s=60, silent_s=0.3) == Generation(2, (0,))
    # replica 2's heartbeat was first read in the first round, not once replica 1 was found silent
    assert looks[:2] == [(1, False), (2, False)], looks[:4]


def test_a_member_whose_replica_started_again_is_gone_wherever_it_ran():
    """A replica whose torchrun started a newer process (``where/``) after it formed a generation:
    that generation's process ended, on this host or another, heartbeat or none (the peer monitor
    off). Two replicas restarted together on two hosts, with no heartbeat to read, each waited for
    the other's old process until the join timed out (the explorer's unreadable_newest@eval, 2x1,
    peer_timeout=0: a hang)."""
    import os

    store = dist.HashStore()
    members = [Membership(store, r) for r in range(2)]
    for m in members:
        m.start(2)
    gen1 = members[0].newest()
    for key in ("formed/1/1", "where/1"):
        members[0].store.set(key, f"elsewhere-{os.getpid()} 1")
    assert not members[0].gone(1, gen1)  # on another host, no heartbeat: waited for
    members[0].store.set("where/1", f"elsewhere-{os.getpid() + 1} 1")  # its torchrun started it again
    assert members[0].gone(1, gen1)
    assert not members[0].gone(1)  # the newest process itself: not gone
    # both replicas restarted on two hosts: each takes the other's old process for gone, and they restart
    again = [Membership(store, r) for r in range(2)]
    for m, host in zip(again, ("here", "elsewhere"), strict=True):
        m.replicas = m.size = 2
        m.store.set(f"formed/1/{m.replica}", f"{host}-old {os.getpid()} 1")
        m.store.set(f"where/{m.replica}", f"{host}-new {os.getpid()} 2")
    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, again[i].join(10))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results == [(Generation(2, (0, 1)), True)] * 2, results


def test_a_member_on_another_host_whose_process_ended_is_gone():
    """A member on another host that ended on purpose (its training finished: its heartbeat says -1,
    and no torchrun starts it again) says so (``ended/<replica>``, at its exit): a replica restarted
    after it (rank 0 killed during the export, on 2 hosts) takes it for gone and forms the next
    generation alone, from the checkpoint. Before, it waited for that process until its join timed
    out (ddp.timeout_s)."""
    import os

    from framework.ddp import membership as module

    store, members, gen1 = replica_1_elsewhere()
    dist.PrefixStore(f"{module.HEARTBEATS}heal1/", store).set("alive/1", "-1")  # its training ended
    assert not members[0].gone(1, gen1)
    members[0].store.set("ended/1", f"elsewhere-{os.getpid()} 2")  # another process of it ended: not this one
    assert not members[0].gone(1, gen1)
    with pytest.MonkeyPatch.context() as patch:  # it ends, as its interpreter exits
        patch.setattr(module, "where_this_runs", lambda: f"elsewhere-{os.getpid()} 1")
        members[1].end()
    assert members[0].gone(1, gen1) and members[0].gone(1)
    again = Membership(store, 0)  # replica 0's torchrun started it again
    with pytest.MonkeyPatch.context() as patch:  # a process that sets up again takes its replica back
        patch.setattr(module, "where_this_runs", lambda: f"elsewhere-{os.getpid()} 1")
        Membership(store, 1).start(2)
    assert not members[0].gone(1) and not members[0].store.check(["ended/1"])
    members[1].store.set("ended/1", f"elsewhere-{os.getpid()} 1")
    again.replicas = again.size = 2
    assert again.join(10) == (Generation(2, (0,)), True)


def test_a_member_on_another_host_is_gone_once_its_own_count_stood_still_whatever_it_did(monkeypatch):
    """Each process counts ``live/<replica>`` from its start to its end (``beat``), the peer
    monitor on or off: a member on another host that never beat in training (killed between its
    group's formation and its first step, or the monitor off) is known gone once that count has
    stood still for REMOTE_SILENT_S. A replica started again on this host after it (no restart left
    there) restarts from the checkpoint alone. Before, it waited for the member until its join
    timed out (audit item 2 of issue 31)."""
    from framework.ddp import membership as module

    import os

    monkeypatch.setattr(module, "REMOTE_SILENT_S", 0.3)
    store, members, gen1 = replica_1_elsewhere()
    monkeypatch.setattr(module, "where_this_runs", lambda: f"elsewhere-{os.getpid()} 1")  # its process's count
    members[1].beat(period_s=0.05)
    assert not members[0].gone(1, gen1)  # first seen now
    time.sleep(0.5)
    assert not members[0].gone(1, gen1) and not members[0].gone(1)  # it counts on: alive, whatever it does
    members[1]._beating.set()  # killed -9: its count stops, and no ``ended/`` record says so
    time.sleep(0.1)
    assert not members[0].gone(1, gen1)  # the count's last value, first seen now
    time.sleep(0.4)
    assert members[0].gone(1, gen1) and members[0].gone(1)
    # replica 0's torchrun started it again: it finds generation 1's other member gone, and restarts
    again = Membership(store, 0, timeout_s=30)
    again.replicas = again.size = 2
    assert again.join(8) == (Generation(2, (0,)), True)  # before: TimeoutError, waited for until then
    # a process that ends stops counting, and says so at once
    key = f"live/1/elsewhere-{os.getpid()}/1/None"
    beating = Membership(store, 1)
    beating.beat(period_s=0.05)
    time.sleep(0.2)
    beating.end()
    count = int(beating.store.get(key))
    time.sleep(0.2)
    assert int(beating.store.get(key)) == count
    # each process counts under its own key: an old process of the replica that runs on (a node
    # launched again while it was frozen) does not keep the newer one looking alive
    monkeypatch.setattr(module, "where_this_runs", lambda: f"elsewhere-{os.getpid()} 2")
    newer = Membership(store, 1)
    newer.beat(period_s=0.05)
    members[0].store.set("where/1", f"elsewhere-{os.getpid()} 2")
    newer._beating.set()  # the newer process killed; the old one still counts
    old = Membership(store, 1)
    monkeypatch.setattr(module, "where_this_runs", lambda: f"elsewhere-{os.getpid()} 1")
    old.beat(period_s=0.05)
    assert not members[0].gone(1)
    time.sleep(0.5)
    assert members[0].gone(1)
    old._beating.set()
    # a beat that fails (its client broken) logs once, and connects again
    clients = []

    def connect():
        clients.append(1)
        if len(clients) == 1:
            raise RuntimeError("connection reset")
        return store

    again = Membership(store, 1)
    again.beat(connect, period_s=0.05)
    time.sleep(0.3)
    again._beating.set()
    assert len(clients) == 2 and int(again.store.get(key)) > count


def test_replicas_that_ask_to_join_after_a_generation_that_never_formed_restart_without_it():
    """Generation 2 was agreed and never formed (a member died during the formation: the others'
    init timed out, and they exited). Every replica's torchrun starts it again, and each asks to
    join; a member of generation 2 that never formed it and now asks to join, having seen it, is
    no longer its member: once all are, they restart from the checkpoint as generation 3. Before,
    each took the others' new processes, alive and asking, for generation 2's members and waited
    for them until the join timed out (ddp.timeout_s), restart after restart."""
    import os
    import socket

    store = dist.HashStore()
    members = started(2)
    store = members[0].store.underlying_store
    here = f"{socket.gethostname()} {os.getpid()} {process_start(os.getpid())}"  # alive: this process
    for r in range(2):
        members[0].store.set(f"formed/1/{r}", here)
    assert members[0].propose(2, [0, 1]) == Generation(2, (0, 1))  # agreed, never formed
    again = [Membership(store, r) for r in range(2)]
    for m in again:
        m.replicas = m.size = 2
        m.store.set(f"where/{m.replica}", here)
    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, again[i].join(8))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results == [(Generation(3, (0, 1)), True)] * 2, results
    # One that asked having seen generation 2, and that generation 3 takes in, is about to form it:
    # gone for generation 2, not for 3.
    again[1].store.set("join/1", f"{os.getpid()} 2")
    assert again[0].gone(1, Generation(2, (0, 1))) and not again[0].gone(1, Generation(3, (0, 1)))


def test_a_member_waiting_for_a_grow_that_rank_0_died_before_proposing_ends_in_seconds():
    """Every rank agreed to grow at a step's end, and rank 0 (which proposes the next generation)
    died before it proposed: the others, waiting for the proposal, find it gone and raise
    ProposerLost (the trainer ends the restart with 75, and the run restarts through its store).
    Before, they waited for ddp.timeout_s (an hour here). Once proposed, the proposal is read."""
    import socket

    from framework.ddp.membership import ProposerLost

    store = dist.HashStore()
    members = [Membership(store, r, timeout_s=3600) for r in range(2)]
    for m in members:
        m.start(2)
    gen1 = members[0].newest()
    members[0].store.set("formed/1/0", f"{socket.gethostname()} {dead_pid()}")
    started_at = time.monotonic()
    with pytest.raises(ProposerLost, match="rank 0 .*replica 0.* is gone"):
        members[1].grow(gen1, None)
    assert time.monotonic() - started_at < 10
    members[0].propose(2, [0, 1])
    assert members[1].grow(gen1, None) == Generation(2, (0, 1))
    # On another host: rank 0 proposes while it still beats (DDPTrainer._grow), so a rank 0 that
    # died before its proposal is found by its heartbeat's silence.
    import os

    from framework.ddp import membership as module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "REMOTE_SILENT_S", 0.3)
        gen2 = members[1].newest()
        members[0].store.set("formed/2/0", f"elsewhere-{os.getpid()} 1")
        members[0].store.set("where/0", f"elsewhere-{os.getpid()} 1")
        dist.PrefixStore(f"{module.HEARTBEATS}heal2/", store).set("alive/0", "9")
        with pytest.raises(ProposerLost):
            members[1].grow(gen2, None)


def test_a_process_whose_node_was_launched_again_takes_part_in_nothing_and_ends_with_0(monkeypatch):
    """Node 1 frozen, named lost, and launched again (a newer launch: HEAL_LAUNCH) while its old
    processes live. An old process that runs again finds its replica held by a newer process
    (``where/``): it neither says it is alive after a loss, nor forms a generation, nor asks to
    join; it ends with 0 (``Superseded``), so that its torchrun ends too instead of starting it
    again. One that its old torchrun started again (an exit before) finds a newer launch of its
    replica (``launch/``) and ends the same way, before it records itself: the newer process keeps
    the replica. Before, the old one took the replica back, and the two could form a generation as
    one replica."""
    from framework.ddp import membership as module
    from framework.ddp.membership import Superseded

    def started_as(pid: int, replica: int, launch: str, restarted: bool) -> Membership:
        monkeypatch.setattr(module, "where_this_runs", lambda: f"elsewhere {pid} 1")  # one process each
        m = Membership(store, replica, launch=launch)
        m.start(2, restarted=restarted)
        return m

    store = dist.HashStore()
    old = [started_as(100 + r, r, "first", False) for r in range(2)]
    gen1 = old[0].newest()
    new = started_as(201, 1, "second", False)  # node 1 launched again: its first process
    for call in (lambda: old[1].after_loss(gen1, wait_s=0.1), lambda: old[1].form(gen1, "gloo", 5),
                 lambda: old[1].join(5)):
        with pytest.raises(Superseded, match="replica 1: a newer process of it runs"):
            call()
    assert not old[0].store.check(["alive/2/1"])  # it did not say it was alive
    with pytest.raises(Superseded, match="launch first .*newer launch"):
        started_as(102, 1, "first", True)  # its old torchrun started it again
    assert old[0].store.get("where/1") == b"elsewhere 201 1" and not new.superseded()
    # the same launch's torchrun starting its worker again takes the replica, as before
    restarted = started_as(202, 1, "second", True)
    assert old[0].store.get("where/1") == b"elsewhere 202 1" and new.superseded() and not restarted.superseded()
    assert not old[0].superseded()  # replica 0's process is its newest
    # The newer launch taking the replica between the restarted process's read and its write: the
    # compare-and-set fails, and the restarted process ends, not the newer one.

    class Racing:
        def __init__(self, store):
            self.inner = store

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def compare_set(self, key, expected, desired):
            self.inner.set(key, "elsewhere 301 1")  # the newer launch's first process, just now
            return self.inner.compare_set(key, expected, desired)

    monkeypatch.setattr(module, "where_this_runs", lambda: "elsewhere 203 1")
    late = Membership(store, 1, launch="second")
    late.store = Racing(late.store)
    with pytest.raises(Superseded):
        late.start(2, restarted=True)
    assert old[0].store.get("where/1") == b"elsewhere 301 1"
    # A superseded joiner withdraws its request (else it would look like a joiner until the newer
    # process asks), and only its own.
    monkeypatch.setattr(module, "where_this_runs", lambda: "elsewhere 204 1")
    waiting = Membership(store, 1, launch="second")
    waiting.start(2, restarted=True)
    waiting.replicas = waiting.size = 2
    raised = []
    thread = threading.Thread(target=lambda: raised.append(pytest.raises(Superseded, waiting.join, 30)))
    thread.start()
    while not old[0].store.check(["join/1"]):
        time.sleep(0.01)
    old[0].store.set("where/1", "elsewhere 205 1")  # yet another process took the replica
    thread.join(10)
    assert raised and not old[0].store.check(["join/1"])


def test_a_joiner_on_another_host_that_stopped_asking_is_not_taken_in(monkeypatch):
    """A replica waiting to join counts its requests (``asking/<replica>``) while it waits. One on
    another host is taken in once its count has moved since the first look from here, and not once
    it has stood still for REMOTE_SILENT_S (killed -9 or cut off while it waited: its ``join/``
    request stays): before, rank 0 grew the group with it, and the formation waited 60 s for it
    and failed, restarting every rank."""
    import os

    from framework.ddp import membership as module

    monkeypatch.setattr(module, "REMOTE_SILENT_S", 0.3)
    members = started(2)
    gen = members[0].propose(2, [0])
    members[0].store.set("where/1", f"elsewhere-{os.getpid()} 1")
    members[0].store.set("join/1", f"{os.getpid()} 2")
    members[0].store.add("asking/1", 3)
    assert members[0].joiners(gen) == []  # first seen now: not yet known to ask on (it may have died asking)
    members[0].store.add("asking/1", 1)  # it asks on
    assert members[0].joiners(gen) == [1]
    time.sleep(0.2)
    assert members[0].joiners(gen) == [1]
    time.sleep(0.2)
    assert members[0].joiners(gen) == []  # 0.4 s without a request
    # a replica waiting to join asks on while it waits
    waiting = Membership(members[0].store.underlying_store, 1)
    waiting.replicas = waiting.size = 2
    with pytest.raises(TimeoutError):
        waiting.join(1.2, stop=lambda: False)
    assert int(members[0].store.get("asking/1")) >= 4 + 2
