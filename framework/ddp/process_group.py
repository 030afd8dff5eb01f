"""Process-group setup and teardown under torchrun (or as one plain process without it)."""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
import signal
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives
from .heal import NothingToHealFrom, newest_state
from .membership import Membership, Slot, process_state

log = logging.getLogger(__name__)

# The store the process group was built on, when this module built it (heartbeats use it too).
STORE: dist.Store | None = None
# The store generation this restart of the group agreed on, when this module built the group.
STORE_GENERATION: int | None = None
# A run that heals in place (recovery.heal=in_place; framework/ddp/membership.py): its generations
# in the run's store, and the one this process's group belongs to.
MEMBERSHIP = None
GENERATION = None

EXIT_PEER_LOST = 75
"""A worker's exit code when a node of the run is lost: its agent died (then every rank saves and
exits with it), or a peer process went away in a collective. sysexits' EX_TEMPFAIL: a restart or a
relaunch continues from the newest checkpoint. Never 0, so that torchrun takes its failure path (a
restart, or its own exit) instead of waiting 300 s in its exit barrier for an agent that is dead."""


class PeerLost(SystemExit):
    """Raised by ``DDPTrainer.train`` after its save when some rank's agent died: the process exits
    with EXIT_PEER_LOST unless the caller catches it."""

    def __init__(self, message: str):
        super().__init__(EXIT_PEER_LOST)
        self.message = message

    def __str__(self) -> str:
        return self.message


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_AT_IMPORT = os.getppid()
_armed_parent: int | None = None  # the agent's pid, once die_with_parent armed the death signal
_steady = False  # set_steady_timeout has run since the last setup
_teardown_registered = False  # teardown runs at interpreter exit


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


def log_rank(rank: int | None = None, world_size: int | None = None) -> int:
    """The rank whose log file this process writes before its group forms: its replica in a run
    that heals in place (its rank in the first generation), else its rank."""
    slot = Slot.from_env(os.environ)
    return slot.replica if slot is not None else read_env(rank, world_size)[0]


def die_with_parent(parent: int | None = None) -> None:
    """Under torchrun on Linux: have the kernel send this worker SIGTERM when its agent dies, so
    that a kill -9 of the agent leaves no orphan training on. ``parent`` is the agent's pid, read
    as early as the entry point can (default: when this module was imported).

    The death signal fires when the parent *thread* exits; torchrun's agent runs in its main
    thread and starts workers from it (subprocess.Popen), so that thread lives as long as the
    agent. SIGTERM, not SIGKILL: it is a preemption, so the ranks agree at the next step, save
    and exit (on 2 nodes, the other node's ranks too, through the control all-reduce), and a
    relaunch continues from that step. If a collective cannot complete (a rank is gone), the hang
    watchdog and the collective timeout end the worker; the newest checkpoint stays valid."""
    global _armed_parent
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ or _armed_parent is not None:
        return
    parent = _PARENT_AT_IMPORT if parent is None else parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    _armed_parent = parent
    if agent_gone():  # the agent died before the signal was armed: it will never come
        log.error("the torchrun agent (pid %d) is gone: this worker ends too", parent)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGTERM)


def agent_gone() -> bool:
    """Whether this worker armed the death signal and has outlived its agent since (the kernel
    reparented it): a SIGTERM then is the death signal, not a scheduler's preemption."""
    if _armed_parent is None:
        return False
    if os.getppid() != _armed_parent:
        return True
    # The kernel sends the death signal as the agent's main thread exits and hands this worker to
    # one of the agent's threads that are still exiting (kill -9): getppid() still names the agent,
    # whose main thread is a zombie by then.
    return process_state(_armed_parent) in (None, "Z", "X")


def select_device(local_rank: int, cuda_available: bool, device_count: int) -> torch.device:
    """This rank's device: GPU ``local_rank`` (modulo the visible GPUs) with CUDA, else the CPU."""
    return torch.device("cuda", local_rank % device_count) if cuda_available and device_count else torch.device("cpu")


# Names torch also reads for the same setting (the flight recorder's older and newer names).
NCCL_ALIASES = {"TORCH_NCCL_TRACE_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"),
                "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}


def nccl_environment(log_dir: str, environ: dict[str, str]) -> dict[str, str]:
    """What torchtitan sets for NCCL, less what the user set: asynchronous error handling (a
    failed or timed-out collective tears the process down instead of hanging in it), and the
    flight recorder, which keeps the last collectives and dumps them into log_dir on a timeout."""
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_FR_DUMP_TEMP_FILE": os.path.join(os.path.abspath(log_dir), "nccl_trace_rank_")}
    return {k: v for k, v in wanted.items()
            if not any(name in environ for name in NCCL_ALIASES.get(k, (k,))) or torchrun_default(k, environ)}


def torchrun_default(key: str, environ: dict[str, str]) -> bool:
    """Whether ``environ[key]`` is torchrun's, not the user's: torchrun puts
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 into every worker whose launcher environment lacks it, so
    under torchrun a 1 there is taken for torchrun's (a user's 1 becomes 3 as well: both tear the
    process down; 3 skips the communicator abort, which can itself hang)."""
    return (key == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and "TORCHELASTIC_RUN_ID" in environ
            and environ.get(key) == "1")


def set_steady_timeout(init_timeout_s: float, timeout_s: float) -> None:
    """After the first step, collectives get ``timeout_s`` instead of the (longer) init timeout,
    which covered rendezvous, the first NCCL communicator and the preflight (as torchtitan does).
    Idempotent: the first call does it."""
    global _steady
    if _steady or not (dist.is_available() and dist.is_initialized()) or init_timeout_s == timeout_s:
        _steady = True
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(datetime.timedelta(seconds=timeout_s), None)
    _steady = True
    log.info("collective timeout after the first step: %g s (init timeout %g s)", timeout_s, init_timeout_s)


def one_rank_group(backend: str, environ: dict[str, str]) -> bool:
    """Whether a single process builds a process group: only for an explicit backend=nccl under
    torchrun, so one GPU exercises NCCL (DDP over a 1-rank group); auto and gloo run without one."""
    return backend == "nccl" and "TORCHELASTIC_RUN_ID" in environ


def choose_backend(requested: str, cuda: bool) -> str:
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    return requested


def setup(backend: str = "auto", timeout_s: float = 600.0, *, rank: int | None = None,
          world_size: int | None = None, log_dir: str = "logs", store_lost_s: float = 10.0) -> DistEnv:
    """Pick the device and, for world_size > 1, join the process group (reusing one that exists)
    within ``timeout_s`` (the init timeout; see ``set_steady_timeout``). Healing in place, a
    replica that its torchrun started again reaches the run's store within ``store_lost_s``, or
    raises ``RunStoreLost``."""
    global _steady
    _steady = False
    die_with_parent()
    slot = Slot.from_env(os.environ)
    if slot is not None:
        global _LOG_DIR
        _LOG_DIR = log_dir
        return _join_in_place(slot, backend, timeout_s, store_lost_s)
    rank, local_rank, world_size, local_world_size = read_env(rank, world_size)
    cuda = torch.cuda.is_available()
    device = select_device(local_rank, cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if world_size == 1 and not dist.is_initialized() and not one_rank_group(backend, os.environ):
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            log.info("no torchrun environment: running as a single process on %s", device)
        return DistEnv(0, 0, 1, 1, device, None)

    chosen = choose_backend(backend, cuda)
    if not dist.is_initialized():
        import_group_defaults()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise ValueError("world_size > 1 without torchrun: set MASTER_ADDR and MASTER_PORT")
        timeout = datetime.timedelta(seconds=timeout_s)
        if chosen == "nccl":
            settings = nccl_environment(log_dir, os.environ)
            os.environ.update(settings)
            log.info("NCCL settings: %s", ", ".join(f"{k}={v}" for k, v in settings.items()) or "all set by the user")
        dist.init_process_group(backend=chosen, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if chosen == "nccl" else None,
                                store=restart_safe_store(rank, world_size, timeout))
        global _teardown_registered
        if not _teardown_registered:
            atexit.register(teardown)
            _teardown_registered = True
    else:
        chosen = dist.get_backend()
    log.info("process group up: backend=%s rank=%d/%d local_rank=%d device=%s TORCH_DISTRIBUTED_DEBUG=%s",
             chosen, rank, world_size, local_rank, device, os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF"))
    return DistEnv(rank, local_rank, world_size, local_world_size, device, chosen)


def _join_in_place(slot, backend: str, timeout_s: float, store_lost_s: float) -> DistEnv:
    """A process of a run that heals in place: its group is its slot's first generation, formed
    on the run's store (see framework/ddp/membership.py)."""
    global MEMBERSHIP, _teardown_registered
    import_group_defaults()
    client = _run_store_client(slot, timeout_s, store_lost_s)
    MEMBERSHIP = Membership(client, slot.replica, timeout_s=timeout_s, launch=os.environ.get(LAUNCH_ENV, ""),
                            still_s=store_lost_s)
    MEMBERSHIP.beat(lambda: dist.TCPStore(slot.host, slot.port, is_master=False,
                                          timeout=datetime.timedelta(seconds=10)))
    generation, joins = MEMBERSHIP.start(slot.replicas, slot.spares, restarted=agent_restarts() > 0)
    if joins:  # it builds its model and data first, then joins (join_running): the members pause less
        cuda = torch.cuda.is_available()
        device = select_device(_local_slot(), cuda, torch.cuda.device_count() if cuda else 0)
        env = DistEnv(-1, -1, 0, 0, device, choose_backend(backend, cuda))
    else:
        env = form(generation, backend, timeout_s)
    if not _teardown_registered:
        atexit.register(teardown)
        _teardown_registered = True
    return env


LAUNCH_ENV = "HEAL_LAUNCH"
"""Names one launch of a node (launch_training.sh --heal sets it): a process that its torchrun
starts again after a newer launch of its node took its replica ends (``Membership.start``)."""


class RunStoreLost(PeerLost):
    """A replica started again could not reach the run's store: its node (node 0) is lost or cut
    off from this one, or the run ended there."""


def _run_store_client(slot, timeout_s: float, store_lost_s: float) -> dist.TCPStore:
    """A client of the run's store, whose calls wait ``timeout_s``. A first launch waits as long
    for the store to come up (node 0 may be launched after this node, as torchrun's rendezvous
    waits). A replica that its torchrun started again reached the store before: should it not
    answer within ``store_lost_s``, every further restart would wait ``timeout_s`` for it in vain
    (node 1 cut off from node 0 would end only after (1 + restarts) x ddp.timeout_s):
    ``RunStoreLost`` instead, whose handler says why and stops this replica's torchrun
    (``stop_own_agent``) as this process exits with EXIT_PEER_LOST."""
    restarted = agent_restarts() > 0
    wait_s = min(timeout_s, store_lost_s) if restarted else timeout_s
    try:
        client = dist.TCPStore(slot.host, slot.port, is_master=False, timeout=datetime.timedelta(seconds=wait_s))
    except RuntimeError as err:  # torch's DistNetworkError, DistStoreError
        if not restarted:
            raise
        raise RunStoreLost(f"the run's store at {slot.host}:{slot.port} did not answer within {wait_s:g} s after "
                           f"replica {slot.replica} was started again ({type(err).__name__}): its node is lost or cut "
                           f"off from this one, or the run ended there; this replica ends") from err
    client.set_timeout(datetime.timedelta(seconds=timeout_s))
    return client


def stop_own_agent() -> bool:
    """SIGTERM this worker's torchrun agent, when it armed the death signal (``die_with_parent``),
    the agent lives and would restart it again (``agent_restarts_left``); True when it was sent.
    Only for a replica that is a torchrun job of its own (healing in place): the agent ends this
    worker and exits, and no other worker with it."""
    if _armed_parent is None or agent_gone() or agent_restarts_left() == 0:
        return False
    try:
        os.kill(_armed_parent, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def drop_broken_group(wait_s: float = 5.0) -> bool:
    """Destroy the default group after one of its collectives failed on a lost peer (healing in
    place): its sockets close, so a survivor still blocked in a collective with this one (gloo
    tells only the peers of the dead rank) gets its error at once instead of after ddp.timeout_s
    (measured on 4 ranks: 0.02 s instead of until this process exits). The destruction runs in a
    thread waited for ``wait_s``: should a gloo thread of the group stay blocked, the group is
    parked instead and the heal goes on. Returns whether it was destroyed."""
    group = dist.group.WORLD
    release_ddp_holders(group)
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="drop-broken-group", daemon=True).start()
    if done.wait(wait_s):
        return True
    log.warning("the broken process group did not free within %.0f s: parked", wait_s)
    collectives.park(group)
    return False


def stop_silent_peer(rank: int) -> bool:
    """A run that heals in place: SIGKILL the process of ``rank`` (of this generation) if it runs on
    this host; True when it did. A frozen member (SIGSTOP) takes part in nothing and would be
    waited for; killed, its connections close, so the collective the survivors wait in with it
    fails and they heal in place, and its torchrun starts it again to rejoin. A member on another
    host cannot be killed from here: False, and the run restarts from its checkpoint."""
    from .membership import kill

    membership, generation = MEMBERSHIP, GENERATION
    if membership is None or generation is None or rank >= generation.world_size:
        return False
    where = membership.process_of(generation.members[rank], generation)
    return where is not None and kill(where, f"rank {rank} (replica {generation.members[rank]}) is silent")


def joining() -> bool:
    """Whether this process is to join a running generation (its DistEnv is provisional: rank -1)."""
    return MEMBERSHIP is not None and GENERATION is None


def join_running(backend: str, timeout_s: float, stop=lambda: False,
                 before_restart=lambda: None) -> tuple[DistEnv, dict | None]:
    """A replica started again, or a spare, joins the running generation: it asks, is taken in
    (at the end of a step, or at a heal), and receives the state the members hold by broadcast
    (theirs: DDPTrainer._grow, _heal). When no member is left (or none holds a state), it forms
    the next generation with the others that asked, and the state is None: the run resumes from its
    checkpoint, as a restart does. ``stop()``: give up waiting (a preemption signal), ending with
    RunFinished; ``before_restart()`` raises when the run must not restart."""
    generation, restart = MEMBERSHIP.join(timeout_s, stop, before_restart)
    env = form(generation, backend, min(timeout_s, FORM_TIMEOUT_S), steady_s=timeout_s)
    if restart:
        log.warning("no member of the run was left: generation %d (replicas %s) resumes from the checkpoint",
                    generation.number, list(generation.members))
        return env, None
    try:
        state, _ = newest_state(None, -1, rank=env.rank, world_size=env.world_size)
    except NothingToHealFrom:  # every rank sees the same exchange, so every rank takes this path
        log.warning("no member of generation %d holds a state: it resumes from the checkpoint", generation.number)
        return env, None
    return env, state


def _local_slot() -> int:
    """This replica's device index on its node: torchrun's LOCAL_RANK, else its replica number."""
    return int(os.environ.get("LOCAL_RANK", MEMBERSHIP.replica)) if "TORCHELASTIC_RUN_ID" in os.environ else \
        MEMBERSHIP.replica


_LOG_DIR = "logs"  # where NCCL's flight recorder dumps, for a run that heals in place
FORM_TIMEOUT_S = 60.0
"""How long the members of a new generation wait for each other after a heal or a grow."""


def form(generation, backend: str, timeout_s: float, *, broken: bool = True, steady_s: float | None = None) -> DistEnv:
    """Make ``generation``'s group this process's (a run that heals in place); its DistEnv. One
    node: a replica's device is its own local rank, whatever its rank in the generation.
    ``broken``: the previous group failed (it is parked, never freed), else it is destroyed.
    ``timeout_s`` bounds the formation; ``steady_s`` (default: the same) its collectives after."""
    global GENERATION, STORE
    cuda = torch.cuda.is_available()
    device = select_device(_local_slot(), cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chosen = choose_backend(backend, cuda)
    if chosen == "nccl":
        os.environ.update(nccl_environment(_LOG_DIR, os.environ))
    if not broken and dist.is_initialized():
        release_ddp_holders(dist.group.WORLD)
        dist.destroy_process_group()
    rank = MEMBERSHIP.form(generation, chosen, timeout_s)
    collectives.arm(generation.number)  # the step's collectives end when a member is named lost
    if steady_s is not None and steady_s != timeout_s:
        from torch.distributed.distributed_c10d import _set_pg_timeout
        _set_pg_timeout(datetime.timedelta(seconds=steady_s), None)
    GENERATION = generation
    STORE = dist.PrefixStore(f"generation/{generation.number}/", MEMBERSHIP.store)
    log.info("process group up: generation %d of the run (replicas %s), backend=%s rank=%d/%d device=%s, formed in "
             "%.3f s", generation.number, list(generation.members), chosen, rank, generation.world_size, device,
             MEMBERSHIP.formed_s)
    return DistEnv(rank, rank, generation.world_size, generation.world_size, device, chosen)


def generation_key() -> str:
    """This group's restart or generation, for keys that must not outlive it (heartbeats)."""
    return f"heal{GENERATION.number}" if GENERATION is not None else str(STORE_GENERATION or 0)


def import_group_defaults() -> None:
    """Import torch.distributed.nn.functional while no process group exists.

    Its collectives take ``group=group.WORLD`` as a default argument, evaluated at import. DDP
    imports it (through torch.distributed.fsdp), so imported after init_process_group it would hold
    the default group for the life of the process: destroy_process_group could not free it, and
    the group's gloo threads, sockets and store client would be torn down inside the interpreter's
    finalisation, where torch 2.13 occasionally aborts ("terminate called without an active
    exception"). Imported first, the defaults are None (the default group at call time)."""
    import torch.distributed.nn.functional  # noqa: F401


def agent_restarts() -> int:
    """How often this node's torchrun agent restarted its workers for a failure (0 outside
    torchrun). Per agent, not per group: an agent that restarts for a membership change (another
    node's restart) does not count it, so the ranks of one group can see different values."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def agent_restarts_left() -> int:
    """How many more times this node's torchrun agent will restart its workers after a failure
    (``--max-restarts`` less ``agent_restarts``); 0 outside torchrun, where nothing restarts."""
    return max(0, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - agent_restarts())


def group_restarts() -> int:
    """How many times this launch's worker group has been restarted, the same on every rank: the
    agreed store generation under torchrun (see ``agree_generation``), the run store's count of
    restarts from the checkpoint in a run that heals in place, else the restart count."""
    if GENERATION is not None:
        return MEMBERSHIP.restarts(GENERATION.number)
    return STORE_GENERATION - 1 if STORE_GENERATION is not None else agent_restarts()


RDZV_STORE_ENV = "RDZV_STORE_ENDPOINT"
"""``[BACKEND://]HOST:PORT`` of the rendezvous (BACKEND c10d, the default, or etcd-v2), set by
launch_training.sh for an elastic node range or an etcd rendezvous, where it also turns torchrun's
store sharing off (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): in torch 2.13 a node that joins a running
job waits forever in its rendezvous for bootstrap keys that the agent of rank 0 wrote only in an
earlier round. The workers then agree on their restart in the rendezvous's own store (the c10d
store, or etcd), under a prefix of their own, which outlives the worker groups as the agent store
did."""


@dataclass(frozen=True)
class StoreAddress:
    backend: str  # "agent" (torchrun's shared store), "c10d" or "etcd-v2"
    host: str
    port: int
    prefix: str


def agent_store_address() -> StoreAddress | None:
    """Where the store lives that outlives the worker group's restarts: torchrun's shared
    agent store, or the rendezvous of ``RDZV_STORE_ENV``; None outside torchrun (or under torchrun
    with neither)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return StoreAddress("agent", os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), "")
    value = os.environ.get(RDZV_STORE_ENV, "")
    if not value or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    backend, _, endpoint = value.rpartition("://")
    host, _, port = endpoint.rpartition(":")
    if backend not in ("", "c10d", "etcd-v2") or not host or not port.isdigit():
        raise ValueError(f"{RDZV_STORE_ENV}={value!r}: must be [c10d://|etcd-v2://]HOST:PORT, the rendezvous endpoint")
    return StoreAddress(backend or "c10d", host, int(port), f"ddp_framework/{os.environ['TORCHELASTIC_RUN_ID']}/")


def _connect(address: StoreAddress, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """A client of the store at ``address``, under its prefix."""
    if address.backend == "etcd-v2":
        import etcd  # python-etcd, which torchrun's etcd-v2 rendezvous needs as well

        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore
        return EtcdStore(etcd.Client(host=address.host, port=address.port, protocol="http"),
                         "/" + address.prefix, timeout=timeout)
    store = dist.TCPStore(address.host, address.port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(address.prefix, store) if address.prefix else store


def restart_safe_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, a store for the process group with a key prefix per restart of the
    group; None (env://) otherwise.

    torchrun keeps its agent store across restarts of the worker group. Without a prefix, a
    restarted group can read the previous restart's gloo addresses from it and connect to a
    dead worker ("Gloo connectFullMesh failed ... Connection refused"). The prefix is not the
    restart count, which the nodes of a multi-node group need not share (see ``agent_restarts``):
    with it, a restarted 2-node group waited for keys under another node's prefix until timeout_s.

    The restart is agreed in the store of ``agent_store_address``. The group forms there too,
    except under etcd (which is too slow for it): then it forms on torchrun's MASTER_ADDR:MASTER_PORT,
    a port the agent of rank 0 picks afresh for each restart, hosted by rank 0."""
    address = agent_store_address()
    if address is None:
        return None
    global STORE, STORE_GENERATION
    store = _connect(address, world_size, timeout)
    generation = agree_generation(store, rank, world_size, timeout)
    log.info("store generation %d (this agent's restart count: %d)", generation, agent_restarts())
    if address.backend == "etcd-v2":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0, timeout=timeout)
    STORE = dist.PrefixStore(f"generation_{generation}/", store)
    STORE_GENERATION = generation
    return STORE


def agree_generation(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> int:
    """A number that every rank of this restart of the group agrees on and no earlier one used.

    torchrun gives its workers nothing per rendezvous round: the round stays in the agent,
    MASTER_PORT outlives rounds, and only workers write to this store. So rank 0 draws a new number
    from a counter, and every other rank joins the current number with a fresh nonce until rank 0
    lists that nonce among the members. What earlier restarts left behind, whichever point
    their workers died at, cannot pass for this one: no number is drawn twice, and their member
    lists hold other nonces. None of their workers still runs: each agent stops its workers before
    it rejoins the rendezvous, and a round completes only once every agent has joined."""
    if rank == 0:
        generation = store.add("generation/last", 1)
        store.set("generation/current", str(generation))
        joins = [f"generation/{generation}/rank{r}" for r in range(1, world_size)]
        store.wait(joins, timeout)
        store.set(f"generation/{generation}/members", b" ".join(store.get(key) for key in joins))
        return generation
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    joined = None
    while True:
        generation = int(store.get("generation/current"))  # waits for the first rank 0 ever
        if generation != joined:
            store.set(f"generation/{generation}/rank{rank}", nonce)
            joined = generation
        members = f"generation/{generation}/members"
        if store.check([members]) and nonce in store.get(members).decode().split():
            return generation
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no rank 0 took this rank into a store generation within "
                               f"{timeout.total_seconds():.0f} s (last seen: generation {generation})")
        time.sleep(0.01)


def lost_members(wait_s: float = 5.0, settle_s: float = 0.0) -> list[int] | None:
    """Healing in place: the other replicas of this generation known gone (``Membership.gone``,
    which kills one found stopped); [] otherwise, or None when the run's store does not answer
    within ``wait_s`` (a frozen store keeps no client deadline: the lookup runs in a thread of its own).
    ``settle_s``: look again for so long while none is found: a member another rank has just
    killed runs its exit for a moment (state R) before it is gone."""
    membership, generation = MEMBERSHIP, GENERATION
    if membership is None or generation is None:
        return []
    found: list[list[int]] = []

    def look() -> None:
        until = time.monotonic() + settle_s
        try:
            while True:
                gone = [m for m in generation.members if m != membership.replica and membership.gone(m, generation)]
                if gone or time.monotonic() >= until:
                    found.append(gone)
                    return
                time.sleep(0.05)
        except Exception as err:  # noqa: BLE001  (the run's store gone: nothing to learn from it)
            log.warning("could not look for lost members in the run's store: %s: %s", type(err).__name__, err)

    thread = threading.Thread(target=look, name="lost-members", daemon=True)
    thread.start()
    thread.join(wait_s + settle_s)
    return found[0] if found else None


def say_ended(wait_s: float = 2.0) -> None:
    """Healing in place: say in the run's store that this process ends (``Membership.end``), so
    that a replica started again after it does not wait for it from another host. At most
    ``wait_s``: the store may be cut off."""
    membership = MEMBERSHIP
    if membership is None:
        return

    def end() -> None:
        try:
            membership.end()
        except Exception:  # noqa: BLE001  (the store gone: nobody is left to wait for this process)
            pass

    thread = threading.Thread(target=end, name="say-ended", daemon=True)
    thread.start()
    thread.join(wait_s)


def teardown() -> None:
    """Leave the process group and free it now, while the interpreter is whole. Freeing the group
    joins its gloo threads and closes its sockets; a group that something still references is
    freed only when its last holder goes, during the interpreter's finalisation if that holder
    lives as long (a module global), and there torch 2.13 occasionally aborts. Healing in place,
    a member found stopped is killed first (``lost_members``): a process that ends after a
    collective timed out on it would leave it, its torchrun and the launcher waiting for good; and
    this process says it ends (``say_ended``)."""
    global STORE, STORE_GENERATION
    if lost_members() is not None:  # else the run's store does not answer: nobody learns from it
        say_ended()
    if dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
        release_ddp_holders(group)
        dist.distributed_c10d.destroy_process_group()  # not a script's patched name (framework.hf)
        holders = sys.getrefcount(group) - 2  # less this frame's name and getrefcount's argument
        if holders > 0:
            log.info("the process group is still referenced %d time(s) after destroy_process_group (a DDP "
                     "module?): it is freed when the last reference goes", holders)
        del group
    STORE = STORE_GENERATION = None  # release the store client here, not during interpreter shutdown
    global MEMBERSHIP, GENERATION
    MEMBERSHIP = GENERATION = None
    collectives.disarm()


def release_ddp_holders(group) -> int:
    """Have every live DDP module let go of ``group`` (its reducer and logger hold it), so that
    destroying the group frees it there, with the GIL released. A DDP module that outlives the
    group (a script's own wrapper, a local of its main()) frees it later, from its Python
    deallocation, which holds the GIL while gloo's destructor joins its threads, one of which may
    be waiting for the GIL to free a finished work's tensors: the process hangs at exit (seen 3
    times in 10 with the Kaggle guide's script). Returns how many modules let go."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    released = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which warns on torch's deprecated reduce_op
        if issubclass(type(obj), DistributedDataParallel) and getattr(obj, "process_group", None) is group:
            for name in ("logger", "reducer"):
                if name in obj.__dict__:
                    obj.__dict__[name] = None
            obj.process_group = None
            released += 1
    if released:
        log.info("%d DDP module(s) still held the process group: released before destroying it", released)
    return released


def join_early(timeout_s: float = 600.0) -> None:
    """Under torchrun with more than one process, join the process group now, through
    ``restart_safe_store``, so that a library that would initialise it with ``env://`` (accelerate,
    through transformers' TrainingArguments) finds it up and reuses it. Nothing elsewhere."""
    if agent_store_address() is None or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    if dist.is_initialized():
        if STORE is None:
            log.warning("the process group was created before framework.hf was imported (TrainingArguments does "
                        "it, through accelerate, with env://): an in-place restart may connect to a dead "
                        "restart's workers. Import framework.hf before building TrainingArguments")
        return
    setup("auto", timeout_s)  # which registers the teardown at exit: DDPTrainer leaves a group it found alone


def close_at_exit(close: Callable[[], None]) -> None:
    """Call the bound method ``close`` at interpreter exit, before the finalisation, if its object
    is still alive then (it is held weakly): a script that simply ends without closing what it
    built still frees the process group while the interpreter is whole (see ``teardown``).
    Handlers run last-registered first, so these run before the ``teardown`` that ``setup``
    registers."""
    method = weakref.WeakMethod(close)

    def at_exit() -> None:
        bound = method()
        if bound is not None:
            bound()

    atexit.register(at_exit)
