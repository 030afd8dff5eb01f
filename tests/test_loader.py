"""BatchStream over a real DataLoader with one worker process: steps of micro-batches, surviving a
killed or stuck worker at the first uncommitted sample, the restart budget, and its state."""

import os
import signal
import time

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from framework.data import ResumableDistributedSampler, make_loader
from framework.loader import BatchStream, LoaderFailure

N, BATCH, ACCUM = 32, 4, 2  # 4 optimizer steps of 2 micro-batches of 4 samples per epoch


@pytest.fixture(autouse=True)
def _restore_sigchld():
    """BatchStream installs its own SIGCHLD handler; later tests get the previous one back."""
    previous = signal.getsignal(signal.SIGCHLD)
    yield
    signal.signal(signal.SIGCHLD, previous)


def make_stream(dataset=None, *, workers=1, max_restarts=3, timeout_s=20.0, seed=0):
    dataset = TensorDataset(torch.arange(N)) if dataset is None else dataset
    sampler = ResumableDistributedSampler(len(dataset), 1, 0, BATCH, ACCUM, seed)
    stream = BatchStream(lambda: make_loader(dataset, sampler, num_workers=workers, pin_memory=False, seed=seed,
                                             timeout_s=timeout_s),
                         sampler, max_restarts=max_restarts)
    return sampler, stream


def expected_step(sampler, k):
    """Step k's micro-batches of the epoch, read off the sampler's permutation."""
    perm = sampler.permutation(sampler.epoch)
    g, m = sampler.global_batch, BATCH
    return [perm[k * g + i * m:k * g + (i + 1) * m].tolist() for i in range(ACCUM)]


def samples(step):
    return [batch[0].tolist() for batch in step]


def kill_and_wait(stream):
    """Kill the worker, then wait until the stream's SIGCHLD handler has seen it: under CPU load the
    signal can reach the interpreter well after the process is gone, and the restart would then
    happen one step later."""
    pid = stream.kill_a_worker()
    assert pid is not None and pid != os.getpid()
    end = time.monotonic() + 20
    while not stream._child_exited and time.monotonic() < end:
        time.sleep(0.01)  # the main thread runs the Python-level SIGCHLD handler between these sleeps
    assert stream._child_exited
    return pid


def test_next_step_returns_accumulation_micro_batches():
    sampler, stream = make_stream()
    try:
        stream.start_epoch()
        assert len(stream.worker_pids()) == 1
        got = []
        for k in range(N // (BATCH * ACCUM)):
            step = stream.next_step()
            assert len(step) == ACCUM and all(b[0].shape == (BATCH,) for b in step)
            assert samples(step) == expected_step(sampler, k)
            got += sum(samples(step), [])
            assert sampler.advance() == sum(expected_step(sampler, k), [])
        assert sorted(got) == list(range(N))
        assert stream.restarts_this_epoch == 0
    finally:
        stream.shutdown()
    assert stream.worker_pids() == []


def test_killed_worker_restarts_at_the_first_uncommitted_sample(caplog):
    sampler, stream = make_stream()
    try:
        stream.start_epoch()
        assert samples(stream.next_step()) == expected_step(sampler, 0)
        sampler.advance()  # step 0 committed
        assert samples(stream.next_step()) == expected_step(sampler, 1)  # step 1 delivered, not committed
        old = kill_and_wait(stream)
        step = stream.next_step()
        assert stream.restarts_this_epoch == 1
        assert samples(step) == expected_step(sampler, 1)  # step 1 again, from a new loader
        assert stream.worker_pids() and old not in stream.worker_pids()
        assert "rebuilding the DataLoader (restart 1 of 3 this epoch), continuing at sample 8" in caplog.text
        assert sampler.advance() == sum(expected_step(sampler, 1), [])
        assert samples(stream.next_step()) == expected_step(sampler, 2)
        assert sampler.advance() == sum(expected_step(sampler, 2), [])
        kill_and_wait(stream)  # killed after a commit: continues with the next step
        assert samples(stream.next_step()) == expected_step(sampler, 3)
        assert stream.restarts_this_epoch == 2 and sampler.consumed == 24
    finally:
        stream.shutdown()


def test_more_than_max_restarts_in_an_epoch_fails():
    sampler, stream = make_stream(max_restarts=1)
    try:
        stream.start_epoch()
        stream.next_step()
        kill_and_wait(stream)
        stream.next_step()
        assert stream.restarts_this_epoch == 1
        kill_and_wait(stream)
        with pytest.raises(LoaderFailure, match=r"more than max_loader_restarts=1 loader restarts in epoch 0"):
            stream.next_step()
    finally:
        stream.shutdown()


class SlowOnce(Dataset):
    """Index 0's first read, in whichever process, sleeps; the marker file makes it once."""

    def __init__(self, marker):
        self.marker = marker
        self.data = torch.arange(N)

    def __len__(self):
        return N

    def __getitem__(self, i):
        if os.path.exists(self.marker):
            os.unlink(self.marker)
            time.sleep(1.5)
        return (self.data[i],)


def test_timed_out_fetch_restarts(tmp_path, caplog):
    marker = tmp_path / "slow"
    marker.touch()
    sampler, stream = make_stream(SlowOnce(marker), timeout_s=0.5)
    try:
        stream.start_epoch()
        step = stream.next_step()
        assert samples(step) == expected_step(sampler, 0)
        assert stream.restarts_this_epoch >= 1 and "DataLoader timed out" in caplog.text
    finally:
        stream.shutdown()


def test_other_errors_are_not_retried():
    class Broken(TensorDataset):
        def __getitem__(self, i):
            raise RuntimeError("a bug in the dataset")

    sampler, stream = make_stream(Broken(torch.arange(N)), workers=0)
    try:
        stream.start_epoch()
        with pytest.raises(RuntimeError, match="a bug in the dataset"):
            stream.next_step()
        assert stream.restarts_this_epoch == 0
    finally:
        stream.shutdown()


def test_no_workers_nothing_to_kill():
    sampler, stream = make_stream(workers=0)
    try:
        stream.start_epoch()
        assert stream.worker_pids() == [] and stream.kill_a_worker() is None
        assert samples(stream.next_step()) == expected_step(sampler, 0)
    finally:
        stream.shutdown()


def test_state_dict_round_trip_and_start_epoch_budget():
    sampler, stream = make_stream(workers=0)
    try:
        stream.restarts_this_epoch = 2
        state = stream.state_dict()
        assert state == {"restarts_this_epoch": 2}
        sampler2, resumed = make_stream(workers=0)
        resumed.load_state_dict(state)
        assert resumed.restarts_this_epoch == 2

        sampler2.consumed = 8  # resumed mid-epoch: the budget used so far stays used
        resumed.start_epoch()
        assert resumed.restarts_this_epoch == 2
        assert samples(resumed.next_step()) == expected_step(sampler2, 1)
        sampler2.set_epoch(1)  # a new epoch: a new budget
        resumed.start_epoch()
        assert resumed.restarts_this_epoch == 0
        assert samples(resumed.next_step()) == expected_step(sampler2, 0)
        resumed.shutdown()
    finally:
        stream.shutdown()


def test_resumed_budget_counts_toward_max_restarts():
    sampler, stream = make_stream(max_restarts=1)
    try:
        stream.load_state_dict({"restarts_this_epoch": 1})
        sampler.consumed = 8
        stream.start_epoch()
        assert samples(stream.next_step()) == expected_step(sampler, 1)
        kill_and_wait(stream)
        with pytest.raises(LoaderFailure, match="max_loader_restarts=1"):
            stream.next_step()
    finally:
        stream.shutdown()


class Ragged(Dataset):
    """A dataset bug, raised inside the worker process."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        raise RuntimeError(f"sample {i} is malformed")  # RuntimeError, like DataLoader's own worker errors


def test_a_datasets_own_error_in_a_worker_is_raised_not_retried():
    sampler, stream = make_stream(Ragged())
    try:
        stream.start_epoch()
        with pytest.raises(RuntimeError, match="Caught RuntimeError in DataLoader worker process 0") as caught:
            stream.next_step()
        assert "is malformed" in str(caught.value)
        assert stream.restarts_this_epoch == 0
    finally:
        stream.shutdown()
