"""Datasets and the resumable distributed sampler."""

import math

import numpy as np
import pytest
import torch

from framework.config import ConfigError, build_config, resolve_config
from framework.data.datasets import MARKOV_ENTROPY, MarkovDataset, TokenWindows, build_datasets, encode_text
from framework.data.sampler import ResumableDistributedSampler, eval_indices
from framework.resilience.markers import FatalError
from tests.tiny import tiny as tiny_config


def shards(n, world, batch, accum, seed=3, epoch=0):
    out = []
    for rank in range(world):
        s = ResumableDistributedSampler(n, world, rank, batch, accum, seed)
        s.set_epoch(epoch)
        out.append([i for b in s for i in b])
    return out


@pytest.mark.parametrize("n, world, batch, accum", [(103, 2, 4, 1), (103, 2, 3, 2), (100, 3, 5, 1), (64, 1, 8, 4)])
def test_shards_disjoint_and_cover_drop_last_prefix(n, world, batch, accum):
    parts = shards(n, world, batch, accum)
    usable = (n // (world * batch * accum)) * world * batch * accum
    perm = ResumableDistributedSampler(n, world, 0, batch, accum, 3).permutation(0)
    assert sorted(i for p in parts for i in p) == sorted(perm[:usable].tolist())
    for a in range(world):
        for b in range(a + 1, world):
            assert not set(parts[a]) & set(parts[b])
    assert all(len(p) == usable // world for p in parts)


def test_permutation_independent_of_world_size_and_per_epoch():
    one = shards(96, 1, 8, 1)[0]
    two = shards(96, 2, 4, 1)
    # global micro-batch k of the 1-rank run is rank 0's then rank 1's share of micro-batch k
    rebuilt = [i for k in range(12) for r in range(2) for i in two[r][4 * k:4 * k + 4]]
    assert rebuilt == one
    assert shards(96, 1, 8, 1, epoch=1)[0] != one


def test_resume_continues_at_the_exact_sample():
    full = ResumableDistributedSampler(120, 2, 1, 3, 2, seed=5)
    expected = list(full)
    resumed = ResumableDistributedSampler(120, 2, 1, 3, 2, seed=5)
    for _ in range(4):
        resumed.advance()
    state = resumed.state_dict()
    assert state == {"epoch": 0, "consumed": 4 * 12, "batch_size": 3, "accumulation": 2, "world_size": 2,
                     "num_samples": 120, "seed": 5, "configured": [3, 2], "micro_batch_cap": None,
                     "global_batch": 12}
    fresh = ResumableDistributedSampler(120, 2, 1, 3, 2, seed=5)
    fresh.load_state_dict(state)
    assert list(fresh) == expected[4 * 2:]
    assert len(fresh) == len(expected) - 8


def step_samples(world: int, batch: int, accum: int, state: dict | None = None, n: int = 96,
                 keep: bool = True) -> tuple[list[list[int]], list]:
    """Each remaining step's global samples (every rank's micro-batches), and the ranks' samplers."""
    ranks = [ResumableDistributedSampler(n, world, r, batch, accum, seed=7, keep_global_batch=keep)
             for r in range(world)]
    for s in ranks:
        if state is not None:
            s.load_state_dict(state)
    micro = [list(s) for s in ranks]
    a = ranks[0].accumulation
    steps = [sorted(i for r in range(world) for m in micro[r][k * a:(k + 1) * a] for i in m)
             for k in range(len(micro[0]) // a)]
    return steps, ranks


@pytest.mark.parametrize("before, after, split", [
    ((2, 4, 1), 1, (4, 2)),   # 2 -> 1: accumulation doubles
    ((1, 4, 1), 2, (2, 1)),   # 1 -> 2: the micro-batch halves
    ((2, 4, 1), 4, (2, 1)),   # 2 -> 4
    ((4, 2, 1), 2, (4, 1)),   # 4 -> 2 (the configured micro-batch is 4: a resize back)
    ((2, 2, 2), 4, (2, 1)),   # an out-of-memory halving's split, then 4 ranks
])
def test_a_world_size_change_keeps_the_global_batch_and_each_steps_samples(before, after, split):
    """N -> M: the steps after the resume hold exactly the samples the uninterrupted N-rank run's
    steps hold, in the same order of steps; the micro-batch and accumulation are re-split."""
    world, batch, accum = before
    full, ranks = step_samples(world, batch, accum)
    for s in ranks:
        for _ in range(3):
            s.advance()
    state = ranks[0].state_dict()
    state["configured"] = [4, 1]  # the configuration's split (an OOM halving or earlier resize may differ)
    resumed, new_ranks = step_samples(after, 4, 1, state)
    assert (new_ranks[0].batch_size, new_ranks[0].accumulation) == split
    assert new_ranks[0].global_batch == world * batch * accum
    assert resumed == full[3:]


def test_a_global_batch_that_does_not_split_is_a_fatal_error_naming_the_sizes_unless_scaling_is_allowed():
    """6 samples a step on 4 ranks in micro-batches of 1: the 2 ranks with 2 samples need 2
    micro-batches, the others hold 1 sample (an uneven split needs as many micro-batches everywhere)."""
    ranks = [ResumableDistributedSampler(96, 6, r, 1, 1, seed=7) for r in range(6)]
    state = ranks[0].state_dict()  # 6 samples a step
    with pytest.raises(FatalError, match=r"checkpoint: 6 ranks x micro-batch 1 x accumulation 1; or set "
                                         r"data.world_size_change=scale_global_batch.*: the global batch of 6 "
                                         r"samples does not split over 4 ranks in micro-batches of at most 1"):
        step_samples(4, 1, 1, state)
    _, scaled = step_samples(4, 1, 1, state, keep=False)
    assert scaled[0].global_batch == 4 and scaled[0].consumed == 0


@pytest.mark.parametrize("world, named", [(3, True), (4, False), (5, True)])
def test_a_global_batch_the_world_size_does_not_divide_is_split_unevenly_with_the_same_steps(world, named):
    """16 samples a step (data.global_batch_size, or a checkpoint's 2 x 4 x 2 kept at another world
    size) on 3, 4 (from 3 ranks' 18) or 5 ranks: the first g % W ranks take one sample more, every
    rank runs as many micro-batches of at most the configured 4, and each step holds the samples
    of the uninterrupted 1-rank run's step, each once; the micro-batches weigh by their samples."""
    g = 16 if world != 4 else 18
    reference = [ResumableDistributedSampler(96, 1, 0, 4, 1, seed=7, global_batch=g)]
    if named:
        ranks = [ResumableDistributedSampler(96, world, r, 4, 1, seed=7, global_batch=g) for r in range(world)]
    else:
        state = ResumableDistributedSampler(96, 3, 0, 3, 2, seed=7).state_dict()  # 3 x 3 x 2 = 18 a step
        _, ranks = step_samples(world, 3, 2, state)
    for samplers in (reference, ranks):
        micro = [list(s) for s in samplers]
        a = samplers[0].accumulation
        assert len({s.accumulation for s in samplers}) == 1 and all(len(m) % a == 0 for m in micro)
        steps = [sorted(i for m in micro for b in m[k * a:(k + 1) * a] for i in b) for k in range(len(micro[0]) // a)]
        if samplers is reference:
            expected = steps
    assert steps == expected and len(steps) == 96 // g
    shares = [s.rank_batch for s in ranks]
    assert sum(shares) == g and max(shares) - min(shares) == 1 and shares == sorted(shares, reverse=True)
    assert all(max(len(b) for b in list(s)) <= 4 for s in ranks)
    assert sum(sum(s.micro_weights()) for s in ranks) == pytest.approx(world)
    assert ranks[0].micro_weights()[0] == pytest.approx(len(next(iter(ranks[0]))) * world / g)


def test_a_changed_configured_batch_is_the_users_choice_not_a_resize():
    state = ResumableDistributedSampler(96, 2, 0, 4, 1, seed=7).state_dict()
    _, ranks = step_samples(1, 8, 2, state)  # the user asked for 8 x 2 on one rank
    assert (ranks[0].batch_size, ranks[0].accumulation) == (8, 2)


def test_markov_data_is_deterministic_and_has_known_floor():
    a = MarkovDataset(30, 20, 50, chain_seed=1, sample_seed=1)
    b = MarkovDataset(30, 20, 50, chain_seed=1, sample_seed=1)
    assert torch.equal(a.tokens, b.tokens)
    assert a.entropy == pytest.approx(MARKOV_ENTROPY) == pytest.approx(1.75 * math.log(2))
    # every transition is one of the 4 successors of its token
    pairs = {}
    for row in a.tokens.tolist():
        for u, v in zip(row, row[1:], strict=False):
            pairs.setdefault(u, set()).add(v)
    assert max(len(s) for s in pairs.values()) <= 4
    x, y = a.__getitems__([3, 4])
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_text_data_split_and_windows(tmp_path):
    text = "hello world, " * 200
    path = tmp_path / "t.txt"
    path.write_text(text)
    bundle = build_datasets(resolve_config({"data.source": str(path), "seq_len": 8}))
    assert bundle.vocab_size == len(set(text))
    split = int(0.9 * len(text))
    assert len(bundle.train) == split - 8
    assert len(bundle.val) == (len(text) - split - 9) // 8 + 1
    x, y = bundle.train.__getitems__([0, 5])
    assert torch.equal(x[:, 1:], y[:, :-1])
    tokens, vocab, kind = encode_text("aé" * 10)
    assert kind == "character-level" and vocab == 2
    _, vocab, kind = encode_text("".join(chr(0x400 + i) for i in range(300)))
    assert (vocab, kind) == (256, "byte-level")


def test_bin_data_and_vocab_check(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    with pytest.raises(ConfigError, match="model.vocab_size=500: data.source=.* holds token id 999; "
                                          "allowed: model.vocab_size >= 1000"):
        resolve_config({"data.source": str(path), "vocab_size": 500, "seq_len": 16})
    cfg = resolve_config({"data.source": str(path), "vocab_size": 1000, "seq_len": 16})
    bundle = build_datasets(cfg)
    x, y = bundle.train.__getitems__([10])
    assert x[0].tolist() == list(range(10, 26)) and y[0].tolist() == list(range(11, 27))
    # The file changed after the config check: the run stops with FATAL, not a traceback.
    np.arange(1001, dtype=np.uint16).tofile(path)
    with pytest.raises(FatalError, match="model.vocab_size=1000: data.source=.* holds token id 1000; "
                                         "allowed: model.vocab_size >= 1001"):
        build_datasets(cfg)


def test_eval_shards_unpadded():
    parts = [eval_indices(100, 35, 2, r) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(35))
    assert (len(parts[0]), len(parts[1])) == (18, 17)


def test_token_windows_rejects_short_data():
    with pytest.raises(ValueError, match="fewer than seq_len"):
        TokenWindows(np.zeros(5, dtype=np.uint8), 8, 1)


TINY_RUN = tiny_config(None, {"train.max_steps": 2}, vocab_size=16, hidden_size=16, seq_len=8, batch_size=32)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(8, dtype=torch.long), torch.zeros(1))] * 64)


def users_pieces(n=8, stream=False, val=None):
    x = torch.zeros(n, 8, dtype=torch.long)
    return dict(model=torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Flatten(), torch.nn.Linear(32, 1)),
                train_dataset=Stream() if stream else torch.utils.data.TensorDataset(x, torch.zeros(n, 1)),
                val_dataset=val, loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))


# case: (config overrides, DDPTrainer's datasets, the one line it must stop with)
RUN_TIME_CASES = {
    "user_dataset": ({}, lambda: users_pieces(8),
                     "train_dataset: its 8 samples are fewer than one global batch of 32 samples "
                     "(data.batch_size=32 x data.gradient_accumulation_steps=1 x world size 1)"),
    "builtin_from_python": ({"dataset_size": 8}, dict,
                            "data.synthetic_size=8: fewer than one global batch of 32 samples"),
    "user_exclusions": ({"data.exclude_samples": "EX"}, lambda: users_pieces(100),
                        "data.exclude_samples='EX': sample index 500 is outside the 100 training samples; "
                        "allowed: indices 0 to 99"),
    "stream_val": ({}, lambda: users_pieces(100, val=Stream()),
                   "val_dataset: an IterableDataset cannot be sharded exactly for evaluation"),
    "stream_without_max_steps": ({"train.max_steps": 0}, lambda: users_pieces(stream=True),
                                 "train.max_steps=0: an IterableDataset train_dataset has no length"),
    "stream_rollback": ({"spike.guard": "rollback", "checkpoint.every_steps": 1}, lambda: users_pieces(stream=True),
                        "spike.guard='rollback', data.exclude_samples='': the samples of an IterableDataset have "
                        "no indices to exclude"),
}


@pytest.mark.parametrize("case", RUN_TIME_CASES)
def test_input_known_only_at_run_time_stops_with_fatal(case, tmp_path):
    """What the config check cannot see (datasets given from Python, the built-in data of a
    config given from Python) stops with one line and a FATAL marker, which a restart obeys at
    once, not with a traceback retried on every restart."""
    from framework import DDPTrainer
    from framework.resilience.markers import FATAL
    overrides, pieces, expected = RUN_TIME_CASES[case]
    (tmp_path / "ex.json").write_text("[3, 500]")
    ex = str(tmp_path / "ex.json")
    cfg = {**TINY_RUN, "logging.dir": str(tmp_path / "logs"), "checkpoint.dir": str(tmp_path / "ck"),
           **{k: ex if v == "EX" else v for k, v in overrides.items()}}
    expected = expected.replace("EX", ex)
    with pytest.raises(FatalError) as err:
        DDPTrainer(cfg, rank=0, world_size=1, **pieces())
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert expected in (tmp_path / "ck" / FATAL).read_text()


def test_a_named_global_batch_is_split_at_every_world_size_and_checked_where_it_cannot_be():
    """data.global_batch_size: a start (or a restart with no checkpoint) at any world size trains the
    same steps; a world size that does not divide it is refused at --check-config."""
    steps = {}
    for world in (1, 2, 4):
        ranks = [ResumableDistributedSampler(96, world, r, 4, 1, seed=7, global_batch=16) for r in range(world)]
        assert ranks[0].global_batch == 16 and ranks[0].batch_size <= 4
        micro = [list(s) for s in ranks]
        a = ranks[0].accumulation
        steps[world] = [sorted(i for r in range(world) for m in micro[r][k * a:(k + 1) * a] for i in m)
                        for k in range(len(micro[0]) // a)]
    assert steps[1] == steps[2] == steps[4] and len(steps[1]) == 6
    build_config({"data": {"global_batch_size": 16, "batch_size": 4}}, env={}, world_size=3)  # 6 + 5 + 5
    with pytest.raises(ConfigError, match=r"data.global_batch_size=16: does not split over world size 12 in "
                                          r"micro-batches of at most data.batch_size=1; allowed: a multiple of 12, "
                                          r"or at least 24 samples"):
        build_config({"data": {"global_batch_size": 16, "batch_size": 1}}, env={}, world_size=12)
    with pytest.raises(FatalError, match="data.global_batch_size=16: the global batch of 16 samples does not split "
                                         "over 12 ranks in micro-batches of at most 1"):
        ResumableDistributedSampler(96, 12, 0, 1, 1, global_batch=16)


def test_a_resize_stays_at_or_below_the_micro_batch_an_out_of_memory_error_left():
    """Configured 8 x 1 on 4 ranks, halved to 4 x 2 by an out-of-memory error, resumed on 2 ranks:
    4 x 4, not 8 x 2, the micro-batch that ran out of memory. A split a resize made is no cap."""
    oom = ResumableDistributedSampler(256, 4, 0, 8, 1, seed=7)
    oom.set_micro_batch(4, 2)  # what halve_micro_batch does
    _, ranks = step_samples(2, 8, 1, oom.state_dict(), n=256)
    assert (ranks[0].batch_size, ranks[0].accumulation) == (4, 4) and ranks[0].global_batch == 32
    resized = ResumableDistributedSampler(256, 4, 0, 8, 1, seed=7)
    _, ranks = step_samples(8, 8, 1, resized.state_dict(), n=256)  # 32 over 8 ranks: 4 x 1, a resize's split
    _, back = step_samples(4, 8, 1, ranks[0].state_dict(), n=256)
    assert (back[0].batch_size, back[0].accumulation) == (8, 1)
    named = ResumableDistributedSampler(256, 4, 0, 8, 1, seed=7, global_batch=32)
    named.set_micro_batch(4, 2)
    again = ResumableDistributedSampler(256, 2, 0, 8, 1, seed=7, global_batch=32)
    again.load_state_dict(named.state_dict())
    assert (again.batch_size, again.accumulation) == (4, 4)


@pytest.mark.parametrize("error, fatal", [("unsplittable", False), ("fatal", True)])
def test_an_unsplittable_global_batch_stops_without_the_fatal_marker_that_would_block_a_restart(
        tmp_path, monkeypatch, error, fatal):
    """A FATAL marker stops every later restart of the launch, also one at a world size that
    divides the global batch (the node back): the unsplittable stop records its error instead."""
    from framework import DDPTrainer
    from framework.data.sampler import GlobalBatchUnsplittable

    raised = GlobalBatchUnsplittable("the global batch of 6 samples does not split over 4 ranks") \
        if error == "unsplittable" else FatalError("a deterministic failure")

    def build_stream(*args, **kwargs):
        raise raised

    monkeypatch.setattr("framework.trainer.build_stream", build_stream)
    with pytest.raises(FatalError):
        DDPTrainer(tiny_config(tmp_path))
    assert (tmp_path / "ck" / "FATAL").exists() == fatal
    if not fatal:
        assert "does not split over 4 ranks" in (tmp_path / "ck" / "LAST_ERROR").read_text()


def test_an_uneven_split_halved_by_an_out_of_memory_error_keeps_its_global_batch_and_resumes_so():
    """An out-of-memory halving of an uneven split (16 on 3 ranks, micro-batches of up to 4) cuts
    every rank's share into micro-batches of up to 2, the same number on each; a resume on the
    same 3 ranks keeps that cap, and one on 4 ranks (16 divides) splits evenly below it."""
    from framework.train.step import halve_micro_batch

    ranks = [ResumableDistributedSampler(96, 3, r, 4, 1, seed=7, global_batch=16) for r in range(3)]
    assert [s.accumulation for s in ranks] == [2, 2, 2] and ranks[0].batch_size == 3
    for s in ranks:
        halve_micro_batch(s, "out of memory")
    assert {s.accumulation for s in ranks} == {3} and max(len(b) for s in ranks for b in list(s)) <= 2
    assert [s.rank_batch for s in ranks] == [6, 5, 5] and ranks[0].global_batch == 16
    again = ResumableDistributedSampler(96, 3, 1, 4, 1, seed=7, global_batch=16)
    again.load_state_dict(ranks[1].state_dict())
    assert list(again) == list(ranks[1])
    even = ResumableDistributedSampler(96, 4, 0, 4, 1, seed=7, global_batch=16)
    even.load_state_dict(ranks[0].state_dict())
    assert even.uneven is None and (even.batch_size, even.accumulation) == (2, 2)


def test_a_checkpoint_of_an_uneven_split_keeps_its_global_batch_at_any_later_world_size():
    """4 ranks x 4 x 2 = 32 samples a step, no data.global_batch_size; 3 ranks resume (a heal):
    11, 11 and 10 samples in 3 micro-batches of up to 4. Their checkpoint, resumed on 4 or 2
    ranks, still trains 32 samples a step (it was re-split as 3 x 4 x 3 = 36)."""
    four = ResumableDistributedSampler(96, 4, 0, 4, 2, seed=7).state_dict()
    _, three = step_samples(3, 4, 2, four)
    assert three[0].global_batch == 32 and [s.rank_batch for s in three] == [11, 11, 10]
    for world in (4, 2):
        _, again = step_samples(world, 4, 2, three[0].state_dict())
        assert again[0].global_batch == 32, world


def test_an_uneven_split_takes_the_halving_an_out_of_memory_error_recorded_and_stops_where_it_cannot_halve(
        tmp_path):
    """g=9 on 2 ranks in micro-batches of up to 5: 5 + 4 samples, one micro-batch each. An out-of-memory
    error in a synced backward halves it to micro-batches of up to 3 and records that for the
    restart, which takes it (it ignored it: 3 x 2 is not 5 x 1). Halving on to 1 leaves a share of 4
    samples fewer than the 5 micro-batches of the other: a FATAL stop (no restart can do better),
    not a stop that waits for another world size."""
    from framework.resilience import markers
    from framework.resilience.markers import WorldSizeMismatch
    from framework.train.step import apply_recorded_micro_batch, halve_micro_batch

    sampler = ResumableDistributedSampler(96, 2, 0, 5, 1, seed=7, global_batch=9)
    assert (sampler.batch_size, sampler.accumulation) == (5, 1)
    b, a = halve_micro_batch(sampler, "out of memory in the synced backward")
    markers.record_micro_batch(tmp_path, b, a, "out of memory in the synced backward")
    restarted = ResumableDistributedSampler(96, 2, 1, 5, 1, seed=7, global_batch=9)
    apply_recorded_micro_batch(restarted, tmp_path)
    assert (restarted.batch_size, restarted.accumulation) == (3, 2) == (b, a)
    halve_micro_batch(sampler, "out of memory")
    with pytest.raises(FatalError, match="cannot halve it further") as stop:
        halve_micro_batch(sampler, "out of memory")
    assert not isinstance(stop.value, WorldSizeMismatch)
