"""Data: the built-in datasets, a resumable distributed batch sampler, and the DataLoader.

Datasets yield ``(x, y)`` pairs of token ids, ``y`` being ``x`` shifted by one. They implement
``__getitems__`` so a whole micro-batch is gathered in one vectorised read.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from .batches import to_device
from .config import data_file_problems, split_tokens, training_set_problems
from .control import spread
from .exclusions import FILE as EXCLUDED_FILE
from .markers import FatalError

log = logging.getLogger(__name__)

# The synthetic chain: every token has 4 possible successors with these probabilities, so the
# entropy of the next token given the current one, the floor of the loss, is exactly known.
MARKOV_PROBS = (0.5, 0.25, 0.125, 0.125)
MARKOV_ENTROPY = -sum(p * math.log(p) for p in MARKOV_PROBS)  # 1.2130 nats = 1.75 bits


class MarkovDataset(Dataset):
    """``n`` sequences of ``seq_len + 1`` tokens sampled from a fixed random first-order Markov
    chain over ``vocab_size`` tokens. ``chain_seed`` fixes the chain, ``sample_seed`` the
    sequences, so a validation set comes from the same chain with a different sample seed."""

    def __init__(self, vocab_size: int, seq_len: int, n: int, chain_seed: int, sample_seed: int):
        k = min(len(MARKOV_PROBS), vocab_size)
        probs = np.array(MARKOV_PROBS[:k]) / sum(MARKOV_PROBS[:k])
        chain_rng = np.random.default_rng([chain_seed, 0])
        successors = np.stack([chain_rng.choice(vocab_size, k, replace=False) for _ in range(vocab_size)])
        rng = np.random.default_rng([chain_seed, sample_seed])
        tokens = np.empty((n, seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, vocab_size, n)
        cum = np.cumsum(probs)
        for t in range(1, seq_len + 1):
            choice = np.minimum(np.searchsorted(cum, rng.random(n), side="right"), k - 1)
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        self.tokens = torch.from_numpy(tokens)
        self.entropy = -float(np.sum(probs * np.log(probs)))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int):
        row = self.tokens[i]
        return row[:-1], row[1:]

    def __getitems__(self, indices: list[int]):
        rows = self.tokens[indices]
        return rows[:, :-1], rows[:, 1:]


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens over a 1-D token array, starting every ``stride`` tokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int, stride: int):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens are fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride
        self._offsets = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def __getitems__(self, indices: list[int]):
        starts = np.asarray(indices, dtype=np.int64) * self.stride
        rows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def __getitem__(self, i: int):
        x, y = self.__getitems__([i])
        return x[0], y[0]


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    vocab_size: int
    description: str
    loss_floor: float | None = None


def encode_text(text: str) -> tuple[np.ndarray, int, str]:
    """Character-level ids when the text has at most 256 distinct characters, else UTF-8 bytes."""
    chars = sorted(set(text))
    if len(chars) <= 256:
        lookup = {c: i for i, c in enumerate(chars)}
        return np.array([lookup[c] for c in text], dtype=np.uint8), len(chars), "character-level"
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8), 256, "byte-level"


def build_datasets(cfg) -> DataBundle:
    """The datasets named by ``cfg.data.source``: 'synthetic', a .txt file or a .bin uint16 token file."""
    if cfg.data.source == "synthetic":
        size, seed = cfg.data.synthetic_size, cfg.train.seed
        train = MarkovDataset(cfg.model.vocab_size, cfg.model.seq_len, size, seed, 1)
        val = MarkovDataset(cfg.model.vocab_size, cfg.model.seq_len, max(1, size // 10), seed, 2)
        return DataBundle(train, val, cfg.model.vocab_size,
                          f"synthetic Markov chain: {len(train)} train / {len(val)} val sequences, "
                          f"loss floor {train.entropy:.4f} nats/token", train.entropy)
    problems = data_file_problems(cfg)  # the config check's, cached: a file changed since then
    if problems:
        raise FatalError("; ".join(problems))
    path = Path(cfg.data.source)
    if path.suffix == ".txt":
        tokens, vocab_size, kind = encode_text(path.read_text(encoding="utf-8"))
    else:
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        vocab_size, kind = cfg.model.vocab_size, "uint16 tokens"
    split = split_tokens(len(tokens))
    train = TokenWindows(tokens[:split], cfg.model.seq_len, stride=1)
    val = TokenWindows(tokens[split:], cfg.model.seq_len, stride=cfg.model.seq_len)
    return DataBundle(train, val, vocab_size,
                      f"{path.name} ({kind}, vocab {vocab_size}): {split} train / "
                      f"{len(tokens) - split} val tokens, {len(train)} train windows")


def builtin_datasets(cfg):
    """``(cfg, train, val)`` for the built-in data, with vocab_size taken from the data."""
    bundle = build_datasets(cfg)
    if bundle.vocab_size != cfg.model.vocab_size:
        log.info("vocab_size set to %d from the data", bundle.vocab_size)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=bundle.vocab_size))
    log.info("data: %s", bundle.description)
    if bundle.loss_floor is not None and cfg.train.target_loss and cfg.train.target_loss < bundle.loss_floor:
        log.warning("target_loss=%g is below this data's loss floor %.4f: it cannot stop the run",
                    cfg.train.target_loss, bundle.loss_floor)
    return cfg, bundle.train, bundle.val


class ResumableDistributedSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batches of indices.

    Each epoch draws one seeded permutation of the dataset, the same for any world size. The
    permutation is cut into global micro-batches of ``world_size * batch_size`` samples, and rank
    r takes slice r of each. An epoch covers the first ``floor(N / G) * G`` samples, G being the
    global batch per optimizer step (``world_size * batch_size * accumulation``); the rest is
    dropped. ``consumed`` counts the global samples of committed steps in the current epoch, and
    iteration starts there, so a resumed run continues at the exact sample. ``excluded`` samples
    (a loss-spike rollback's, framework/spike.py) are dropped from every epoch's permutation.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, batch_size: int,
                 accumulation: int = 1, seed: int = 0):
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.seed = seed
        self.epoch = 0
        self.consumed = 0
        self.excluded: frozenset[int] = frozenset()
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation); exclude() clears it
        # What __iter__ handed out and the trainer has not yet committed, oldest first.
        self.delivered: collections.deque[list[int]] = collections.deque()

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size * self.accumulation

    @property
    def epoch_samples(self) -> int:
        return self.num_samples - len(self.excluded)

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_samples // self.global_batch

    def steps_remaining(self) -> int:
        return max(0, (self.epoch_samples - self.consumed) // self.global_batch)

    def permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            seed = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1, np.uint64)[0] >> 1)
            perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(seed))
            if self.excluded:
                keep = torch.ones(self.num_samples, dtype=torch.bool)
                keep[torch.tensor(sorted(self.excluded))] = False
                perm = perm[keep[perm]]
            self._perm = (epoch, perm)
        return self._perm[1]

    def exclude(self, indices) -> None:
        """Drop these samples from every epoch's permutation. Those of the current epoch that are
        still to come shift forward; the committed prefix is unchanged as long as no excluded
        sample lies in it (a rollback excludes only samples after its checkpoint, which is of the
        same epoch: see Checkpointer.roll_back)."""
        bad = sorted(i for i in indices if not 0 <= i < self.num_samples)
        if bad:
            raise FatalError(f"excluded sample indices {bad[:5]} are outside the training set of {self.num_samples} "
                             f"samples (from exclude_samples, or a rollback's {EXCLUDED_FILE} in checkpoint_dir)")
        excluded = frozenset(self.excluded | set(indices))
        if self.num_samples - len(excluded) < self.global_batch:
            raise FatalError(f"excluding {len(excluded)} of the {self.num_samples} training samples leaves fewer "
                             f"than one global batch of {self.global_batch} samples")
        if excluded != self.excluded:
            self.excluded, self._perm = excluded, None

    def last_step_samples(self) -> list[int]:
        """The global sample indices of the last committed step (every rank computes the same)."""
        return self.permutation(self.epoch)[self.consumed - self.global_batch:self.consumed].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.permutation(self.epoch)
        micro = self.world_size * self.batch_size
        start = self.consumed
        self.delivered.clear()
        for step in range(self.steps_remaining()):
            base = start + step * self.global_batch
            for m in range(self.accumulation):
                lo = base + m * micro + self.rank * self.batch_size
                batch = perm[lo:lo + self.batch_size].tolist()
                self.delivered.append(batch)
                yield batch

    def __len__(self) -> int:
        return self.steps_remaining() * self.accumulation

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.consumed = 0

    def advance(self) -> list[int]:
        """Record one committed optimizer step; returns this rank's sample indices in it."""
        self.consumed += self.global_batch
        taken = [self.delivered.popleft() for _ in range(min(self.accumulation, len(self.delivered)))]
        return [i for batch in taken for i in batch]

    def epochs_done(self) -> float:
        return self.epoch + self.consumed / (self.steps_per_epoch * self.global_batch)

    def last_step(self, step: int, cfg) -> int:
        """The run's last step, from ``step`` where it stands now (a resume on another world size
        or batch size has another number of steps left in its epochs), capped by max_steps."""
        by_epochs = step + self.steps_remaining() + max(0, cfg.train.num_epochs - self.epoch - 1) * self.steps_per_epoch
        return min(cfg.train.max_steps, by_epochs) if cfg.train.max_steps else by_epochs

    def set_micro_batch(self, batch_size: int, accumulation: int) -> None:
        """Change how a step's samples are split (the global batch must stay the same)."""
        assert batch_size * accumulation == self.batch_size * self.accumulation, (batch_size, accumulation)
        self.batch_size, self.accumulation = batch_size, accumulation

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "batch_size": self.batch_size,
                "accumulation": self.accumulation, "world_size": self.world_size,
                "num_samples": self.num_samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved sample. The saved micro-batch split (an out-of-memory error may
        have halved it) is kept when the world size and the per-rank batch are the configured
        ones; otherwise the configured split applies and the position is a global sample offset."""
        for key in ("num_samples", "seed"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(f"the checkpoint's data order was drawn with {key}={state[key]}, this run has "
                                 f"{getattr(self, key)}: its sample position does not apply")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        if "batch_size" not in state or int(state["world_size"]) != self.world_size:
            return
        b, a = int(state["batch_size"]), int(state["accumulation"])
        if b * a == self.batch_size * self.accumulation:
            self.batch_size, self.accumulation = b, a


def check_datasets(dataset, val_dataset, cfg, world_size: int) -> None:
    """What the config check (framework/config.py) cannot see: the datasets a run was given from
    Python. A map-style training set must hold one global batch, also without exclude_samples;
    a stream needs max_steps and has no sample indices to exclude; evaluation needs a map-style
    set. Raises FatalError: a restart would only fail the same way."""
    if isinstance(val_dataset, torch.utils.data.IterableDataset):
        raise FatalError("val_dataset: an IterableDataset cannot be sharded exactly for evaluation; "
                         "allowed: a map-style dataset, or None")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        if not cfg.train.max_steps:
            raise FatalError("train.max_steps=0: an IterableDataset train_dataset has no length, so the run needs an "
                             "end; allowed: train.max_steps > 0")
        if cfg.spike.guard == "rollback" or cfg.data.exclude_samples:
            raise FatalError(f"spike.guard={cfg.spike.guard!r}, data.exclude_samples={cfg.data.exclude_samples!r}: "
                             "the samples of an IterableDataset have no indices to exclude; allowed with a stream: "
                             "spike.guard=off or warn, and no data.exclude_samples")
        return
    n = len(dataset)
    if isinstance(dataset, MarkovDataset):
        head, count, allowed = f"data.synthetic_size={cfg.data.synthetic_size}", "", "data.synthetic_size >= {need}"
    elif isinstance(dataset, TokenWindows):
        head, count, allowed = f"data.source={cfg.data.source!r}", f"its {n} training windows are ", "a longer file"
    else:
        head, count, allowed = "train_dataset", f"its {n} samples are ", "a dataset of at least {need} samples"
    problems = training_set_problems(cfg, n, world_size, head=head, count=count, allowed=allowed)
    if problems:
        raise FatalError(problems[0])


def check_same_datasets(train: Dataset, val: Dataset | None) -> None:
    """Ranks with datasets of different lengths would wait for each other forever in the last
    steps; one all-reduce at start turns that into the same error on every rank."""
    differ = spread({"train_dataset length": len(train) if hasattr(train, "__len__") else -1,
                     "val_dataset length (-1: none)": -1 if val is None else len(val)})
    if differ:
        raise FatalError("the ranks hold different datasets: " + "; ".join(
            f"{name} ranges from {lo:.0f} to {hi:.0f}" for name, (lo, hi) in differ.items())
            + ". Every rank must pass the same dataset; the sampler gives each rank its shard")


def peek_batches(sampler: ResumableDistributedSampler, dataset: Dataset, n: int, device: torch.device) -> list:
    """This rank's next ``n`` micro-batches on ``device``, read without consuming them."""
    indices = list(itertools.islice(iter(sampler), n))
    sampler.delivered.clear()
    return [to_device(fetch(dataset, batch), device) for batch in indices]


def eval_indices(num_samples: int, limit: int, world_size: int, rank: int) -> list[int]:
    """This rank's unpadded shard of the first ``limit`` validation samples."""
    return list(range(min(num_samples, limit)))[rank::world_size]


def workers_per_rank(requested: int, local_world_size: int) -> int:
    """Scale the node's workers down by the local ranks, leaving each rank one core of its own;
    at least one when any were asked for."""
    if requested == 0:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(requested, cores // local_world_size - 1))


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _passthrough(batch):
    return batch


def make_loader(dataset: Dataset, batch_sampler, *, num_workers: int, pin_memory: bool,
                seed: int, timeout_s: float = 120.0) -> DataLoader:
    collate = _passthrough if hasattr(dataset, "__getitems__") else default_collate
    extra = {}
    if num_workers > 0:
        extra = dict(persistent_workers=True, timeout=timeout_s, worker_init_fn=_seed_worker, prefetch_factor=2)
    # A generator of its own even without workers: every iter() draws a base seed, and drawing it
    # from the global RNG would shift the dropout stream of a resumed run.
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers, pin_memory=pin_memory,
                      collate_fn=collate, generator=torch.Generator().manual_seed(seed), **extra)


def fetch(dataset: Dataset, indices: list[int]):
    """One batch read directly (no worker processes), as the loader would collate it."""
    if hasattr(dataset, "__getitems__"):
        return dataset.__getitems__(indices)
    return default_collate([dataset[i] for i in indices])
