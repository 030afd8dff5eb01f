"""The DataLoader, and the stream of micro-batches, one optimizer step at a time, that survives DataLoader workers
dying or timing out.

PyTorch's SIGCHLD handler raises a worker's death at whatever bytecode the main thread happens
to run, even in the optimizer step. This module replaces it with one that only sets a flag,
or raises while the main thread is fetching a batch; the stream then rebuilds the loader and
continues at the first sample not yet committed (the sampler's ``consumed``). A worker that
died while nothing was fetched (between epochs) is found when the next pass over the loader
starts; shutdown gives the previous SIGCHLD handler back.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import traceback
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from ..config import AUTO
from .datasets import MarkovDataset, TokenWindows, check_datasets
from .iterable_stream import IterableStream, StreamPosition
from .sampler import ResumableDistributedSampler, peek_batches, split_global_batch

log = logging.getLogger(__name__)


AUTO_WORKERS = 4
"""data.num_workers=auto's most workers per rank."""


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def workers_per_rank(requested: int, local_world_size: int) -> int:
    """Cap ``requested`` by the cores left after one per local rank, at least one when any were
    asked for; ``AUTO`` asks for up to AUTO_WORKERS of those cores, none when none are left (a
    worker would only take its turn on a core a training process needs)."""
    spare = _cores() // local_world_size - 1
    if requested == AUTO:
        return max(0, min(AUTO_WORKERS, spare))
    if requested == 0:
        return 0
    return max(1, min(requested, spare))


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



class LoaderFailure(RuntimeError):
    """A DataLoader worker died, or a fetch timed out."""


_NOT_INSTALLED = object()

# Where an error receiving a batch from a worker is raised: the queue, the connection and the
# shared-memory handles of multiprocessing, and torch's storage reductions.
_TRANSPORT_FILES = tuple(os.path.join(*parts) for parts in (
    ("multiprocessing", "connection.py"), ("multiprocessing", "resource_sharer.py"),
    ("multiprocessing", "reduction.py"), ("multiprocessing", "queues.py"),
    ("torch", "multiprocessing", "reductions.py")))
_RERAISE_FILE = os.path.join("torch", "_utils.py")

# The messages of the errors DataLoader raises for a dead or stuck worker.
_LOADER_ERRORS = ("DataLoader worker", "DataLoader timed out", "exited unexpectedly")


class BatchStream:
    def __init__(self, make_loader: Callable[[], DataLoader], sampler, *, max_restarts: int):
        self.make_loader = make_loader
        self.sampler = sampler
        self.max_restarts = max_restarts
        self.restarts_this_epoch = 0
        self.loader = make_loader()
        self._it = None
        self._child_exited = False
        self._fetching = False
        self._previous_sigchld = _NOT_INSTALLED  # the handler ours replaced, given back at shutdown

    # --- workers -----------------------------------------------------------------------------
    def worker_pids(self) -> list[int]:
        workers = getattr(self._it, "_workers", None) or []  # DataLoader keeps them privately
        return [w.pid for w in workers if w.pid is not None]

    def _dead_workers(self) -> list[int]:
        workers = getattr(self._it, "_workers", None) or []
        return [w.pid for w in workers if not w.is_alive()]

    def _on_sigchld(self, signum, frame) -> None:
        self._child_exited = True
        if self._fetching and self._dead_workers():
            raise LoaderFailure(f"DataLoader worker(s) {self._dead_workers()} died")

    def _install_sigchld_handler(self) -> None:
        if self.loader.num_workers > 0 and hasattr(signal, "SIGCHLD"):
            current = signal.getsignal(signal.SIGCHLD)
            if current != self._on_sigchld:
                self._previous_sigchld = signal.SIG_DFL if current is None else current  # None: set outside Python
                signal.signal(signal.SIGCHLD, self._on_sigchld)

    def _restore_sigchld_handler(self) -> None:
        if self._previous_sigchld is _NOT_INSTALLED:
            return
        # Another stream's handler installed since stays: that stream gives ours back at its shutdown.
        if signal.getsignal(signal.SIGCHLD) == self._on_sigchld:
            signal.signal(signal.SIGCHLD, self._previous_sigchld)
        self._previous_sigchld = _NOT_INSTALLED

    # --- iteration ---------------------------------------------------------------------------
    def start_epoch(self) -> None:
        """Iterate the sampler's epoch from its first uncommitted sample; a new epoch gets a new
        restart budget, a resumed one keeps what it had used."""
        if self.sampler.consumed == 0:
            self.restarts_this_epoch = 0
        self._recovering(self._open)

    def _open(self) -> None:
        """A new pass over the loader from the sampler's ``consumed`` sample. Persistent workers
        are reused, so one that died since the last batch (after the epoch's last step, say) is
        found here: PyTorch would wait timeout_s for its reply."""
        self._fetching = True  # a worker dying from here on raises in the SIGCHLD handler
        try:
            self._raise_if_a_worker_died()
            self.sampler.delivered.clear()
            self._it = iter(self.loader)
        finally:
            self._fetching = False
        self._install_sigchld_handler()

    def _raise_if_a_worker_died(self) -> None:
        self._child_exited = False
        dead = self._dead_workers()
        if dead:
            raise LoaderFailure(f"DataLoader worker(s) {dead} died")

    def _recovering(self, action: Callable[[], list | None]):
        """``action()``, rebuilding the loader after a dead or stuck worker and trying again."""
        while True:
            try:
                return action()
            except LoaderFailure as err:
                self.restart(str(err))
            except RuntimeError as err:
                # "Caught ValueError in DataLoader worker process 0": the dataset's own error, which
                # a rebuilt loader would only raise again.
                if str(err).startswith("Caught ") or not any(text in str(err) for text in _LOADER_ERRORS):
                    raise
                self.restart(str(err).splitlines()[0])
            except (OSError, EOFError) as err:
                if not self._broken_transport(err):
                    raise
                what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                self.restart(f"receiving a batch from a DataLoader worker failed ({what})")

    def _broken_transport(self, err: BaseException) -> bool:
        """Whether an OSError or EOFError came from the pipe between the workers and this process,
        judged by where it was raised, not by its message. A batch's tensors come over a socket
        from the worker that made them: a worker SIGKILLed after it queued a batch resets that
        socket, and the error reaches here before the worker's death is visible to DataLoader's
        own check (which then re-raises it as it is). A dataset's own error (also collate_fn's,
        worker_init_fn's) is re-raised through ExceptionWrapper.reraise; forking workers fails
        elsewhere (popen_fork): neither is retried."""
        if self.loader.num_workers == 0:
            return False
        frames = traceback.extract_tb(err.__traceback__)
        if not frames or any(f.name == "reraise" and f.filename.endswith(_RERAISE_FILE) for f in frames):
            return False
        return frames[-1].filename.endswith(_TRANSPORT_FILES)

    def restart(self, reason: str) -> None:
        """Drop the current loader (and its workers); the next fetch continues at the first
        uncommitted sample."""
        self._fetching = False
        self.restarts_this_epoch += 1
        if self.restarts_this_epoch > self.max_restarts:
            raise LoaderFailure(f"{reason}; more than recovery.max_loader_restarts={self.max_restarts} loader restarts "
                                f"in epoch {self.sampler.epoch}")
        log.warning("%s: rebuilding the DataLoader (restart %d of %d this epoch), continuing at sample %d of "
                    "epoch %d", reason, self.restarts_this_epoch, self.max_restarts, self.sampler.consumed,
                    self.sampler.epoch)
        self._replace_loader()

    def _replace_loader(self) -> None:
        """Shut the workers down and build a new loader: a DataLoader with persistent workers keeps
        its shut-down iterator and would hand it out again."""
        self._close_iterator()
        self.loader = self.make_loader()

    def next_step(self) -> list:
        """The micro-batches of the next optimizer step (``sampler.accumulation`` of them)."""
        return self._recovering(self._fetch_step)

    def _fetch_step(self) -> list:
        if self._it is None:
            self._open()
        self._fetching = True
        try:
            # Checked before every fetch, not only after our SIGCHLD handler ran: PyTorch installs its
            # own handler once per process and chains to whichever handler it found then, which in a
            # process that ran an earlier stream may not be this one's (a 2-rank run hung here for the
            # DataLoader's whole timeout). A waitpid per worker costs microseconds.
            self._raise_if_a_worker_died()
            return [next(self._it) for _ in range(self.sampler.accumulation)]
        finally:
            self._fetching = False

    def rewind(self) -> None:
        """Continue at the sampler's position after a rollback restored an earlier one."""
        self._replace_loader()
        self._recovering(self._open)

    def refetch_step(self) -> list:
        """Rebuild the iterator at the first uncommitted sample (after the micro-batch size
        changed) and return the step's micro-batches again."""
        self._recovering(self._open)
        return self.next_step()

    def kill_a_worker(self) -> int | None:
        """Fault injection: SIGKILL this rank's first DataLoader worker."""
        pids = self.worker_pids()
        if not pids:
            log.warning("fault injection: kill_worker, but this rank has no DataLoader workers")
            return None
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def peek(self, n: int, device) -> list:
        """This rank's next ``n`` micro-batches on ``device``, read without consuming them."""
        return peek_batches(self.sampler, self.loader.dataset, n, device)

    def state_dict(self) -> dict:
        return {"restarts_this_epoch": self.restarts_this_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.restarts_this_epoch = int(state["restarts_this_epoch"])

    def _close_iterator(self) -> None:
        self._fetching = False  # the workers' exits below must not raise in the SIGCHLD handler
        if self._it is not None and hasattr(self._it, "_shutdown_workers"):
            self._it._shutdown_workers()  # joins them, killing any that do not exit
        self._it = None

    def shutdown(self) -> None:
        """Stop the workers and give the SIGCHLD handler back. Safe to call more than once; a
        later start_epoch starts new workers."""
        self._replace_loader()
        self._restore_sigchld_handler()


def build_stream(dataset, cfg, env, val_dataset=None) -> tuple[ResumableDistributedSampler, BatchStream, int]:
    """This rank's sampler over ``dataset``, the stream of its micro-batches, and the loader's
    number of worker processes. An IterableDataset gets a stream of its own (framework/data/iterable_stream.py)."""
    check_datasets(dataset, val_dataset, cfg, env.world_size)
    if isinstance(dataset, IterableDataset):
        g = cfg.data.global_batch_size
        split = (split_global_batch(g, env.world_size, cfg.data.batch_size, why=f"data.global_batch_size={g}") if g
                 else (cfg.data.batch_size, cfg.data.gradient_accumulation_steps))
        position = StreamPosition(env.world_size, *split)
        return position, IterableStream(dataset, position, device=env.device, distributed=env.distributed,
                                        rank=env.rank), 0
    sampler = ResumableDistributedSampler(len(dataset), env.world_size, env.rank, cfg.data.batch_size,
                                          cfg.data.gradient_accumulation_steps, cfg.train.seed,
                                          keep_global_batch=cfg.data.world_size_change == "keep_global_batch",
                                          global_batch=cfg.data.global_batch_size)
    # The built-in datasets are in memory and batch in one vectorised read: a worker process
    # would only add the cost of shipping each batch back (measured: ~1.5 ms a step on CPU).
    in_memory = isinstance(dataset, (MarkovDataset, TokenWindows))
    workers = 0 if in_memory else workers_per_rank(cfg.data.num_workers, env.local_world_size)
    if not in_memory and cfg.data.num_workers == AUTO:
        cores = _cores()
        log.info("data.num_workers=auto: %d loader workers per rank (%d CPU core%s for %d process%s on this node%s)",
                 workers, cores, "" if cores == 1 else "s", env.local_world_size,
                 "" if env.local_world_size == 1 else "es",
                 "" if workers else ": none to spare; set data.num_workers to override")
    pin = cfg.data.pin_memory and env.device.type == "cuda"
    stream = BatchStream(lambda: make_loader(dataset, sampler, num_workers=workers, pin_memory=pin,
                                             seed=cfg.train.seed + env.rank, timeout_s=cfg.ddp.timeout_s),
                         sampler, max_restarts=cfg.recovery.max_loader_restarts)
    return sampler, stream, workers
