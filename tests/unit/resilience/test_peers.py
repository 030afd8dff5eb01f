"""framework/resilience/peers.py in one process: monitors of 2 or 3 "ranks" on a real TCPStore,
each beating from its own thread; a silent one is named, a finished one is not."""

from __future__ import annotations

import datetime
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from framework.config.schema import RecoverySection
from framework.resilience.peers import PeerMonitor

TIMEOUT_S = 2.0  # each beat 0.5 s: a thread starved for 2 s in this process would be a false loss


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    yield dist.PrefixStore("generation_0/", master)


def monitors(store, tmp_path, world_size):
    heard = {r: [] for r in range(world_size)}
    made = [PeerMonitor(RecoverySection(peer_timeout_s=TIMEOUT_S),
                        env=SimpleNamespace(rank=r, world_size=world_size, distributed=True), store=store,
                        checkpoint_dir=str(tmp_path), on_lost=heard[r].append) for r in range(world_size)]
    for m in made:
        m.train_start()
    return made, heard


def wait_for(condition, seconds):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)
    return condition()


def test_a_silent_peer_is_named_within_the_timeout_and_every_rank_learns_it(store, tmp_path):
    made, heard = monitors(store, tmp_path, 3)
    try:
        time.sleep(TIMEOUT_S * 1.5)
        assert heard == {0: [], 1: [], 2: []}  # all beating: nobody is lost
        start = time.monotonic()
        made[1].close()  # rank 1 stops beating without saying it finished: frozen, or cut off
        assert wait_for(lambda: heard[0], TIMEOUT_S + 3)
        took = time.monotonic() - start
        assert heard[0][0].startswith("rank 1 went silent: no heartbeat for")
        assert TIMEOUT_S - 2 * 0.5 <= took < TIMEOUT_S + 3  # its last beat came up to one beat before the close
        # rank 0 announced it: rank 2, which watches rank 0 (still beating), learns it too
        assert wait_for(lambda: heard[2], 2.0) and heard[2] == heard[0]
    finally:
        for m in made:
            m.close()


def test_a_peer_that_finished_is_not_lost(store, tmp_path):
    made, heard = monitors(store, tmp_path, 2)
    try:
        made[1].train_end({})  # finished: says so, then stops beating
        time.sleep(TIMEOUT_S * 2)
        assert heard == {0: [], 1: []}
    finally:
        for m in made:
            m.close()


def test_off_with_a_zero_timeout_or_one_process(store, tmp_path):
    off = PeerMonitor(RecoverySection(peer_timeout_s=0), env=SimpleNamespace(rank=0, world_size=2, distributed=True),
                      store=store, checkpoint_dir=str(tmp_path))
    alone = PeerMonitor(RecoverySection(), env=SimpleNamespace(rank=0, world_size=1, distributed=False),
                        store=store, checkpoint_dir=str(tmp_path))
    assert not off.enabled and not alone.enabled
    off.train_start()
    alone.train_start()
    assert off._thread is None and alone._thread is None


def test_a_silence_found_while_the_main_thread_saves_for_a_lost_peer_does_not_cut_it_short(store, tmp_path):
    made, heard = monitors(store, tmp_path, 2)
    try:
        with made[0].holding():  # the main thread writes the survivor checkpoint, then exits 75 itself
            made[1].close()
            assert wait_for(lambda: made[0].lost is not None, TIMEOUT_S + 3)
            assert heard[0] == [] and made[0].lost.startswith("rank 1 went silent")
    finally:
        for m in made:
            m.close()
