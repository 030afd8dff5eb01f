"""The resumable distributed sampler: each rank's shard of a global batch, resumable
mid-epoch, with samples excluded; the evaluation shard; peeking at the next batches."""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from ..resilience.exclusions import FILE as EXCLUDED_FILE
from ..resilience.markers import FatalError, WorldSizeMismatch
from .batches import fetch, to_device

log = logging.getLogger(__name__)


class GlobalBatchUnsplittable(WorldSizeMismatch):
    """The global batch does not split over this world size (no FATAL marker: see the base)."""


class UnevenSplit:
    """A global batch that the world size does not divide: the first ``g % W`` ranks take one
    sample more than the others, each rank's share contiguous in the step (rank r's from
    ``offset``), cut into ``accumulation`` micro-batches (the same number on every rank) of
    ``sizes`` samples, the largest at most ``max_micro_batch``. Each micro-batch's mean loss
    weighs by its samples (``weights``: size * W / g, what DDP's mean over W ranks turns into the
    global batch's mean); an even split's weights would be 1 / accumulation."""

    def __init__(self, global_batch: int, world_size: int, rank: int, max_micro_batch: int, *, why: str):
        base, rest = divmod(global_batch, world_size)
        largest = base + (rest > 0)
        self.accumulation = -(-largest // max_micro_batch)
        if base < self.accumulation:
            raise GlobalBatchUnsplittable(
                f"{why}: the global batch of {global_batch} samples does not split over {world_size} ranks in "
                f"micro-batches of at most {max_micro_batch} (the smallest share, {base} samples, is fewer than "
                f"the {self.accumulation} micro-batches of the largest); run on fewer ranks or allow a larger "
                f"data.batch_size")
        share = base + (rank < rest)
        self.offset = rank * base + min(rank, rest)
        q, r = divmod(share, self.accumulation)
        self.sizes = [q + (i < r) for i in range(self.accumulation)]
        self.micro_batch = -(-largest // self.accumulation)  # the largest micro-batch of any rank
        self.weights = [size * world_size / global_batch for size in self.sizes]
        self.global_batch = global_batch


def split_global_batch(global_batch: int, world_size: int, max_micro_batch: int, *, why: str) -> tuple[int, int]:
    """``(micro-batch, accumulation)`` that make ``global_batch`` on ``world_size`` ranks: the largest
    micro-batch up to ``max_micro_batch`` that divides each rank's share. A share that is not whole
    is GlobalBatchUnsplittable, naming the sizes and ``why`` the global batch is what it is."""
    share, rest = divmod(global_batch, world_size)
    if rest:
        raise GlobalBatchUnsplittable(f"{why}: the global batch of {global_batch} samples does not split over "
                                      f"{world_size} ranks; run on a world size that divides {global_batch}")
    micro = max(d for d in range(1, min(share, max_micro_batch) + 1) if share % d == 0)
    return micro, share // micro


class ResumableDistributedSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batches of indices.

    Each epoch draws one seeded permutation of the dataset, the same for any world size. The
    permutation is cut into global micro-batches of ``world_size * batch_size`` samples, and rank
    r takes slice r of each. An epoch covers the first ``floor(N / G) * G`` samples, G being the
    global batch per optimizer step (``world_size * batch_size * accumulation``); the rest is
    dropped. ``consumed`` counts the global samples of committed steps in the current epoch, and
    iteration starts there, so a resumed run continues at the exact sample. ``excluded`` samples
    (a loss-spike rollback's, framework/resilience/spike_guard.py) are dropped from every epoch's permutation.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, batch_size: int,
                 accumulation: int = 1, seed: int = 0, keep_global_batch: bool = True, global_batch: int = 0):
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        # The configured split, which a checkpoint records beside the live one (an out-of-memory
        # halving or a world-size change alters the live one): a resume with the same configured
        # split keeps the checkpoint's global batch (data.world_size_change=keep_global_batch).
        self.configured = (batch_size, accumulation)
        self.keep_global_batch = keep_global_batch
        # data.global_batch_size: the global batch the configuration names, split at every world size.
        self.global_batch_size = global_batch
        # The largest micro-batch known to fit in memory, once an out-of-memory error halved it
        # (set_micro_batch): a re-split at another world size stays at or below it.
        self.micro_batch_cap: int | None = None
        # A global batch that this world size does not divide (a heal, an elastic restart): UnevenSplit.
        self.uneven: UnevenSplit | None = None
        self.batch_size, self.accumulation = self._named_split(batch_size) if global_batch else (batch_size,
                                                                                                   accumulation)
        self.epoch = 0
        self.consumed = 0
        self.excluded: frozenset[int] = frozenset()
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation); exclude() clears it
        # What __iter__ handed out and the trainer has not yet committed, oldest first.
        self.delivered: collections.deque[list[int]] = collections.deque()

    @property
    def global_batch(self) -> int:
        return self.uneven.global_batch if self.uneven else self.world_size * self.batch_size * self.accumulation

    @property
    def rank_batch(self) -> int:
        """This rank's samples in a step."""
        return sum(self.uneven.sizes) if self.uneven else self.batch_size * self.accumulation

    def micro_weights(self) -> list[float] | None:
        """What each of this rank's micro-batch mean losses is multiplied by when the split is uneven
        (UnevenSplit.weights); None when it is even (each weighs 1 / accumulation)."""
        return self.uneven.weights if self.uneven else None

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
                             f"samples (from data.exclude_samples, or a rollback's {EXCLUDED_FILE} in checkpoint.dir)")
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
            if self.uneven:
                lo = base + self.uneven.offset
                for size in self.uneven.sizes:
                    batch = perm[lo:lo + size].tolist()
                    lo += size
                    self.delivered.append(batch)
                    yield batch
                continue
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

    def pending(self) -> list[int]:
        """This rank's sample indices in the step being trained: what ``advance`` will return."""
        return [i for batch in list(self.delivered)[:self.accumulation] for i in batch]

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
        """Change how a step's samples are split (the global batch must stay the same). An uneven
        split is cut again into micro-batches of at most ``batch_size`` (its accumulation follows)."""
        if self.uneven:
            self.batch_size, self.accumulation = self._split(self.uneven.global_batch, batch_size,
                                                             "an out-of-memory halving")
        else:
            assert batch_size * accumulation == self.batch_size * self.accumulation, (batch_size, accumulation)
            self.batch_size, self.accumulation = batch_size, accumulation
        self.micro_batch_cap = min(batch_size, self.micro_batch_cap or batch_size)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "batch_size": self.batch_size,
                "accumulation": self.accumulation, "world_size": self.world_size, "global_batch": self.global_batch,
                "num_samples": self.num_samples, "seed": self.seed, "configured": list(self.configured),
                "micro_batch_cap": self.micro_batch_cap}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved sample (a global sample offset in the epoch, valid at any world
        size: the permutation does not depend on it).

        The step's split: the saved one (an out-of-memory error may have halved the micro-batch)
        when the world size and the configured split are the checkpoint's. When only the world size
        changed, ``keep_global_batch`` keeps the checkpoint's global batch, so that the run's steps,
        their samples and the schedule stay those of an uninterrupted run (``resize``); otherwise
        the configured split applies at the new world size (the global batch changes with it).
        A change of batch_size or gradient_accumulation_steps in the configuration is the user's:
        the configured split applies."""
        for key in ("num_samples", "seed"):
            if key in state and int(state[key]) != getattr(self, key):
                name = "train.seed" if key == "seed" else key  # the configuration key that sets it
                raise ValueError(f"the checkpoint's data order was drawn with {name}={state[key]}, this run has "
                                 f"{getattr(self, key)}: its sample position does not apply")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        cap = state.get("micro_batch_cap")
        self.micro_batch_cap = None if cap is None else int(cap)
        if "batch_size" not in state:
            return
        b, a, world = int(state["batch_size"]), int(state["accumulation"]), int(state["world_size"])
        if self.global_batch_size:  # the configuration's global batch, split for this world size
            if world == self.world_size and world * b * a == self.global_batch_size:
                self.batch_size, self.accumulation = b, a  # the saved split (an out-of-memory halving's)
            elif self.micro_batch_cap and self.micro_batch_cap < self.batch_size:
                self.batch_size, self.accumulation = self._named_split(self.micro_batch_cap)
            return
        configured = tuple(int(x) for x in state.get("configured", (b, a)))
        same_config = configured == self.configured or (
            "configured" not in state and b * a == self.configured[0] * self.configured[1])
        saved = int(state.get("global_batch", world * b * a))  # an uneven split's is not world x b x a
        if world == self.world_size:
            if same_config and saved != world * b * a:
                self.batch_size, self.accumulation = self._split(saved, b, "the checkpoint's split")
            elif same_config:
                self.batch_size, self.accumulation = b, a
        elif same_config and self.keep_global_batch:
            self.resize(saved, saved=f"{world} ranks x micro-batch {b} x accumulation {a}" if saved == world * b * a
                        else f"{world} ranks with uneven shares, micro-batches of up to {b} x accumulation {a}")

    def _named_split(self, max_micro_batch: int) -> tuple[int, int]:
        """data.global_batch_size split over this world size (unevenly where it does not divide)."""
        return self._split(self.global_batch_size, max_micro_batch,
                           f"data.global_batch_size={self.global_batch_size}")

    def _split(self, global_batch: int, max_micro_batch: int, why: str) -> tuple[int, int]:
        """``(micro-batch, accumulation)`` of ``global_batch`` over this world size: even
        (``split_global_batch``) where it divides, else an UnevenSplit (kept in ``uneven``; its
        micro-batch is the largest of any rank's)."""
        if global_batch % self.world_size == 0:
            self.uneven = None
            return split_global_batch(global_batch, self.world_size, max_micro_batch, why=why)
        self.uneven = UnevenSplit(global_batch, self.world_size, self.rank, max_micro_batch, why=why)
        return self.uneven.micro_batch, self.uneven.accumulation

    def resize(self, global_batch: int, saved: str) -> None:
        """Split ``global_batch`` over this world size (``split_global_batch``), with micro-batches
        no larger than the configured one, nor than ``micro_batch_cap``."""
        limit = min(self.configured[0], self.micro_batch_cap or self.configured[0])
        why = (f"data.world_size_change=keep_global_batch (checkpoint: {saved}; or set "
               f"data.world_size_change=scale_global_batch to train on with {self.world_size} x "
               f"{self.configured[0]} x {self.configured[1]} samples a step, a run that differs from an "
               f"uninterrupted one)")
        micro, self.accumulation = self._split(global_batch, limit, why)
        self.batch_size = micro
        log.warning("world size changed (checkpoint: %s = %d samples a step): %s keep the global batch, so the "
                    "steps, their samples and the schedule are the uninterrupted run's", saved, global_batch,
                    self.describe())

    def describe(self) -> str:
        """How a step's global batch is split: "2 ranks x micro-batch 4 x accumulation 2", or for an
        uneven split "2 ranks with 5 or 4 samples each (micro-batches of up to 3 x accumulation 2)"."""
        if not self.uneven:
            return f"{self.world_size} ranks x micro-batch {self.batch_size} x accumulation {self.accumulation}"
        base = self.global_batch // self.world_size
        return (f"{self.world_size} ranks with {base + 1} or {base} samples each (micro-batches of up to "
                f"{self.batch_size} x accumulation {self.accumulation}, each weighted by its samples)")

def peek_batches(sampler: ResumableDistributedSampler, dataset: Dataset, n: int, device: torch.device) -> list:
    """This rank's next ``n`` micro-batches on ``device``, read without consuming them."""
    indices = list(itertools.islice(iter(sampler), n))
    sampler.delivered.clear()
    return [to_device(fetch(dataset, batch), device) for batch in indices]


def eval_indices(num_samples: int, limit: int, world_size: int, rank: int) -> list[int]:
    """This rank's unpadded shard of the first ``limit`` validation samples."""
    return list(range(min(num_samples, limit)))[rank::world_size]
