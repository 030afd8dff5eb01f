"""An IterableDataset on 2 gloo ranks: exact resume of a stream with a state after kill -9, and
no hang when one rank's shard runs out a batch early."""

import json

import pytest
from torch.utils.data import IterableDataset

from framework import DDPTrainer
from framework.data.datasets import MarkovDataset
from framework.data.iterable_stream import StreamPosition
from tests.dist_helper import ROOT, launch

WORKER = ROOT / "tests" / "workers" / "streaming.py"


def run(run_dir, fault="", rows_on_rank_1=48, restarts=0):
    out = launch(WORKER, [str(run_dir), fault, str(rows_on_rank_1)], run_dir, nproc=2, timeout=180,
                 torchrun_extra=["--max-restarts", str(restarts)])
    assert out.returncode == 0, out.output[-4000:]
    assert not out.leftovers
    return {r: json.loads((run_dir / f"result_rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run(tmp_path_factory.mktemp("stream_reference"))


@pytest.mark.dist
def test_a_stream_is_sharded_and_read_once(uninterrupted):
    assert uninterrupted[0]["summary"]["steps"] == 12  # 48 rows per rank, batch 4
    assert sorted(uninterrupted[0]["ids"]) == list(range(0, 96, 2))
    assert sorted(uninterrupted[1]["ids"]) == list(range(1, 96, 2))


@pytest.mark.dist
def test_kill_9_resumes_a_stream_with_a_state_exactly(uninterrupted, tmp_path):
    result = run(tmp_path, fault="sigkill@step=6,rank=1", restarts=1)
    assert "resumed from step 4" in (tmp_path / "logs" / "rank_0.log").read_text()
    for rank in (0, 1):
        assert sorted(result[rank]["ids"]) == sorted(uninterrupted[rank]["ids"])  # none lost, none twice
    assert result[0]["summary"]["model_sha256"] == uninterrupted[0]["summary"]["model_sha256"]


@pytest.mark.dist
def test_a_rank_with_one_batch_fewer_ends_the_epoch_on_both(tmp_path):
    result = run(tmp_path, rows_on_rank_1=44)
    assert result[0]["summary"]["steps"] == result[1]["summary"]["steps"] == 11


def test_a_stream_needs_max_steps_and_cannot_halve_its_micro_batch():
    from types import SimpleNamespace

    from framework.resilience.markers import FatalError
    position = StreamPosition(world_size=2, batch_size=4, accumulation=1)
    with pytest.raises(ValueError, match="max_steps"):
        position.last_step(0, SimpleNamespace(train=SimpleNamespace(max_steps=0)))
    with pytest.raises(FatalError, match="a stream cannot do"):
        position.set_micro_batch(2, 2)


class Rows(IterableDataset):
    """A table's rows in order, from the start again in each epoch; counts the rows it reads."""

    def __init__(self, rows: int):
        self.table, self.reads = MarkovDataset(32, 16, rows, chain_seed=3, sample_seed=1), 0

    def __iter__(self):
        for i in range(len(self.table)):
            self.reads += 1
            yield self.table[i]


class StatefulRows(Rows):
    """Rows whose state is its position: ``__iter__`` continues from a loaded state."""

    pos = 0

    def __iter__(self):
        while self.pos < len(self.table):
            self.pos += 1
            yield self.table[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


class CrashAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, metrics) -> None:
        if step == self.step:
            raise RuntimeError(f"test crash at step {step}")


def stream_config(run_dir, overrides: dict | None = None, /, **compact):
    return {**{"vocab_size": 32, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "seq_len": 16, "batch_size": 4,
               "dropout": 0.0, "train.max_steps": 1000, "num_epochs": 2, "save_interval": 1,
               "checkpoint.every_steps": 0, "eval.interval": 0, "logging.tensorboard": False, "target_loss": 0.0,
               "train.deterministic": True, "train.seed": 3, "learning_rate": 2e-3,
               "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck")},
            **(overrides or {}), **compact}


def manifest_steps(run_dir) -> list[int]:
    return [e["step"] for e in json.loads((run_dir / "ck" / "manifest.json").read_text())]


@pytest.mark.slow
def test_a_stream_saves_at_the_end_of_each_epoch_and_resumes_at_the_next(tmp_path):
    """32 rows, batch 4: 8 steps an epoch. The end of a stream's epoch is the step on which it runs
    out, one after its last batch: the epoch's checkpoint is written then, and says the epoch is done."""
    whole = DDPTrainer(stream_config(tmp_path / "whole"), train_dataset=StatefulRows(32)).train()
    assert whole["steps"] == 16 and whole["epochs"] == 2
    assert manifest_steps(tmp_path / "whole") == [8, 16]
    with pytest.raises(RuntimeError, match="test crash at step 11"):
        DDPTrainer(stream_config(tmp_path), train_dataset=StatefulRows(32), callbacks=[CrashAt(11)]).train()
    assert manifest_steps(tmp_path) == [8]
    resumed = DDPTrainer(stream_config(tmp_path), train_dataset=StatefulRows(32))
    assert (resumed.step, resumed.sampler.epoch, resumed.sampler.consumed) == (8, 1, 0)
    summary = resumed.train()
    assert summary["steps"] == 16 and summary["model_sha256"] == whole["model_sha256"]


@pytest.mark.slow
def test_a_stream_without_a_state_resumes_at_the_next_epoch_without_rereading_this_one(tmp_path):
    whole = DDPTrainer(stream_config(tmp_path / "whole"), train_dataset=Rows(32)).train()
    with pytest.raises(RuntimeError, match="test crash at step 11"):
        DDPTrainer(stream_config(tmp_path), train_dataset=Rows(32), callbacks=[CrashAt(11)]).train()
    data = Rows(32)
    summary = DDPTrainer(stream_config(tmp_path), train_dataset=data).train()
    assert summary["steps"] == 16 and summary["model_sha256"] == whole["model_sha256"]
    assert data.reads == 32  # the second epoch only: the first is not read again to be dropped


@pytest.mark.slow
def test_a_stream_resumed_mid_epoch_with_dropout_equals_the_uninterrupted_run(tmp_path):
    """Starting the stream's epoch on the resume draws nothing from the random state the checkpoint
    restored (the DataLoader's base seed came from the global generator: dropout then differed)."""
    cfg = {"dropout": 0.1, "checkpoint.every_steps": 3, "save_interval": 0}
    whole = DDPTrainer(stream_config(tmp_path / "whole", **cfg), train_dataset=StatefulRows(32)).train()
    with pytest.raises(RuntimeError, match="test crash at step 11"):
        DDPTrainer(stream_config(tmp_path, **cfg), train_dataset=StatefulRows(32), callbacks=[CrashAt(11)]).train()
    resumed = DDPTrainer(stream_config(tmp_path, **cfg), train_dataset=StatefulRows(32))
    assert (resumed.step, resumed.sampler.epoch) == (9, 1)
    assert resumed.train()["model_sha256"] == whole["model_sha256"]


@pytest.mark.parametrize("data", [StatefulRows, Rows])
def test_the_preflight_peek_of_a_stream_at_the_end_of_its_pass_reads_the_next_pass(data):
    """The explorer's trial 72 of seed 3000 (2 ranks): save_every_steps wrote the epoch's last step
    before the stream ran out, and the resumed run's DDP preflight peeked at a stream with nothing
    left in its pass: no batch, and a TypeError in the policy's probe. The peek now reads the start
    of the next pass, which the loop trains on next, and leaves the position as it was."""
    import torch

    from framework.data.iterable_stream import IterableStream

    rows = data(32)
    stream = IterableStream(rows, StreamPosition(1, 4, 1), device=torch.device("cpu"), distributed=False, rank=0)
    stream.start_epoch()
    while stream.next_step() is not None:
        if isinstance(rows, StatefulRows) and rows.pos == 32:
            break  # the last batch is read; the stream has not run out yet
    first = [b[0] for b in stream.peek(2, torch.device("cpu"))]
    assert len(first) == 2 and torch.equal(first[0][0], rows.table[0][0])
    if isinstance(rows, StatefulRows):
        assert rows.pos == 32


def test_a_preflight_with_no_batch_is_a_fatal_error_not_a_type_error():
    import torch

    from framework.ddp import policy
    from framework.resilience.markers import FatalError

    with pytest.raises(FatalError, match="no batch of the training set"):
        policy.probe(torch.nn.Linear(2, 2), [], None, lambda: torch.autocast("cpu", enabled=False))


def test_a_stream_resumed_at_another_world_size_stops_without_the_fatal_marker_that_blocks_a_rejoin(tmp_path):
    """Issue 33, bug 3: an elastic shrink re-splits a stream's shards, which it cannot: the run
    stops with one line, but without the FATAL marker that would stop every later restart,
    also the one where the lost node is back and the world size is the checkpoint's again."""
    import torch

    from framework.resilience.markers import FatalError
    DDPTrainer(stream_config(tmp_path / "one", {"train.max_steps": 3, "checkpoint.every_steps": 3}, num_epochs=1),
               train_dataset=Rows(32)).train()
    state = torch.load(tmp_path / "one" / "ck" / "step_00000003.pt", weights_only=True)
    state["sampler"]["world_size"] = 2  # as a 2-rank run saved it
    torch.save(state, tmp_path / "two_ranks.pt")
    with pytest.raises(FatalError, match="saved with 2 ranks, resumed on 1"):
        DDPTrainer({**stream_config(tmp_path / "shrunk"), "checkpoint.resume": str(tmp_path / "two_ranks.pt")},
                   train_dataset=Rows(32))
    assert not (tmp_path / "shrunk" / "ck" / "FATAL").exists()
    assert "saved with 2 ranks" in (tmp_path / "shrunk" / "ck" / "LAST_ERROR").read_text()
