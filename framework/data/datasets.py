"""The built-in datasets (a Markov chain, a text file's token windows) and the checks of a
user's datasets.

Datasets yield ``(x, y)`` pairs of token ids, ``y`` being ``x`` shifted by one. They implement
``__getitems__`` so a whole micro-batch is gathered in one vectorised read.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import TrainSection, data_file_problems, split_tokens, training_set_problems
from ..resilience.markers import FatalError
from ..train.agreement import spread

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
    target = cfg.train.target_loss
    # The default (0.01, the original spec's) is below every real loss: it is a safety stop, not a
    # request, so only a target the user chose is worth a warning.
    if bundle.loss_floor is not None and target and target < bundle.loss_floor and target != TrainSection().target_loss:
        log.warning("train.target_loss=%g is below this data's loss floor %.4f: it cannot stop the run",
                    target, bundle.loss_floor)
    return cfg, bundle.train, bundle.val


def check_datasets(dataset, val_dataset, cfg, world_size: int) -> None:
    """What the config check (framework/config/checks.py) cannot see: the datasets a run was given from
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
