"""Streaming data: a ``torch.utils.data.IterableDataset``, read by each rank from its own shard.

- Sharding: a dataset with ``set_shard(rank, world_size)`` is told its rank once; otherwise it
  must read only its rank's share itself (``torch.distributed.get_rank()``, or RANK and
  WORLD_SIZE, combined with ``get_worker_info`` if it runs in worker processes).
- An epoch ends, on every rank at the same step, as soon as any rank runs out: before each step
  one small all-reduce agrees on it, so no rank waits forever in DDP's all-reduce for a rank
  that has no batch. The end of the epoch is known only then, one read after its last step: the
  epoch's checkpoint (``save_interval``) is written at that moment, and resumes at the next epoch.
- Resume: a dataset with ``state_dict()``/``load_state_dict()`` (the torchdata ``Stateful``
  protocol, its ``__iter__`` continuing from the loaded state) is checkpointed and resumes
  exactly. Batches are read in the main process (no workers), so its state at a step boundary is
  that of the committed steps. Without a state, a resumed epoch re-reads the stream from its
  start and drops as many samples as were committed: exact for a deterministic stream,
  approximate otherwise, as the log says once.
- The number of steps is unknown in advance: ``max_steps`` must be set.
"""

from __future__ import annotations

import collections
import itertools
import logging

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from ..resilience.markers import FatalError, WorldSizeMismatch
from .batches import to_device

log = logging.getLogger(__name__)


class StreamPosition:
    """Where a stream stands: the epoch and the global samples committed in it. It stands in for
    the map-style sampler wherever the trainer asks about the data's progress."""

    num_samples = None
    steps_per_epoch = 0
    uneven = None  # a stream's split is always even (see ResumableDistributedSampler.uneven)

    def __init__(self, world_size: int, batch_size: int, accumulation: int):
        self.world_size, self.batch_size, self.accumulation = world_size, batch_size, accumulation
        self.epoch = self.consumed = 0
        self.exhausted = False
        self.delivered: collections.deque = collections.deque()

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size * self.accumulation

    def steps_remaining(self) -> int:
        """Unknown: 1 until the stream runs out (agreed by every rank)."""
        return 0 if self.exhausted else 1

    def epochs_done(self) -> float:
        return float(self.epoch)

    def micro_weights(self) -> None:
        return None

    def last_step(self, step: int, cfg) -> int:
        if not cfg.train.max_steps:
            raise ValueError("train.max_steps: an IterableDataset has no length, so the run needs train.max_steps > 0")
        return cfg.train.max_steps

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed, self.exhausted = epoch, 0, False

    def pending(self) -> list[int]:
        return []  # a stream's samples have no indices

    def advance(self) -> list[int]:
        self.consumed += self.global_batch
        return []

    def set_micro_batch(self, batch_size: int, accumulation: int) -> None:
        raise FatalError("out-of-memory recovery halves the micro-batch by re-reading the step's samples, which a "
                         "stream cannot do: lower batch_size, or use a map-style dataset")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "world_size": self.world_size,
                "exhausted": self.exhausted}

    def load_state_dict(self, state: dict) -> None:
        if int(state["world_size"]) != self.world_size:
            raise WorldSizeMismatch(f"a stream's shards depend on the world size: saved with {state['world_size']} "
                                    f"ranks, resumed on {self.world_size}; resume it on {state['world_size']}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        # Saved once the stream ran out: the epoch is done, and a resume starts the next one.
        self.exhausted = bool(state.get("exhausted", False))


class IterableStream:
    """The micro-batches of each step from an IterableDataset (the interface of loader.BatchStream)."""

    restarts_this_epoch = 0

    def __init__(self, dataset: IterableDataset, position: StreamPosition, *, device: torch.device,
                 distributed: bool, rank: int):
        if hasattr(dataset, "set_shard"):
            dataset.set_shard(rank, position.world_size)
        self.dataset, self.position = dataset, position
        self.device, self.distributed, self.rank = device, distributed, rank
        self.stateful = hasattr(dataset, "state_dict") and hasattr(dataset, "load_state_dict")
        # A generator of its own: each iter() draws a base seed from it, not from the global random
        # state that a checkpoint restores (a resume's first iter() would shift dropout's draws).
        self.loader = DataLoader(dataset, batch_size=position.batch_size, num_workers=0, generator=torch.Generator())
        self._it = None
        self._skip = 0  # samples to drop on a resumed epoch of a stream without a state

    def start_epoch(self) -> None:
        self._it = iter(self.loader)
        if self._skip:
            dropped = sum(1 for _ in itertools.islice(self._it, self._skip // self.position.batch_size))
            log.warning("resumed a stream without state_dict(): re-read and dropped %d batches of this epoch; "
                        "exact only if the stream is deterministic", dropped)
            self._skip = 0

    def next_step(self) -> list | None:
        """The step's micro-batches, or None on every rank once any rank has run out."""
        micro = list(itertools.islice(self._it, self.position.accumulation))
        ran_out = torch.tensor([float(len(micro) < self.position.accumulation)], device=self.device)
        if self.distributed:
            dist.all_reduce(ran_out, op=dist.ReduceOp.MAX)
        if ran_out.item():
            self.position.exhausted = True
            return None
        return micro

    def peek(self, n: int, device: torch.device) -> list:
        """``n`` micro-batches for the DDP preflight; the stream's position is left as it was. At
        the end of a pass (a run resumed from a checkpoint written after its epoch's last step),
        they come from the start of the next pass, as the loop's next batches will."""
        saved = self.dataset.state_dict() if self.stateful else None
        batches = list(itertools.islice(iter(self.loader), n))
        if len(batches) < n:
            batches += itertools.islice(iter(self.loader), n - len(batches))
        batches = [to_device(b, device) for b in batches]
        if saved is not None:
            self.dataset.load_state_dict(saved)
        return batches

    def refetch_step(self) -> list:
        raise FatalError("a stream cannot re-read a step")

    def kill_a_worker(self) -> None:
        log.warning("fault injection: kill_worker, but a stream is read without DataLoader workers")

    def state_dict(self) -> dict:
        """Every rank's dataset state, in rank order (a collective: each rank reads its own shard)."""
        if not self.stateful:
            return {}
        mine = self.dataset.state_dict()
        if not self.distributed:
            return {"datasets": [mine]}
        states: list = [None] * self.position.world_size
        dist.all_gather_object(states, mine)
        return {"datasets": states}

    def load_state_dict(self, state: dict) -> None:
        if self.stateful:
            self.dataset.load_state_dict(state["datasets"][self.rank])
        elif not self.position.exhausted:  # (the position is loaded first)
            self._skip = self.position.consumed // self.position.world_size

    def shutdown(self) -> None:
        self._it = None
