"""framework/resilience/peers.py in one process: monitors of 2 or 3 "ranks" on a real TCPStore,
each beating from its own thread; a silent one is named, a finished one is not."""

from __future__ import annotations

import dataclasses
import datetime
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from framework.resilience.config import RecoverySection
from framework.ddp.membership import process_start, process_state
from framework.resilience.peers import PeerMonitor, Where, where_this_runs
from tests.dist_helper import holds_within

TIMEOUT_S = 2.0  # each beat 0.5 s: a thread starved for 2 s in this process would be a false loss


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    yield dist.PrefixStore("generation_0/", master)


def monitors(store, tmp_path, world_size, *, breakers=None, **keys):
    """``world_size`` monitors, started; each rank's losses in ``heard[rank]``. ``breakers``: one per
    rank (healing in place); ``keys``: PeerMonitor's other keywords, the same for every rank."""
    heard = {r: [] for r in range(world_size)}
    made = [PeerMonitor(RecoverySection(peer_timeout_s=TIMEOUT_S),
                        env=SimpleNamespace(rank=r, world_size=world_size, distributed=True), store=store,
                        checkpoint_dir=str(tmp_path), on_lost=heard[r].append,
                        breaker=breakers[r] if breakers else None, **keys) for r in range(world_size)]
    for m in made:
        m.train_start()
    return made, heard


class BrokenStore:
    """A store every call of which raises ``fail_with``, or blocks until ``block_until`` is set."""

    def __init__(self, *, fail_with: Exception | None = None, block_until=None):
        self.fail_with, self.block_until = fail_with, block_until

    def __getattr__(self, name):
        def call(*args):
            if self.block_until is not None:
                self.block_until.wait()
            raise self.fail_with or RuntimeError("released")
        return call


def freeze(monitor):
    """What a frozen process (SIGSTOP) or a cut link looks like to the others: no more beats, and
    no word of leaving."""
    monitor._stop.set()
    for thread in monitor._threads:
        thread.join()


@pytest.mark.slow
def test_a_silent_peer_is_named_within_the_timeout_and_every_rank_learns_it(store, tmp_path):
    made, heard = monitors(store, tmp_path, 3)
    try:
        time.sleep(TIMEOUT_S * 1.5)
        assert heard == {0: [], 1: [], 2: []}  # all beating: nobody is lost
        start = time.monotonic()
        freeze(made[1])
        assert holds_within(lambda: heard[0], TIMEOUT_S + 3)
        took = time.monotonic() - start
        assert heard[0][0].startswith("rank 1 went silent: no heartbeat for")
        assert TIMEOUT_S - 2 * 0.5 <= took < TIMEOUT_S + 3  # its last beat came up to one beat before the close
        # rank 0 announced it: rank 2, which watches rank 0 (still beating), learns it too
        assert holds_within(lambda: heard[2], 2.0) and heard[2] == heard[0]
    finally:
        for m in made:
            m.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["finished", "failed on its own"])
def test_a_peer_that_left_on_purpose_is_not_lost_nor_a_store_error_after_it(store, tmp_path, how):
    made, heard = monitors(store, tmp_path, 2)
    try:
        if how == "finished":
            made[1].train_end({})  # says so (-1), then stops beating
        else:
            made[1].close()  # the trainer's close() on an error of its own: the same word
        time.sleep(TIMEOUT_S * 1.5)
        # nothing left to watch: a store error then is not a cut link
        made[0].store = BrokenStore(fail_with=RuntimeError("connection reset"))
        time.sleep(TIMEOUT_S * 1.5)
        assert heard == {0: [], 1: []}
    finally:
        made[0].store = None
        made[0]._stop.set()


@pytest.mark.slow
def test_a_peer_that_never_beat_is_left_to_the_collective_timeout(store, tmp_path):
    heard = []
    alone = PeerMonitor(RecoverySection(peer_timeout_s=TIMEOUT_S),
                        env=SimpleNamespace(rank=0, world_size=2, distributed=True), store=store,
                        checkpoint_dir=str(tmp_path), on_lost=heard.append)
    alone.train_start()  # rank 1 never starts (a slow start-up, a user's long on_train_start)
    try:
        time.sleep(TIMEOUT_S * 2)
        assert heard == [] and alone.lost is None
    finally:
        alone.close()


@pytest.mark.slow
def test_a_rank_cut_off_from_the_store_says_so(store, tmp_path):
    made, heard = monitors(store, tmp_path, 2)
    try:
        time.sleep(1.0)

        made[0].store = BrokenStore(fail_with=RuntimeError("connection reset"))
        assert holds_within(lambda: heard[0], TIMEOUT_S + 3)
        assert heard[0][0].startswith("rank 0 lost the run's store: no answer for")
        assert heard[0][0].endswith("(recovery.peer_timeout_s=2; RuntimeError: connection reset)")
    finally:
        made[0]._stop.set()
        made[1].close()


def test_off_with_a_zero_timeout_or_one_process(store, tmp_path):
    off = PeerMonitor(RecoverySection(peer_timeout_s=0), env=SimpleNamespace(rank=0, world_size=2, distributed=True),
                      store=store, checkpoint_dir=str(tmp_path))
    alone = PeerMonitor(RecoverySection(), env=SimpleNamespace(rank=0, world_size=1, distributed=False),
                        store=store, checkpoint_dir=str(tmp_path))
    assert not off.enabled and not alone.enabled
    off.train_start()
    alone.train_start()
    assert off._threads == [] and alone._threads == []


@pytest.mark.slow
def test_a_silence_found_while_the_main_thread_saves_for_a_lost_peer_does_not_cut_it_short(store, tmp_path):
    made, heard = monitors(store, tmp_path, 2)
    try:
        time.sleep(1.5)  # both beating
        with made[0].holding():  # the main thread writes the survivor checkpoint, then exits 75 itself
            freeze(made[1])
            assert holds_within(lambda: made[0].lost is not None, TIMEOUT_S + 3)
            assert heard[0] == [] and made[0].lost.startswith("rank 1 went silent")
    finally:
        for m in made:
            m.close()


@pytest.mark.slow
def test_a_peer_frozen_right_after_it_started_is_named(store, tmp_path):
    """Its start is its first beat: a tiny model's rank can freeze before its thread beat even once
    (the 2-rank SIGSTOP test stopped 1 s after the start and was missed)."""
    made, heard = monitors(store, tmp_path, 2)
    try:
        freeze(made[1])
        assert holds_within(lambda: heard[0], TIMEOUT_S + 3)
        assert heard[0][0].startswith("rank 1 went silent")
    finally:
        for m in made:
            m.close()


@pytest.mark.slow
def test_a_store_call_that_never_returns_is_a_lost_store(store, tmp_path):
    """A store server that is frozen or cut off keeps the connection open and never answers: the
    client's timeout does not bound add() (measured: blocked for good), so the judge thread does."""
    import threading
    made, heard = monitors(store, tmp_path, 2)
    release = threading.Event()
    try:
        time.sleep(1.0)

        made[0].store = BrokenStore(block_until=release)
        assert holds_within(lambda: heard[0], TIMEOUT_S + 3)
        assert heard[0][0].startswith("rank 0 lost the run's store: no answer for")
        assert heard[0][0].endswith("a call that did not return)")
    finally:
        release.set()
        made[0]._stop.set()
        made[1].close()


@pytest.mark.slow
def test_a_silent_peer_killed_for_a_heal_that_never_comes_is_still_named(store, tmp_path):
    """Healing in place, the watcher kills a silent peer (on_silent True) and waits for the heal,
    which stops the monitor; if none comes within another timeout (the kill freed no collective:
    NCCL on one host, a process in uninterruptible sleep), the loss is named as before."""
    heard, silenced = [], []
    made = [PeerMonitor(RecoverySection(peer_timeout_s=TIMEOUT_S),
                        env=SimpleNamespace(rank=r, world_size=2, distributed=True), store=store,
                        checkpoint_dir=str(tmp_path), on_lost=heard.append if r == 0 else lambda _: None,
                        on_silent=lambda rank: silenced.append(rank) or True) for r in range(2)]
    for m in made:
        m.train_start()
    try:
        freeze(made[1])
        assert holds_within(lambda: silenced, TIMEOUT_S + 3) and silenced == [1] and not heard
        assert holds_within(lambda: heard, TIMEOUT_S + 3)
        assert heard[0].startswith("rank 1 went silent and was killed, but the group did not heal within")
    finally:
        for m in made:
            m.close()


@pytest.mark.slow
def test_a_rank_whose_own_process_did_not_run_does_not_take_its_peer_for_silent(store, tmp_path):
    """A job suspended and continued (Ctrl-Z, a scheduler's suspend): every rank's beat thread
    stood still, so the first read after it finds the watched counter unchanged. That is this
    rank's own pause, not the peer's silence: the silence counts from the read (healing in place,
    a false silence would kill a healthy rank). A peer that stays silent is named after the timeout."""
    made, heard = monitors(store, tmp_path, 2)
    try:
        freeze(made[1])  # it beats no more: as if not continued yet
        paused = time.monotonic() - 3 * TIMEOUT_S
        made[0]._ok_at = made[0]._changed_at = made[0]._judged_at = paused  # rank 0's threads stood still
        time.sleep(TIMEOUT_S * 0.6)
        assert heard[0] == []  # read after the pause: counted from then
        assert holds_within(lambda: heard[0], TIMEOUT_S + 3) and heard[0][0].startswith("rank 1 went silent")
    finally:
        for m in made:
            m.close()


@pytest.mark.slow
def test_healing_in_place_a_peer_silent_on_another_host_is_named_lost_in_every_ranks_breaker(store, tmp_path):
    """Rank 2 goes silent and its watcher cannot kill it (another host: on_silent False). Rank 1
    names it lost in its breaker and announces it; rank 0 reads the announcement and names it in
    its own: the collectives with it end, and nobody ends its process, unless the heal (which
    closes the monitors) has not come within another timeout. A process of rank 2 that runs
    again reads that it was named lost, and ends."""
    from framework.ddp.collectives import Breaker
    breakers = [Breaker(1) for _ in range(3)]
    made, heard = monitors(store, tmp_path, 3, breakers=breakers, on_silent=lambda rank: False)
    again = None
    try:
        freeze(made[2])
        assert holds_within(lambda: breakers[0].lost() and breakers[1].lost(), TIMEOUT_S + 3)
        assert breakers[0].lost() == breakers[1].lost() == [2] and not heard[0] and not heard[1]
        # Rank 2's process runs again (SIGCONT): it reads that it was named lost, and ends.
        again = PeerMonitor(RecoverySection(peer_timeout_s=TIMEOUT_S),
                            env=SimpleNamespace(rank=2, world_size=3, distributed=True), store=store,
                            checkpoint_dir=str(tmp_path), on_lost=heard[2].append, breaker=Breaker(1))
        again.train_start()
        assert holds_within(lambda: heard[2], 3)
        assert heard[2][0].startswith("this rank was named lost by its peers (rank 2 went silent: no heartbeat")
        # No heal came (the monitors were not closed): the loss ends the ranks as without a breaker.
        assert holds_within(lambda: heard[0] and heard[1], TIMEOUT_S + 3)
        assert heard[1][0].startswith("rank 2 went silent and was named lost, but the group did not heal within")
    finally:
        for m in (*made, *([again] if again else [])):
            m.close()


@pytest.mark.slow
def test_two_watchers_naming_different_ranks_at_once_both_stand(store, tmp_path):
    """Ranks 1 and 3 of 4 go silent together on other hosts: their watchers (0 and 2) name them at
    about the same moment. The announcement holds both (compare-and-set; a plain set kept the last
    writer's alone), so every survivor's breaker names both."""
    from framework.ddp.collectives import Breaker
    breakers = [Breaker(1) for _ in range(4)]
    made, heard = monitors(store, tmp_path, 4, breakers=breakers, on_silent=lambda rank: False)
    try:
        freeze(made[1])
        freeze(made[3])
        assert holds_within(lambda: breakers[0].lost() == breakers[2].lost() == [1, 3], TIMEOUT_S + 4), \
            (breakers[0].lost(), breakers[2].lost())
        assert not heard[0] and not heard[2]
        assert made[0].store.get("lost").decode().startswith("1,3\t")  # the monitors' own prefix
    finally:
        for m in made:
            m.close()


def test_restarting_only_a_stopped_peer_in_this_pid_namespace_is_killed():
    """Where a silent peer runs, as its watcher reads it: a stopped process (SIGSTOP) is killed, so
    that torchrun need not wait its 30 s SIGTERM grace; a running one (cut off, or slow), one in
    another pid namespace or on another host, one whose pid now names another process, and a
    record this version cannot read are not."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = Where.parse(where_this_runs())
        assert ours is not None and ours.pid != child.pid
        where = dataclasses.replace(ours, pid=child.pid, start=process_start(child.pid))
        assert not where.kill_if_stopped("running")  # cut off, or slow: left to its own watch
        child.send_signal(signal.SIGSTOP)
        assert holds_within(lambda: process_state(child.pid) == "T", 5)
        for other in (dataclasses.replace(where, pid_namespace="1"), dataclasses.replace(where, host="elsewhere"),
                      dataclasses.replace(where, start=where.start + 1)):
            assert not other.kill_if_stopped("not this one") and child.poll() is None
        assert Where.parse(f"{where.host} {where.pid} None {where.pid_namespace}") is None
        assert Where.parse(f"{where.host} {where.pid}") is None
        assert where.kill_if_stopped("rank 1 is stopped")
        assert child.wait(5) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
