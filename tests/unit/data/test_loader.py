"""BatchStream over a real DataLoader with one worker process: steps of micro-batches, surviving a
killed or stuck worker at the first uncommitted sample, the restart budget, and its state."""

import os
import signal
import ssl
import time
import urllib.error

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from framework.data.sampler import ResumableDistributedSampler
from framework.data.batch_stream import make_loader
from framework.data.batch_stream import BatchStream, LoaderFailure

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
        with pytest.raises(LoaderFailure, match=r"more than recovery.max_loader_restarts=1 loader restarts in epoch 0"):
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


@pytest.mark.parametrize("error", [RuntimeError("a bug in the dataset"), FileNotFoundError("shard 3 is missing")],
                         ids=["RuntimeError", "OSError"])
def test_without_workers_the_datasets_own_errors_are_not_retried(error):
    class Broken(TensorDataset):
        def __getitem__(self, i):
            raise error

    sampler, stream = make_stream(Broken(torch.arange(N)), workers=0)
    try:
        stream.start_epoch()
        with pytest.raises(type(error), match=str(error)):
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
        with pytest.raises(LoaderFailure, match="recovery.max_loader_restarts=1"):
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


class SharerGone(Dataset):
    """In the worker, at its second micro-batch's first sample: wait until the first micro-batch's
    storage is registered for sending, then stop the worker's resource sharer, the socket a batch's shared memory is
    received over, and remove the marker. The worker stays alive, as a SIGKILLed one looks for a
    moment after its socket is gone: receiving the first micro-batch fails with an OSError, which
    DataLoader's own dead-worker check re-raises as it is. Once: the rebuilt loader's worker finds
    no marker."""

    def __init__(self, marker):
        self.marker = marker
        self.data = torch.arange(N)
        self.reads = 0  # in the worker's copy

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == BATCH + 1 and self.marker.exists():
            from multiprocessing import resource_sharer
            end = time.monotonic() + 30
            while not resource_sharer._resource_sharer._cache and time.monotonic() < end:
                time.sleep(0.01)  # until the queue's feeder thread has registered the first micro-batch's storage
            resource_sharer.stop()
            self.marker.unlink()
        return (self.data[i],)


def test_a_batch_lost_in_transit_from_a_worker_restarts_the_loader(tmp_path, caplog):
    """A worker SIGKILLed after it queued a batch: seen as an OSError or EOFError while the batch
    is received, before the worker's death is visible. It ended train() on one rank (1 run in 11
    of the 2-rank kill_worker case, 61 in 150 under CPU load at world size 1)."""
    marker = tmp_path / "sharer"
    marker.touch()
    sampler, stream = make_stream(SharerGone(marker), workers=1)
    try:
        stream.start_epoch()
        end = time.monotonic() + 30
        while marker.exists() and time.monotonic() < end:  # the worker stopped its sharer
            time.sleep(0.01)
        assert not marker.exists()
        assert samples(stream.next_step()) == expected_step(sampler, 0)
        assert stream.restarts_this_epoch == 1
        assert "receiving a batch from a DataLoader worker failed (FileNotFoundError" in caplog.text
        sampler.advance()
        assert samples(stream.next_step()) == expected_step(sampler, 1)
    finally:
        stream.shutdown()


class UnreachableShard(Dataset):
    """A dataset's own network errors, raised in the worker: URLError's and SSLError's messages,
    as DataLoader re-raises them, do not start with "Caught "."""

    def __init__(self, error):
        self.error = error

    def __len__(self):
        return N

    def __getitem__(self, i):
        raise self.error


@pytest.mark.parametrize("error", [urllib.error.URLError("shard host unreachable"), ssl.SSLError(1, "bad record"),
                                   FileNotFoundError("shard 3 is missing")], ids=["URLError", "SSLError", "missing"])
def test_a_datasets_own_oserror_in_a_worker_is_raised_not_retried(error):
    sampler, stream = make_stream(UnreachableShard(error), workers=1)
    try:
        stream.start_epoch()
        with pytest.raises(type(error), match="in DataLoader worker process 0"):
            stream.next_step()
        assert stream.restarts_this_epoch == 0
    finally:
        stream.shutdown()




# --- rewind, epoch boundaries, and what a stream leaves behind -----------------------------------


def alive(pids):
    """The pids not yet gone: running, or exited but never reaped (a zombie is a leak too)."""
    import psutil
    return [p for p in pids if psutil.pid_exists(p)]


def test_rewind_with_workers_continues_at_the_restored_position():
    """A spike rollback restores an earlier ``consumed`` and rewinds: the stream must deliver from
    there with fresh workers, not iterate the loader whose workers it has just shut down."""
    sampler, stream = make_stream(workers=2)
    try:
        stream.start_epoch()
        for k in range(3):
            assert samples(stream.next_step()) == expected_step(sampler, k)
            sampler.advance()
        old = stream.worker_pids()
        sampler.consumed = 8  # the rollback restored the checkpoint after step 0
        stream.rewind()
        assert samples(stream.next_step()) == expected_step(sampler, 1)
        sampler.advance()
        assert samples(stream.next_step()) == expected_step(sampler, 2)
        assert stream.restarts_this_epoch == 0  # a rewind is no failure
        assert stream.worker_pids() and not set(old) & set(stream.worker_pids())
        assert alive(old) == []
        stream.rewind()  # twice in a row, the second before any batch of the first
        stream.rewind()
        assert samples(stream.next_step()) == expected_step(sampler, 2)
    finally:
        stream.shutdown()


@pytest.mark.parametrize("when", ["seen", "unseen", "during_reset"])
def test_a_worker_killed_between_epochs_is_replaced_at_the_next_epoch_start(when, caplog):
    """Killed after the epoch's last step: PyTorch's persistent workers would wait timeout_s at the
    next epoch's start for the dead one's reply, then raise out of start_epoch. ``seen``: the
    SIGCHLD was handled before the epoch starts; ``unseen``: perhaps not yet; ``during_reset``:
    the worker dies after the stream's own check, while PyTorch waits for the workers' replies."""
    sampler, stream = make_stream(workers=2, timeout_s=20.0)
    reference_sampler, reference = make_stream(workers=0)
    try:
        stream.start_epoch()
        for k in range(N // (BATCH * ACCUM)):
            assert samples(stream.next_step()) == expected_step(sampler, k)
            sampler.advance()
        victim = stream.worker_pids()[0]
        if when == "during_reset":
            check = stream._raise_if_a_worker_died

            def check_then_kill():
                check()
                stream._raise_if_a_worker_died = check
                os.kill(victim, signal.SIGKILL)
            stream._raise_if_a_worker_died = check_then_kill
        else:
            os.kill(victim, signal.SIGKILL)
        if when == "seen":
            end = time.monotonic() + 20
            while not stream._child_exited and time.monotonic() < end:
                time.sleep(0.01)
            assert stream._child_exited
        sampler.set_epoch(1)
        reference_sampler.set_epoch(1)
        reference.start_epoch()
        began = time.monotonic()
        stream.start_epoch()
        got = []
        for _ in range(N // (BATCH * ACCUM)):
            got.append(samples(stream.next_step()))
            sampler.advance()
        took = time.monotonic() - began
        assert took < 10, f"the epoch after the kill took {took:.1f} s (timeout_s=20)"
        want = []
        for _ in range(N // (BATCH * ACCUM)):
            want.append(samples(reference.next_step()))
            reference_sampler.advance()
        assert got == want and want[0] == expected_step(sampler, 0)
        assert stream.restarts_this_epoch == 1 and "rebuilding the DataLoader" in caplog.text
        assert victim not in stream.worker_pids() and len(stream.worker_pids()) == 2
    finally:
        stream.shutdown()
        reference.shutdown()


@pytest.fixture
def previous_sigchld():
    """A SIGCHLD handler of the caller's, installed after PyTorch's own (which PyTorch sets once
    per process, at the first iterator with workers)."""
    from torch.utils.data._utils import signal_handling
    signal_handling._set_SIGCHLD_handler()

    def previous(signum, frame):
        pass
    signal.signal(signal.SIGCHLD, previous)
    return previous


def test_shutdown_gives_the_sigchld_handler_back(previous_sigchld):
    sampler, stream = make_stream(workers=1)
    stream.start_epoch()
    assert signal.getsignal(signal.SIGCHLD) == stream._on_sigchld
    stream.next_step()
    stream.shutdown()
    assert signal.getsignal(signal.SIGCHLD) is previous_sigchld
    stream.shutdown()  # twice: harmless
    assert signal.getsignal(signal.SIGCHLD) is previous_sigchld


def test_rewind_restart_and_epochs_leave_no_worker_processes(previous_sigchld):
    import multiprocessing
    sampler, stream = make_stream(workers=2)
    seen = []
    try:
        stream.start_epoch()
        seen += stream.worker_pids()
        stream.next_step()
        sampler.advance()
        stream.rewind()
        seen += stream.worker_pids()
        kill_and_wait(stream)
        stream.next_step()  # the restart
        seen += stream.worker_pids()
        sampler.set_epoch(1)
        stream.start_epoch()
        seen += stream.worker_pids()
    finally:
        stream.shutdown()
    assert len(set(seen)) == 6  # three pairs of workers: the first, after the rewind, after the restart
    assert alive(seen) == []
    assert multiprocessing.active_children() == []
    assert signal.getsignal(signal.SIGCHLD) is previous_sigchld


# --- the same, end to end: a user's map-style dataset through DataLoader workers ----------------

RUN = {"vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16, "batch_size": 4,
       "dropout": 0.0, "logging.tensorboard": False, "eval.interval": 0, "eval.steps": 2, "target_loss": 0.0,
       "train.seed": 3, "learning_rate": 3e-3, "log_interval": 1, "checkpoint.resume": "none",
       "logging.record_samples": False, "ddp.timeout_s": 20.0}


class PlainTokens(Dataset):
    """The synthetic data as a user's map-style dataset: no batched read, so DataLoader workers."""

    def __init__(self, n):
        from framework.data.datasets import MarkovDataset
        self.inner = MarkovDataset(32, 16, n, 3, 1)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


def train(tmp_path, name, n, over: dict | None = None, /, **compact):
    import multiprocessing

    from torch.utils.data._utils import signal_handling

    from framework.trainer import DDPTrainer
    # PyTorch installs its own SIGCHLD handler once per process, at the first iterator with workers,
    # and leaves it: install it now, so that what this run must give back does not depend on whether
    # an earlier test of this process made such an iterator.
    signal_handling._set_SIGCHLD_handler()
    before = signal.getsignal(signal.SIGCHLD)
    over = {**(over or {}), **compact}
    cfg = {**RUN, **over, "logging.dir": str(tmp_path / name / "logs"), "checkpoint.dir": str(tmp_path / name / "ck")}
    trainer = DDPTrainer(cfg, rank=0, world_size=1, train_dataset=PlainTokens(n), val_dataset=PlainTokens(8))
    assert trainer.num_workers == (1 if over.get("num_workers") else 0)  # 2 asked, 1 on a 2-core machine
    pids = []
    original = trainer.stream.start_epoch

    def start_epoch():
        original()
        pids.extend(trainer.stream.worker_pids())
    trainer.stream.start_epoch = start_epoch
    summary = trainer.train()
    assert alive(pids) == [] and multiprocessing.active_children() == []
    assert signal.getsignal(signal.SIGCHLD) == before
    return summary, (tmp_path / name / "logs" / "rank_0.log").read_text()


@pytest.mark.slow
def test_a_spike_rollback_with_dataloader_workers_equals_the_run_without(tmp_path):
    spike = {"train.max_steps": 24, "checkpoint.every_steps": 5, "spike.guard": "rollback", "spike.warmup": 10,
             "spike.window": 20, "spike.threshold": 8.0, "recovery.fault_inject": "bad_data@step=15"}
    with_workers, log = train(tmp_path, "workers", 256, num_workers=2, **spike)
    without, _ = train(tmp_path, "inline", 256, num_workers=0, **spike)
    assert (with_workers["rollbacks"], with_workers["steps"]) == (1, 24)
    assert "rolled back to the checkpoint of step 15" in log
    assert with_workers["model_sha256"] == without["model_sha256"]


@pytest.mark.slow
def test_a_worker_killed_in_the_last_step_of_an_epoch_is_replaced_at_the_next(tmp_path):
    began = time.monotonic()
    killed, log = train(tmp_path, "killed", 64, {"train.max_steps": 20,
                                                 "recovery.fault_inject": "kill_worker@step=15"}, num_workers=2)
    took = time.monotonic() - began
    clean, _ = train(tmp_path, "clean", 64, {"train.max_steps": 20}, num_workers=2)
    assert "killed DataLoader worker" in log and "continuing at sample 0 of epoch 1" in log
    assert killed["steps"] == 20 and killed["model_sha256"] == clean["model_sha256"]
    assert took < 60
