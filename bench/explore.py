#!/usr/bin/env python3
"""Randomized explorer: configurations x faults x moments, each trial checked against invariants.

Each trial draws, from ``random.Random(seed + trial)``, a configuration (topology, restarts, resume
mode, directory layout, another run's checkpoints in checkpoint_dir, data kind, spike guard,
accumulation, activation checkpointing, tiled MLP, comm hook, save schedule, keep_last, stop
rule, the survivor checkpoint on a peer's loss, a world-size change at the relaunch, a node range,
train.loss_average, the HF drop-in instead of ddp_training.py, timed checkpoints, the peer
monitor, healing in place under launch_training.sh --heal, an uneven split, and healing in place
the rank a worker's fault strikes: the last or rank 0), a fault and a moment. It trains the
tiny built-in GPT (10 or 12 steps, 6 steps an epoch; an HF trial: a tiny Llama, bench/explore_hf.py)
with that fault, relaunches once with ``resume=auto`` when the run stopped without a FATAL (as a
user or a scheduler would; at the other world size of a world_change), and checks:

- nothing_lost: files outside the run's own directories, and another lineage's checkpoints, are
  unchanged; every manifest entry exists; the logs and the export exist after a finished run;
  an uninterrupted run writes every checkpoint its schedule makes due; a survivor slowed in its
  survivor checkpoint (kill9_slow_save) still writes it;
- equivalence: the final model_sha256 equals an uninterrupted reference run of the same
  configuration (cached by the configuration's key); bit-exact, for the faults the README promises
  it (not after nan, bad_data, full_disk: those change the result by design); after a world-size
  change (the same global batch, summed in another order) the final weights within 1e-5;
- no_hang: every launch ends within a bound derived from the configuration;
- explained: exit 0, or a FATAL marker / one-line ``fatal:``/``error:`` line; a user's mistake exits
  2 without a traceback; a transient fault gets no FATAL and the relaunched run finishes, but a
  run whose only checkpoint was made unreadable (for good) may instead stop with a FATAL naming it,
  and an injected loss spike under spike_guard=rollback with the explorer's twitchy settings (or
  a trial of that guard whose losses differ from the reference's by design: a world-size change,
  timed checkpoints) may end in the guard's FATAL naming max_rollbacks;
  a deterministic error on one rank (crash_one_rank) exits 1 with the restart-loop guard's FATAL, no
  NODE_LOST;
- accounting: read_metrics steps strictly increasing, its last loss equal to summary.json's; with
  record_samples, no sample twice in an epoch, and each completed epoch's samples equal the
  reference's;
- in_place: healing in place, a worker killed or stopped, or its node lost, inside a step (HEALS_IN_PLACE) is healed
  in place: the survivors go on in their processes (a heal in the survivor's log), and no rank restarts
  from the checkpoint.

A failing trial is shrunk (one choice at a time moved to its simplest value while the trial still
fails the same invariant) and printed as one command: ``python bench/explore.py --replay '<json>'``.

usage: python bench/explore.py [--trials N] [--seed S] [--jobs J] [--out explore.json] [--no-shrink]
                               [--fix DIM=VALUE ...]
       python bench/explore.py --replay '<json>'
       python bench/explore.py --rerun bench/results/explore_seed4000.json [--rerun-faults a,b] [--jobs J]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from fault_campaign import (  # noqa: E402  (its launch helpers, shared with the fault campaign)
    EXCEPTION_LINE, checkpoint_temp, free_port, kill_matching, mount_tmpfs, processes_matching, torchrun_cmd,
    unmount, worker_env)

# --- the trial's run: the tiny model, 6 steps an epoch ------------------------------------------
STEPS_PER_EPOCH, MAX_STEPS, NUM_EPOCHS, EVAL_EVERY = 6, 10, 2, 4
BATCH = 4
BASE = {"vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16, "batch_size": BATCH,
        "dropout": 0.1, "eval.interval": EVAL_EVERY, "eval.steps": 1, "log_interval": 1, "train.deterministic": True,
        "logging.record_samples": True, "logging.tensorboard": False, "target_loss": 0.0, "learning_rate": 2e-3,
        "optim.warmup_steps": 2, "train.seed": 5, "spike.warmup": 3, "spike.window": 3, "spike.threshold": 4.0,
        "straggler.interval": 0, "recovery.consistency_check_interval": 0}
HANG_TIMEOUTS = {"recovery.step_timeout_s": 3, "recovery.step_timeout_factor": 2}
# sigstop_worker: the collective timeout too (600 s by default), which alone ends a start-up whose
# peer is stopped (the hang watchdog is armed from the first step on).
STOPPED_PEER_TIMEOUT_S = 20
# A node range on loopback, as tests/integration/test_elastic.py runs it: a round with its minimum waits 2 s for
# more nodes; each step slowed to >= 600 ms (every restart) so that a lost node can rejoin mid-run.
RDZV_CONF = "join_timeout=30,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
REJOIN_SLOW = "slow@step=0,ms=600,restart=*"
# A world-size change sums the same gradients in another order: the final weights within this of
# the uninterrupted run's (tests/integration/test_elastic.py's bound; the attention key biases left out).
WORLD_CHANGE_TOLERANCE = 1e-5
SLOW_SAVE_S = 6.0  # kill9_slow_save: how long the survivor is frozen holding the lock for its survivor checkpoint
# Healing on 2 nodes, node 1 runs under a host name of its own (a UTS namespace; root), so that node
# 0 finds a lost member as on another host: a stopped worker is named lost (not killed), a dead one
# known by its heartbeat's silence (not its pid). exec: the launcher keeps the pid the explorer holds.
OTHER_HOST = ["unshare", "--uts", "sh", "-c", 'hostname "explore-node1-$$" && exec "$0" "$@"']
OTHER_HOST_OK = subprocess.run([*OTHER_HOST[:2], "true"], capture_output=True).returncode == 0
PARTITIONS_OK = OTHER_HOST_OK and shutil.which("ip") is not None


class TwoHosts:
    """Two network namespaces joined by a veth pair, for one trial (cut_link): node N runs in
    ``netns[N]`` at ``addresses[N]``; tests/integration/test_partition.py's, named after the trial."""

    def __init__(self, work: Path):
        tag = hashlib.sha256(str(work).encode()).hexdigest()[:6]
        subnet = 1 + int(tag, 16) % 250
        self.netns = (f"exA{tag}", f"exB{tag}")
        self.links = (f"xA{tag}", f"xB{tag}")
        self.addresses = (f"10.202.{subnet}.1", f"10.202.{subnet}.2")
        self.up = False

    def make(self) -> None:
        if self.up:
            return self.link(True)
        self.remove()
        ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True, timeout=30)  # noqa: E731
        ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for ns, link, address in zip(self.netns, self.links, self.addresses, strict=True):
            ip("netns", "add", ns)
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        self.up = True

    def link(self, up: bool) -> None:
        subprocess.run(["ip", "-n", self.netns[1], "link", "set", self.links[1], "up" if up else "down"],
                       check=True, capture_output=True, timeout=30)

    def remove(self) -> None:
        for ns in self.netns:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.links[0]], capture_output=True, timeout=30)
        self.up = False


_hosts: dict[str, TwoHosts] = {}  # a trial's namespaces, by its directory
REJOIN_AFTER_S = 20.0  # the lost node's agent starts again once the survivor trains alone, or this long after
RESTARTS_ONE_RANK_ERROR = 3  # crash_one_rank: launch_training.sh --max-restarts
FOREIGN_LR, FOREIGN_STEPS = 5e-3, 4  # the other run whose checkpoints a checkpoint_dir may hold

# The dimensions; the first value of each is the simplest (shrinking moves toward it).
DIMS = {
    "topology": ["1", "1x2", "2x1"],
    "max_restarts": [0, 2],
    "resume": ["auto", "none", "path"],
    "layout": ["apart", "default_export", "nested", "shared"],
    "foreign": [False, True],
    "data": ["map0", "map2", "stream"],
    "spike_guard": ["off", "warn", "rollback"],
    "accum": [1, 2],
    "act_ckpt": ["off", "non_reentrant", "reentrant", "offload"],
    "tiled_mlp": [0, 2],
    "comm_hook": ["none", "fp16", "bf16", "powersgd"],
    "save_every_steps": [4, 0, 3],
    "save_interval": [0, 1],
    "keep_last": [3, 1, 2],
    "stop": ["max_steps", "num_epochs"],
    "save_on_peer_loss": [True, False],
    # Issue 33's: the relaunch at another world size (the global batch kept); a node range (the
    # survivor of a lost node trains on alone, and the node rejoins); how a step's loss averages;
    # the HF drop-in (bench/explore_hf.py) instead of ddp_training.py.
    "world_change": ["none", "2to1", "1to2", "2to4"],
    "nnodes": ["fixed", "range"],
    "loss_average": ["micro_batch", "tokens", "rank_tokens"],
    "trainer": ["builtin", "hf"],
    # Timed checkpoints (checkpoint.every_minutes, 10 by default: never within a trial): 0.002 min
    # saves every few steps, at steps that rank 0's clock chooses.
    "save_every_minutes": [0, 0.002],
    # Issue 31's peer monitor: recovery.peer_timeout_s at its default (10 s: a stopped peer's group
    # ends before the collective timeout, 20 s; elsewhere only a false alarm), or 0, off (the
    # watchdog and the collective timeout alone, as before it).
    "peer_timeout": [10, 0],
    # Issue 31's heal in place: launch_training.sh --heal (one torchrun job per rank and the run's
    # store); the survivors of a rank lost mid-step go on in their processes at the smaller world
    # size, and the worker started again rejoins. Drawn last, after the trial (HEAL_SHARE of those
    # it fits), so that the trials of every earlier seed stay as they were drawn.
    "heal": ["restart", "in_place"],
    # Issue 31's uneven split: a global batch one sample larger than an even one (9 on 2 ranks: 5 and
    # 4), so that every world size the run takes splits it unevenly, each micro-batch's loss weighted
    # by its samples. Where the global batch is named (a run whose world size may change). Drawn
    # last, after the heal dimension (UNEVEN_SHARE of the trials it fits).
    "split": ["even", "uneven"],
    # Healing in place, which rank a worker's fault strikes: the last (as every other trial), or
    # rank 0, which has duties of its own (it proposes a grow, writes the checkpoints' shared files,
    # logs the metrics, exports). Drawn last, after the split (FIRST_SHARE of the trials it fits).
    "victim": ["last", "first"],
}
DRAWN_AFTER = ("heal", "split", "victim")  # not in the first draw of a trial's configuration
LAYOUTS = {
    "apart": "checkpoint_dir, log_dir and export_dir side by side",
    "default_export": "export_dir left to its default (checkpoint_dir/export)",
    "nested": "export_dir=runs/x, checkpoint_dir=runs/x/checkpoints, log_dir=runs/x/logs",
    # export_dir = log_dir is refused at --check-config by design (the export would replace the logs'
    # own files), so the checkpoints share their directory with the export instead.
    "shared": "checkpoint_dir = export_dir = runs/x, log_dir=runs/x/logs",
}


@dataclass(frozen=True)
class Fault:
    what: str
    moments: tuple          # where it may be delivered
    transient: bool = True  # a restart or relaunch must finish the run, with no FATAL
    exact: bool = True      # the final model must equal the reference's


STEP_MOMENTS = ("startup", "mid_step", "epoch_boundary")
ALL_MOMENTS = ("startup", "mid_step", "epoch_boundary", "eval", "ckpt_write", "rollback", "final_save", "export")
FAULTS = {
    "none": Fault("no fault", ("startup",)),
    "kill9_worker": Fault("kill -9 of the last rank's worker (fault_inject sigkill, or a signal on a log line)",
                          ALL_MOMENTS),
    "kill9_agent": Fault("kill -9 of the last node's torchrun agent", ALL_MOMENTS),
    "kill9_node": Fault("kill -9 of the last node's agent and its workers", ALL_MOMENTS),
    "sigterm_worker": Fault("SIGTERM to the last rank's worker", ALL_MOMENTS),
    "sigterm_launcher": Fault("SIGTERM to ./launch_training.sh", ALL_MOMENTS),
    "hang": Fault("fault_inject hang on the last rank (step_timeout_s=3, factor 2)",
                  ("startup", "mid_step", "epoch_boundary", "eval", "ckpt_write", "final_save")),
    "nan": Fault("fault_inject nan in the last rank's gradients", STEP_MOMENTS, exact=False),
    "bad_data": Fault("fault_inject bad_data on the last rank", STEP_MOMENTS, exact=False),
    "kill_dl_worker": Fault("fault_inject kill_worker: a DataLoader worker killed in backward", STEP_MOMENTS),
    "corrupt_newest": Fault("the newest step file truncated to half, then kill -9 of the last worker",
                            ("mid_step", "epoch_boundary", "eval", "final_save", "export")),
    "unreadable_newest": Fault("the newest step file replaced by a directory (EISDIR on read), then kill -9 of "
                               "the last worker", ("mid_step", "epoch_boundary", "eval", "final_save", "export")),
    "second_launch": Fault("the same command launched again into the same directories", ("startup", "mid_step")),
    "user_error": Fault("dataset_size smaller than one global batch (a user's mistake): --check-config must "
                        "refuse it with exit 2 and one line", ("startup",),
                        transient=False, exact=False),
    "full_disk": Fault("checkpoint_dir on a tmpfs that fits two checkpoints", ("ckpt_write",),
                       transient=False, exact=False),
    "sigstop_worker": Fault("SIGSTOP of the last rank's worker (never continued): the other ranks' peer monitor "
                            "(peer_timeout_s 10, unless off), hang watchdog or collective timeout must end the group "
                            "(step_timeout_s=3, factor 2, timeout_s=20)",
                            ("startup", "mid_step", "epoch_boundary", "eval", "ckpt_write", "final_save")),
    "cut_link": Fault("the link between 2 healing nodes cut (each a network namespace, node 1 under a host name "
                      "of its own; ip link set ... down, no reset): node 0 names rank 1 lost and heals in place, or "
                      "restarts from the checkpoint without it; node 1, cut off from the run's store, ends "
                      "(drawn at sigstop_worker's moments; at the export by --replay)",
                      ("startup", "mid_step", "epoch_boundary", "eval", "ckpt_write", "final_save", "export")),
    "crash_one_rank": Fault("a deterministic error on rank 1 in every restart (crash@step=K,rank=1,restart=*) "
                            "under ./launch_training.sh --max-restarts 3, max_no_progress_restarts 1: exit 1 with "
                            "a FATAL, no NODE_LOST, no 75", ("mid_step", "epoch_boundary"),
                            transient=False, exact=False),
    "kill9_slow_save": Fault("kill -9 of rank 0's worker mid-step (fault_inject sigkill), the last rank, its survivor, "
                             f"frozen (SIGSTOP) for {SLOW_SAVE_S:.0f} s once it holds checkpoint_dir's lock to save "
                             "alone: a slow save that outlasts a node range's next round",
                             ("mid_step", "epoch_boundary")),
}
ORPHAN_GRACE_S = 15.0  # how long workers may outlive their launch's end (a save after their agent died)
INVARIANTS = ("nothing_lost", "equivalence", "no_hang", "explained", "accounting", "in_place")
NOT_COVERED = [
    "SIGHUP / SIGUSR1 to the launcher, a double SIGTERM (the fault campaign has the latter)",
    "an OOM (fault_inject oom needs CUDA to matter), a straggler (slow), a one-ulp divergence",
    "EIO/ESTALE from a network file system (an unreadable file is simulated by a directory)",
    "torch.compile, fp16/bf16 autocast, user models (tests/integration/test_user_pieces.py and others); HF trials "
    "are one tiny Llama script",
    "more than 2 ranks but at a 2->4 relaunch, multi-process nodes on 2 nodes (2x2), etcd, GPUs",
    "resume=PATH to a checkpoint of this run's own lineage (PATH is always another run's checkpoint here)",
    "the SLURM batch script (crash_one_rank runs launch_training.sh, which the batch script runs per node)",
]


# --- drawing a trial ----------------------------------------------------------------------------
def world(cfg: dict) -> int:
    """The world size the first launch starts at."""
    return 1 if cfg["topology"] == "1" else 2


# world_change: the topology the first launch runs on, and the world size of the relaunch (one node).
WORLD_CHANGES = {"2to1": ("1x2", 1), "1to2": ("1", 2), "2to4": ("1x2", 4)}
# The faults that end the first launch unfinished and with no FATAL, so that the explorer relaunches
# it (where the world size changes): with --max-restarts 0 all of them, with restarts left the ones
# that torchrun's own restart does not cover (a preemption, a lost agent).
RELAUNCHED = ("kill9_worker", "kill9_agent", "kill9_node", "sigterm_worker", "sigterm_launcher", "hang",
              "sigstop_worker", "corrupt_newest")
ENDS_THE_LAUNCH = ("kill9_agent", "kill9_node", "sigterm_worker", "sigterm_launcher")


def relaunch_world(cfg: dict) -> int:
    return WORLD_CHANGES[cfg["world_change"]][1] if cfg.get("world_change", "none") != "none" else world(cfg)


def elastic(cfg: dict) -> bool:
    """The run may change its world size (a relaunch at another, or a node range that loses a node):
    dropout off, so that the weights can be compared within a tolerance (a rank's dropout mask
    follows its rank), and data.global_batch_size set."""
    return cfg.get("world_change", "none") != "none" or cfg.get("nnodes") == "range" or heals(cfg)


def hf(cfg: dict) -> bool:
    return cfg.get("trainer") == "hf"


def heals(cfg: dict) -> bool:
    return cfg.get("heal") == "in_place"


# An HF trial is a transformers.Trainer script (bench/explore_hf.py): the choices it has no way to
# make are fixed (output_dir holds checkpoints/ and logs/, as "nested" does; the drop-in averages
# over tokens, as transformers does); act_ckpt maps to gradient_checkpointing (no offload),
# save_every_steps to save_steps, keep_last to save_total_limit. Its faults are signals: a script
# has no fault_inject.
HF_FIXED = {"foreign": False, "resume": "none", "layout": "nested", "data": "map0", "spike_guard": "off", "accum": 1,
            "tiled_mlp": 0, "comm_hook": "none", "save_interval": 0, "stop": "max_steps", "save_on_peer_loss": True,
            "save_every_minutes": 0, "peer_timeout": 10, "heal": "restart",
            "world_change": "none", "nnodes": "fixed", "loss_average": "tokens"}
HF_SHARE = 0.07
HF_FAULTS = ("none", "kill9_worker", "kill9_agent", "kill9_node", "sigterm_worker")
HF_MOMENTS = ("startup", "mid_step", "epoch_boundary", "eval", "ckpt_write", "final_save", "export")
# A trial healing in place: one node of 2 processes under launch_training.sh --heal, or 2 nodes of 1
# (a launcher each, --node-rank; node 0 serves the run's store). Its faults: and on 2 nodes the loss
# of node 1 (kill9_node: its launcher, torchrun job and worker), which heals in place and, with
# restarts left, rejoins; not drawn: kill9_agent (each rank's agent is one of the launcher's jobs),
# the survivor checkpoint's (kill9_slow_save: a survivor heals instead of saving alone) or a restart
# loop's (crash_one_rank: once healed, the restarted rank rejoins past the step that crashed it).
HEAL_SHARE = 0.5
# A partition: where a healing 2-node trial stops node 1's worker (sigstop_worker), half the time the
# link between the two nodes is cut instead (cut_link). Drawn last, so that earlier seeds' trials
# keep their other choices; root only (network namespaces).
CUT_LINK_SHARE = 0.5
UNEVEN_SHARE = 0.3
FIRST_SHARE = 0.4
VICTIM_FAULTS = ("kill9_worker", "sigterm_worker", "hang", "corrupt_newest", "unreadable_newest", "sigstop_worker")
DRAWN_LAST = ("cut_link",)
HEAL_FAULTS = ("none", "kill9_worker", "sigterm_worker", "sigterm_launcher", "hang", "nan", "bad_data",
               "kill_dl_worker", "corrupt_newest", "unreadable_newest", "sigstop_worker", "second_launch",
               "user_error", "full_disk")
# What must heal in place (no restart from the checkpoint): a worker killed inside a step; one
# stopped there, named by the peer monitor (on, at 10 s) and killed by its watcher.
HEALS_IN_PLACE = {"kill9_worker": ("mid_step", "epoch_boundary"), "sigstop_worker": ("mid_step", "epoch_boundary"),
                  "kill9_node": ("mid_step", "epoch_boundary")}


def total_steps(cfg: dict) -> int:
    return MAX_STEPS if cfg["stop"] == "max_steps" or cfg["data"] == "stream" else NUM_EPOCHS * STEPS_PER_EPOCH


def is_finished(cfg: dict, summary: dict | None) -> bool:
    """The run reached its end: max_steps, or every epoch (fewer steps when a rollback excluded
    samples), and was not preempted."""
    if not summary or summary.get("preempted"):
        return False
    if cfg["stop"] == "num_epochs" and cfg["data"] != "stream":
        return summary.get("epochs", 0) >= NUM_EPOCHS - 1e-9 and summary.get("steps", 0) <= total_steps(cfg)
    return summary.get("steps") == total_steps(cfg)


def periodic_saves(cfg: dict) -> list[int]:
    """The steps whose checkpoints the schedule makes due, the final one excluded."""
    n, due = total_steps(cfg), set()
    if cfg["save_every_steps"]:
        due |= set(range(cfg["save_every_steps"], n, cfg["save_every_steps"]))
    if cfg["save_interval"]:
        due |= set(range(STEPS_PER_EPOCH, n, STEPS_PER_EPOCH))
    return sorted(due)


def start_step(cfg: dict) -> int:
    """The step a fresh launch starts from: the other run's checkpoint where it resumes one."""
    return FOREIGN_STEPS if cfg["resume"] == "path" or (cfg["resume"] == "auto" and cfg["foreign"]) else 0


def moment_step(cfg: dict, fault: str, moment: str) -> int | None:
    """The step K of the fault, or None where the moment does not exist in this configuration."""
    n, start = total_steps(cfg), start_step(cfg)
    if moment == "startup":
        return start
    if moment == "mid_step":
        return start + 3
    if moment == "epoch_boundary":
        return STEPS_PER_EPOCH - 1 if fault == "kill_dl_worker" else STEPS_PER_EPOCH
    if moment == "eval":
        return (start // EVAL_EVERY + 1) * EVAL_EVERY
    if moment == "ckpt_write":
        saves = [s for s in periodic_saves(cfg) if s > start]
        return saves[0] if saves else None
    if moment == "rollback":
        saves = [s for s in periodic_saves(cfg) if start < s < 7]
        return 7 if cfg["spike_guard"] == "rollback" and saves else None
    if moment in ("final_save", "export"):
        return n
    raise ValueError(moment)


def applicable(trial: dict) -> str | None:
    """None when the trial can run as drawn, else why not."""
    cfg, fault, moment = trial["config"], trial["fault"], trial["moment"]
    spec = FAULTS[fault]
    if moment not in spec.moments:
        return f"{fault} is not delivered at {moment}"
    if moment_step(cfg, fault, moment) is None:
        return f"no {moment} moment in this configuration"
    if cfg["topology"] == "1" and cfg["comm_hook"] == "powersgd":
        return "powersgd needs 2 ranks to compress anything"
    if fault == "sigterm_launcher" and (cfg["topology"] == "2x1" or cfg["data"] == "stream"):
        return "launch_training.sh starts one node of ddp_training.py"
    if fault in ("kill9_agent", "kill9_node") and cfg["topology"] == "1" and cfg["max_restarts"] == 0:
        pass  # run under torchrun all the same: the agent is what is killed
    if fault == "kill_dl_worker" and cfg["data"] != "map2":
        return "kill_worker needs DataLoader workers"
    if fault == "second_launch" and cfg["topology"] == "2x1":
        return "second_launch: one node"
    if fault == "full_disk" and (cfg["layout"] in ("nested", "shared") or cfg["foreign"] or cfg["resume"] == "path"):
        return "full_disk mounts a tmpfs on a checkpoint_dir of its own"
    if cfg["spike_guard"] == "rollback" and not cfg["save_every_steps"]:
        return "spike_guard=rollback needs save_every_steps > 0: refused at --check-config by design"
    if cfg["data"] == "stream" and cfg["spike_guard"] == "rollback":
        return "a rollback excludes samples by index: refused for a stream by design (spike.py)"
    if moment == "rollback" and fault in ("nan", "bad_data", "kill_dl_worker"):
        return "the rollback moment is a process fault after a bad_data spike"
    if cfg.get("victim", "last") == "first" and not (heals(cfg) and fault in VICTIM_FAULTS):
        return "rank 0 as the victim: healing in place, a worker's fault (VICTIM_FAULTS)"
    if cfg.get("split", "even") == "uneven" and (not elastic(cfg) or cfg["data"] == "stream" or hf(cfg)):
        return ("an uneven split: where the global batch is named (elastic), not a stream (its split must be "
                "even: WorldSizeMismatch), the built-in trainer")
    return issue33_applicable(cfg, fault, moment)


def issue33_applicable(cfg: dict, fault: str, moment: str) -> str | None:
    """The rules of the dimensions and faults added for issue 33 (absent from older trials: their
    simplest values)."""
    change, nnodes, trainer = cfg.get("world_change", "none"), cfg.get("nnodes", "fixed"), cfg.get("trainer", "builtin")
    if change != "none":
        topology = WORLD_CHANGES[change][0]
        if cfg["topology"] != topology:
            return f"world_change={change} starts on topology {topology}"
        if cfg["data"] == "stream":
            return "a stream's position is each rank's: a re-split stops by design (WorldSizeMismatch)"
        if fault not in RELAUNCHED or (cfg["max_restarts"] and fault not in ENDS_THE_LAUNCH):
            return f"the world size changes at the explorer's relaunch, which {fault} does not lead to here"
    if nnodes == "range":
        if cfg["topology"] != "2x1":
            return "a node range needs 2 nodes (topology 2x1)"
        if cfg["data"] == "stream":
            return "a stream's position is each rank's: a re-split stops by design (WorldSizeMismatch)"
    if fault == "cut_link" and not (heals(cfg) and cfg["topology"] == "2x1" and PARTITIONS_OK):
        return "cut_link: 2 healing nodes in network namespaces of their own (root)"
    if (fault in ("cut_link", "sigstop_worker") and heals(cfg) and cfg["topology"] == "2x1" and OTHER_HOST_OK
            and not cfg.get("peer_timeout")):
        return "a member silent on another host with the peer monitor off: nothing can name it (by design)"
    if fault == "sigstop_worker" and cfg["topology"] == "1":
        return "SIGSTOP of the only process: nothing is left to notice (the watchdog is stopped with it)"
    if fault == "kill9_slow_save":
        if cfg["topology"] == "1":
            return "the survivor checkpoint needs a survivor (2 ranks)"
        why = survivor_checkpoint_skipped(cfg)
        if why:
            return f"no survivor checkpoint to slow: {why}"
    if fault == "crash_one_rank":
        if cfg["topology"] != "1x2" or cfg["data"] == "stream":
            return "crash_one_rank: launch_training.sh starts one node of 2 ddp_training.py processes"
    if trainer == "hf":
        if fault not in HF_FAULTS or moment not in HF_MOMENTS:
            return f"an HF script has no fault_inject: {fault}@{moment} is not one of its faults"
        if cfg["act_ckpt"] == "offload":
            return "TrainingArguments has no offloaded activation checkpointing"
        fixed = [k for k, v in HF_FIXED.items() if cfg.get(k, DIMS[k][0]) != v]
        if fixed:
            return f"an HF trial fixes {', '.join(f'{k}={HF_FIXED[k]}' for k in fixed)}"
    return heal_applicable(cfg, fault)


def heal_applicable(cfg: dict, fault: str) -> str | None:
    """The rules of issue 31's heal dimension."""
    if not heals(cfg):
        return None
    if cfg["topology"] == "1":
        return "--heal: 2 processes here (one node of 2, or 2 nodes of 1: launch_training.sh --heal --node-rank)"
    if cfg["data"] == "stream":
        return "a stream whose dataset has a state of each rank's cannot heal: refused by design"
    if cfg["comm_hook"] == "powersgd":
        return "PowerSGD's error feedback is each rank's: --heal refuses it at --check-config"
    if cfg.get("world_change", "none") != "none" or cfg.get("nnodes", "fixed") != "fixed" or hf(cfg):
        return "heal in place: one launch of ddp_training.py on one fixed node"
    if fault not in HEAL_FAULTS and not (fault in ("kill9_node", "cut_link") and cfg["topology"] == "2x1"):
        return f"{fault} is not drawn with heal in place (HEAL_FAULTS; kill9_node and cut_link on 2 nodes)"
    return None


def survivor_checkpoint_skipped(cfg: dict) -> str | None:
    """Why a survivor would not write the survivor checkpoint (the trainer's _save_survivor_checkpoint), or None."""
    return ("checkpoint.save_on_peer_loss=false" if not cfg.get("save_on_peer_loss", True) else
            "a stream's state is every rank's" if cfg["data"] == "stream" else
            "PowerSGD's state is every rank's" if cfg["comm_hook"] == "powersgd" else None)


MODEL_DIMS = ("data", "spike_guard", "accum", "act_ckpt", "tiled_mlp", "comm_hook", "stop", "loss_average")
# The choices that change the final model come from a pool of recipes (drawn once from the full
# product), so that trials share their uninterrupted reference runs; the other choices are free.
# The pool of before loss_average, each recipe given a loss_average of its own.
RECIPES = [{k: r.choice(DIMS[k]) for k in MODEL_DIMS[:-1]} for r in [random.Random(19)] for _ in range(10)]
RECIPES = [recipe | {"loss_average": r.choice(DIMS["loss_average"])} for r in [random.Random(33)] for recipe in RECIPES]


def draw(rng: random.Random, fixed: dict | None = None) -> dict:
    """A trial from ``rng``; with ``fixed``, one whose configuration holds those choices."""
    while True:
        cfg = ({k: rng.choice(v) for k, v in DIMS.items() if k not in DRAWN_AFTER} | rng.choice(RECIPES)
               | {"heal": "restart", "split": "even", "victim": "last"})
        if hf(cfg):
            if rng.random() >= HF_SHARE:
                continue  # an HF trial fits most draws (its fixed choices): kept at about 1 in 8
            cfg |= HF_FIXED | ({"act_ckpt": "non_reentrant"} if cfg["act_ckpt"] == "offload" else {})
        fault = rng.choice([f for f in FAULTS if f not in DRAWN_LAST])
        moment = rng.choice(FAULTS[fault].moments)
        trial = {"config": cfg, "fault": fault, "moment": moment}
        if applicable(trial) is not None:
            continue
        if rng.random() < HEAL_SHARE:
            healing = {**trial, "config": {**cfg, "heal": "in_place"}}
            trial = healing if applicable(healing) is None else trial
        if fixed:
            if applicable(fixed_trial := {**trial, "config": {**trial["config"], **fixed}}) is not None:
                continue
            trial = fixed_trial
        cut = {**trial, "fault": "cut_link"}  # drawn last, as the heal dimension
        if trial["fault"] == "sigstop_worker" and applicable(cut) is None and rng.random() < CUT_LINK_SHARE:
            trial = cut
        uneven = {**trial, "config": {**trial["config"], "split": "uneven"}}
        if "split" not in (fixed or {}) and applicable(uneven) is None and rng.random() < UNEVEN_SHARE:
            trial = uneven
        first = {**trial, "config": {**trial["config"], "victim": "first"}}
        if "victim" not in (fixed or {}) and applicable(first) is None and rng.random() < FIRST_SHARE:
            trial = first
        return trial


# --- where a trial's files go -------------------------------------------------------------------
@dataclass
class Layout:
    work: Path
    ck: Path
    logs: Path
    export: Path | None  # None: the default, checkpoint_dir/export
    sentinels: list[Path] = field(default_factory=list)

    def own_dirs(self) -> list[Path]:
        return [p for p in (self.ck, self.logs, self.export or self.ck / "export")]


def make_layout(work: Path, cfg: dict) -> Layout:
    x = work / "runs" / "x"
    kind = cfg["layout"]
    if kind == "apart":
        lay = Layout(work, x / "ck", x / "logs", x / "export")
    elif kind == "default_export":
        lay = Layout(work, x / "ck", x / "logs", None)
    elif kind == "nested":
        lay = Layout(work, x / "checkpoints", x / "logs", x)
    else:
        lay = Layout(work, x, x / "logs", x)
    for d in (lay.ck, lay.logs):
        d.mkdir(parents=True, exist_ok=True)
    # A user's files: beside the run, and inside the directory the run's directories sit in.
    for path in (work / "notes.txt", x / "README.md", work / "runs" / "y" / "data.txt"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"a user's file at {path.name}\n")
        lay.sentinels.append(path)
    return lay


def config_args(trial: dict, lay: Layout, *, resume: str | None = None, foreign_path: Path | None = None) -> dict:
    cfg, fault = trial["config"], trial["fault"]
    w, accum = world(cfg), cfg["accum"]
    if hf(cfg):  # bench/explore_hf.py's flags: TrainingArguments
        return dict(out=str(lay.ck.parent), max_steps=MAX_STEPS, samples=BATCH * STEPS_PER_EPOCH * w,
                    save_steps=cfg["save_every_steps"], save_total_limit=cfg["keep_last"],
                    checkpointing=cfg["act_ckpt"], resume="auto" if (resume or cfg["resume"]) == "auto" else "none",
                    eval_steps=EVAL_EVERY, save_model=str(lay.export or lay.ck / "export"))
    args = {**BASE, "dataset_size": BATCH * STEPS_PER_EPOCH * w * accum, "data.gradient_accumulation_steps": accum,
            "num_workers": 2 * w if cfg["data"] == "map2" else 0, "spike.guard": cfg["spike_guard"],
            "memory.activation_checkpointing": cfg["act_ckpt"], "memory.tiled_mlp_chunks": cfg["tiled_mlp"],
            "ddp.comm_hook": cfg["comm_hook"], "checkpoint.every_steps": cfg["save_every_steps"],
            "save_interval": cfg["save_interval"], "checkpoint.keep_last": cfg["keep_last"],
            "checkpoint.dir": str(lay.ck), "logging.dir": str(lay.logs)}
    args["checkpoint.save_on_peer_loss"] = cfg.get("save_on_peer_loss", True)  # absent from older results
    args["train.loss_average"] = cfg.get("loss_average", "micro_batch")
    args["checkpoint.every_minutes"] = cfg.get("save_every_minutes", 0)
    args["recovery.peer_timeout_s"] = cfg.get("peer_timeout", 0)  # absent from older results: off, as they ran
    if elastic(cfg):
        # The global batch named, as a user whose run may change its world size names it: a launch
        # at another size with no checkpoint to take it from (a fresh start) keeps it too.
        args.update({"dropout": 0.0, "data.global_batch_size": BATCH * w * accum})
        if cfg.get("split", "even") == "uneven":  # one sample more: every world size splits it unevenly
            global_batch = BATCH * w * accum + 1
            args.update({"data.global_batch_size": global_batch, "dataset_size": STEPS_PER_EPOCH * global_batch})
    if cfg["comm_hook"] == "powersgd":
        args["ddp.powersgd_start_iter"] = 2
    if lay.export is not None:
        args["checkpoint.export_dir"] = str(lay.export)
    if cfg["stop"] == "max_steps" or cfg["data"] == "stream":
        args.update({"train.max_steps": MAX_STEPS, "num_epochs": NUM_EPOCHS})
    else:
        args.update({"train.max_steps": 0, "num_epochs": NUM_EPOCHS})
    mode = resume or cfg["resume"]
    args["checkpoint.resume"] = str(foreign_path) if mode == "path" else mode
    spec = injected(trial)
    if spec:
        args["recovery.fault_inject"] = spec
    if fault == "hang" or (fault == "sigstop_worker" and not heals(cfg)):  # healing, the peer monitor names it
        args.update(HANG_TIMEOUTS)
    if fault in ("sigstop_worker", "cut_link"):  # a peer stopped before the first step: the collective timeout
        args["ddp.timeout_s"] = STOPPED_PEER_TIMEOUT_S
    if fault == "second_launch":  # slow steps (a sleep, the same model), so that the two launches overlap
        args["recovery.fault_inject"] = "slow@step=0,ms=600,restart=*"
    if (rejoins(trial) or grows_back(trial)) and REJOIN_SLOW not in args.get("recovery.fault_inject", ""):
        args["recovery.fault_inject"] = "; ".join(filter(None, [args.get("recovery.fault_inject"), REJOIN_SLOW]))
    if fault == "crash_one_rank":
        args["recovery.max_no_progress_restarts"] = 1
    if fault == "user_error":
        args["dataset_size"] = 2
    return args


def victim(cfg: dict) -> int:
    """The rank (healing in place: the replica) that a worker's fault strikes."""
    return 0 if cfg.get("victim", "last") == "first" else world(cfg) - 1


def survivor(cfg: dict) -> int:
    """The replica whose log tells of a heal after the victim's loss (2 ranks: the other one)."""
    return world(cfg) - 1 if victim(cfg) == 0 else 0


def injected(trial: dict) -> str:
    """The fault_inject spec of a trial whose fault the framework fires itself ('' if external)."""
    cfg, fault, moment = trial["config"], trial["fault"], trial["moment"]
    k, last = moment_step(cfg, fault, moment), victim(cfg)
    spikes = "bad_data@step=7" if moment == "rollback" else ""
    kinds = {"kill9_worker": "sigkill", "sigterm_worker": "sigterm", "hang": "hang", "nan": "nan",
             "bad_data": "bad_data", "kill_dl_worker": "kill_worker"}
    if hf(cfg):
        return ""  # a script has no fault_inject: its faults are signals
    if fault == "crash_one_rank":  # fails the same way in every restart: no restart can help
        return f"crash@step={k},rank=1,restart=*"
    if fault == "kill9_slow_save":  # rank 0 killed; the last rank survives and saves alone
        return f"sigkill@step={k},rank=0"
    if stops_itself(trial):
        return f"sigstop@step={k},rank={last}"
    if fault not in kinds or moment in ("rollback", "export"):
        return spikes
    at = {"eval": ",at=eval", "ckpt_write": ",at=save", "final_save": ",at=save"}.get(moment, "")
    return "; ".join(filter(None, [f"{kinds[fault]}@step={k},rank={last}{at}", spikes]))


def rejoins(trial: dict) -> bool:
    """A node range whose last node is lost and that is left to train on: the explorer starts the
    node again once the survivor trains alone (a scheduler's replacement node)."""
    cfg = trial["config"]
    return cfg["max_restarts"] > 0 and (
        (cfg.get("nnodes") == "range" and trial["fault"] in ("kill9_node", "kill9_agent"))
        or (heals(cfg) and cfg["topology"] == "2x1" and trial["fault"] == "kill9_node"))


def grows_back(trial: dict) -> bool:
    """Healing in place with restarts left: every step slowed to >= 600 ms (REJOIN_SLOW), so that a
    lost worker started again by its torchrun (a few seconds) rejoins before the run ends, and the
    group grows back in place."""
    return heals(trial["config"]) and trial["config"]["max_restarts"] > 0 and trial["fault"] != "user_error"


# --- launching ----------------------------------------------------------------------------------
def flags(args: dict) -> list[str]:
    return [part for key, value in args.items()
            for part in (f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value))]


class Job:
    """The agents (or the one process) of one launch of a trial, outputs in files."""

    def __init__(self, trial: dict, args: dict, out: Path, tag: str, *, world_size: int | None = None):
        cfg, fault = trial["config"], trial["fault"]
        script = ROOT / ("bench/explore_hf.py" if hf(cfg) else
                         "bench/explore_stream.py" if cfg["data"] == "stream" else "ddp_training.py")
        argv, restarts = flags(args), str(cfg["max_restarts"])
        w = world_size or world(cfg)
        port = free_port()
        self.env = worker_env()
        self.out, self.tag, self.script = out, tag, script
        if heals(cfg) and cfg["topology"] == "2x1":
            self.cmds = [[str(ROOT / "launch_training.sh"), "--cpu", "--nproc", "1", "--max-restarts", restarts,
                          "--heal", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                          f"127.0.0.1:{port}", "--rdzv-id", f"ex-{port}", "--", *argv] for node in range(2)]
            self.env = {k: v for k, v in self.env.items() if k != "PYTHONPATH"} | {
                "PYTHON": sys.executable, "GLOO_SOCKET_IFNAME": "lo"}
            if OTHER_HOST_OK:  # node 1 as on another host: node 0 can neither see nor kill its processes
                self.cmds[1] = [*OTHER_HOST, *self.cmds[1]]
            if fault == "cut_link":  # each node in a namespace of its own, node 0's address the endpoint
                hosts = _hosts.setdefault(str(out), TwoHosts(out))
                hosts.make()
                endpoint = f"{hosts.addresses[0]}:{port}"
                self.cmds = [["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={link}",
                              *[endpoint if part == f"127.0.0.1:{port}" else part for part in cmd]]
                             for ns, link, cmd in zip(hosts.netns, hosts.links, self.cmds, strict=True)]
        elif fault in ("sigterm_launcher", "crash_one_rank") or heals(cfg):
            if fault == "crash_one_rank":
                restarts = str(RESTARTS_ONE_RANK_ERROR)
            self.cmds = [[str(ROOT / "launch_training.sh"), "--cpu", "--nproc", str(w), "--max-restarts", restarts,
                          *(["--heal"] if heals(cfg) else []), "--", *argv]]
            self.env = {k: v for k, v in self.env.items() if k != "PYTHONPATH"} | {"PYTHON": sys.executable}
        elif w == 1 and cfg["max_restarts"] == 0 and fault not in ("kill9_agent", "kill9_node"):
            self.cmds = [[sys.executable, str(script), *argv]]
        elif cfg["topology"] == "2x1" and world_size is None:
            self.cmds = []
            rng = cfg.get("nnodes") == "range"
            for _ in range(2):
                cmd = torchrun_cmd(script, argv, nproc=1, port=port,
                                   extra=["--max-restarts", restarts, "--rdzv-id", f"ex-{port}",
                                          *(["--rdzv-conf", RDZV_CONF] if rng else [])])
                cmd[cmd.index("--nnodes") + 1] = "1:2" if rng else "2"
                self.cmds.append(cmd)
            if rng:  # as launch_training.sh sets them for a node range
                self.env |= {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "RDZV_STORE_ENDPOINT": f"c10d://127.0.0.1:{port}"}
        else:
            self.cmds = [torchrun_cmd(script, argv, nproc=w, port=port, extra=["--max-restarts", restarts])]
        self.procs, self.errs = [], []
        for node, cmd in enumerate(self.cmds):
            if node and (cfg.get("nnodes") == "range" or heals(cfg)):
                time.sleep(0.5)  # node 0 first: it hosts the c10d store, or the run's store
            self.start(cmd, node)

    def start(self, cmd: list[str], node: int) -> subprocess.Popen:
        err = self.out / f"{self.tag}.node{node}.err"
        with open(self.out / f"{self.tag}.node{node}.out", "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=fo, stderr=fe, start_new_session=True)
        self.procs.append(proc)
        self.errs.append(err)
        return proc

    def rejoin(self) -> None:
        """The lost last node back: its agent started again with the same command."""
        self.start(self.cmds[-1], len(self.procs))

    def done(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def stderr(self) -> str:
        return "".join(e.read_text(errors="replace") for e in self.errs if e.exists())

    def workers(self) -> dict[int, psutil.Process]:
        found = {}
        for agent in self.procs:
            # An agent we have reaped (poll() saw it exit) no longer owns its pid: another process,
            # anywhere on the machine, may have it now. Unreaped, its pid cannot be reused.
            if agent.poll() is not None:
                continue
            try:
                procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in procs:
                try:
                    env = proc.environ()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                if "RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:
                    # Healing in place, each rank is a torchrun job of its own (RANK 0): its replica.
                    found[int(env.get("HEAL_REPLICA", env["RANK"]))] = proc
                elif len(self.cmds) == 1 and proc.pid == agent.pid and self.cmds[0][:2] == [sys.executable,
                                                                                          str(self.script)]:
                    found.setdefault(0, proc)  # a plain process is rank 0 itself
        return found

    def kill(self, marker: str) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        kill_matching(marker)
        for proc in self.procs:
            proc.wait()


_tails: dict[Path, tuple[int, str]] = {}
_tails_lock = threading.Lock()


def log_has(lay: Layout, needle: str) -> bool:
    """Whether rank 0's log holds ``needle``; reads only what was appended since the last call."""
    path = lay.logs / "rank_0.log"
    with _tails_lock:
        offset, text = _tails.get(path, (0, ""))
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                new = f.read()
        except FileNotFoundError:
            return False
        text += new.decode(errors="replace")
        _tails[path] = (offset + len(new), text)
    return needle in text


def moment_reached(trial: dict, lay: Layout):
    """A condition, truthy once the trial's moment has come (for the external faults)."""
    cfg, fault, moment = trial["config"], trial["fault"], trial["moment"]
    k, n = moment_step(cfg, fault, moment), total_steps(cfg)
    if moment == "startup":
        return lambda: log_has(lay, "process group up") or log_has(lay, "data:") or log_has(lay, "effective batch:")
    if moment in ("mid_step", "epoch_boundary"):
        return lambda: log_has(lay, f"step {k}/{n} ")
    if moment == "eval":
        return lambda: log_has(lay, f"evaluating at step {k}")
    if moment == "ckpt_write":
        return lambda: checkpoint_temp(lay.ck, [k]) or log_has(lay, f"checkpoint step {k} written")
    if moment == "rollback":
        return lambda: log_has(lay, "rolled back to the checkpoint")
    if moment == "final_save":
        return lambda: checkpoint_temp(lay.ck, [n]) or log_has(lay, f"step {n} | val_loss")
    if moment == "export":
        return lambda: log_has(lay, f"checkpoint step {n} written")
    raise ValueError(moment)


def newest_own_step_file(lay: Layout, foreign: set[str]) -> Path | None:
    files = sorted(p for p in lay.ck.glob("step_*.pt") if p.name not in foreign and p.is_file())
    return files[-1] if files else None


def deliver(trial: dict, job: Job, lay: Layout, foreign: set[str], res: dict) -> bool:
    """Deliver an external fault now; False when its target is gone."""
    fault, last, notes = trial["fault"], victim(trial["config"]), res["notes"]
    workers = job.workers()
    try:
        if fault in ("kill9_worker", "sigterm_worker", "corrupt_newest", "unreadable_newest"):
            if last not in workers:
                return False
            if fault in ("corrupt_newest", "unreadable_newest"):
                newest = newest_own_step_file(lay, foreign)
                if newest is None:
                    notes.append("no step file of this run to damage")
                    return False
                if fault == "corrupt_newest":
                    os.truncate(newest, newest.stat().st_size // 2)
                else:
                    newest.rename(lay.work / f"aside-{newest.name}")
                    newest.mkdir()
                    # Nothing else to resume: the fault stays, so no restart can read it (a real
                    # EIO may pass, a directory does not); an explained stop naming it is expected.
                    if newest_own_step_file(lay, foreign) is None:
                        res["unreadable_only"] = newest.name
                notes.append(f"damaged {newest.name}")
            # psutil's send_signal checks the process is still the one found (not a reused pid).
            workers[last].send_signal(signal.SIGTERM if fault == "sigterm_worker" else signal.SIGKILL)
        elif fault in ("kill9_agent", "kill9_node"):
            agent = job.procs[-1]
            if agent.poll() is not None:
                return False
            children = psutil.Process(agent.pid).children(recursive=True) if fault == "kill9_node" else []
            agent.send_signal(signal.SIGKILL)
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        elif fault == "sigterm_launcher":
            if job.procs[0].poll() is not None:
                return False
            job.procs[0].send_signal(signal.SIGTERM)
        elif fault == "cut_link":
            _hosts[str(Path(res["dir"]))].link(False)
        elif fault == "sigstop_worker":
            if last not in workers:
                return False
            workers[last].send_signal(signal.SIGSTOP)  # never continued
        else:
            raise ValueError(fault)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
    return True


def bound_s(trial: dict) -> float:
    """How long one launch may take before it counts as a hang: start-up under load, the steps,
    each torchrun restart, and the hang watchdog."""
    cfg, fault = trial["config"], trial["fault"]
    per_restart = 45.0 + 3.0 * total_steps(cfg) * cfg["accum"]
    if rejoins(trial):
        per_restart += 0.6 * total_steps(cfg) + REJOIN_AFTER_S  # REJOIN_SLOW
    elif grows_back(trial):
        per_restart += 0.6 * total_steps(cfg)
    restarts = RESTARTS_ONE_RANK_ERROR if fault == "crash_one_rank" else cfg["max_restarts"]
    # A stopped worker ignores torchrun's SIGTERM: its agent sends SIGKILL 30 s later.
    extra = {"hang": 20.0, "sigstop_worker": 20.0 + STOPPED_PEER_TIMEOUT_S + 30.0, "cut_link": 60.0,
             "kill9_slow_save": SLOW_SAVE_S}.get(fault, 0.0)
    return per_restart * (1 + restarts) + extra


# --- reading what a run left --------------------------------------------------------------------
def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_summary(lay: Layout) -> dict | None:
    try:
        return json.loads((lay.logs / "summary.json").read_text())
    except (FileNotFoundError, ValueError, NotADirectoryError):
        return None


def samples_by_epoch(lay: Layout, w: int) -> tuple[dict[int, collections.Counter], int]:
    """epoch -> Counter of committed sample indices, the last record of each (epoch, step, rank)
    winning, each file's purges applied (as read_samples does: a rank's file is purged by whoever
    redoes its steps, its own rank or, after a shrink, rank 0); and the number of torn lines."""
    records, torn = {}, 0
    for rank in range(w):
        path = lay.logs / f"samples_rank_{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                if "purge_from" in rec:
                    records = {k: v for k, v in records.items() if k[2] != rank or k[1] < rec["purge_from"]}
                    continue
                records[(rec["epoch"], rec["step"], rank)] = rec["indices"]
            except (ValueError, KeyError, TypeError):
                torn += 1
    out: dict[int, collections.Counter] = {}
    for (epoch, _step, _rank), indices in records.items():
        out.setdefault(epoch, collections.Counter()).update(indices)
    return out, torn


def metrics_rows(lay: Layout) -> list[dict] | None:
    from framework.observability.metrics import read_metrics
    path = lay.logs / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else None


def written_steps(lay: Layout) -> set[int]:
    try:
        text = (lay.logs / "rank_0.log").read_text(errors="replace")
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for m in re.finditer(r"checkpoint step (\d+) written", text)}


# --- one run of a trial (the trial itself, or its reference) ------------------------------------
_foreign_lock = threading.Lock()
_foreign_cache: dict[tuple, Path] = {}


def foreign_template(cfg: dict, workdir: Path) -> Path:
    """The checkpoint_dir of another run: an earlier run on the same data with another learning
    rate, stopped after FOREIGN_STEPS steps with a checkpoint every 2. Made once per world size,
    accumulation and data kind, and copied into every trial that needs one."""
    w, accum, stream = world(cfg), cfg["accum"], cfg["data"] == "stream"
    uneven = cfg.get("split", "even") == "uneven"
    with _foreign_lock:
        key = (w, accum, stream, uneven)
        if key in _foreign_cache:
            return _foreign_cache[key]
        out = workdir / f"foreign-{w}-{accum}-{int(stream)}{'-uneven' if uneven else ''}"
        shutil.rmtree(out, ignore_errors=True)
        args = {**BASE, "learning_rate": FOREIGN_LR, "dataset_size": BATCH * STEPS_PER_EPOCH * w * accum,
                "data.gradient_accumulation_steps": accum, "num_workers": 0, "train.max_steps": FOREIGN_STEPS,
                "checkpoint.every_steps": 2, "checkpoint.keep_last": 3, "checkpoint.export_dir": "none",
                "checkpoint.dir": str(out / "ck"), "logging.dir": str(out / "logs"), "checkpoint.resume": "none"}
        if uneven:  # the same data and global batch as the trial's (config_args)
            global_batch = BATCH * w * accum + 1
            args.update({"data.global_batch_size": global_batch, "dataset_size": STEPS_PER_EPOCH * global_batch})
        out.mkdir(parents=True)
        launch = run_forked({"config": cfg, "fault": "none", "moment": "startup"}, args, out)
        if launch["codes"] != [0] * w:
            raise SystemExit(f"the other run (for a checkpoint_dir that holds one) failed:\n{launch['stderr'][-3000:]}")
        _foreign_cache[key] = out / "ck"
        return out / "ck"


def run_trial(trial: dict, workdir: Path, *, reference: bool = False) -> dict:
    """Run ``trial`` (with its fault, or none for a reference) and return what it left."""
    cfg = trial["config"]
    if reference:  # the same run with no fault: the rollback moment's loss spike stays in it
        trial = {"config": cfg, "fault": "none", "moment": "rollback" if trial["moment"] == "rollback" else "startup"}
    fault = trial["fault"]
    work = Path(tempfile.mkdtemp(prefix="ref-" if reference else "trial-", dir=workdir))
    lay = make_layout(work, cfg)
    foreign_files: dict[str, str] = {}
    foreign_path = None
    if cfg["foreign"] or cfg["resume"] == "path":
        template = foreign_template(cfg, workdir)
        if cfg["foreign"]:
            for f in template.glob("step_*.pt"):
                shutil.copy2(f, lay.ck / f.name)
            shutil.copy2(template / "manifest.json", lay.ck / "manifest.json")
            foreign_files = {f.name: sha(lay.ck / f.name) for f in template.glob("step_*.pt")}
        foreign_path = work / "elsewhere" / "step_00000004.pt"
        foreign_path.parent.mkdir()
        shutil.copy2(template / "step_00000004.pt", foreign_path)
        lay.sentinels.append(foreign_path)
    sentinels = {str(p): sha(p) for p in lay.sentinels}
    res = {"dir": str(work), "launches": [], "notes": [], "hit": None, "timed_out": False}
    mounted = False
    if fault == "full_disk":
        why = mount_tmpfs(lay.ck, 1000)
        if why:
            res["notes"].append(f"no tmpfs: {why}")
        else:
            mounted = True
    marker = str(work) + "/"
    if reference:
        args = config_args(trial, lay, foreign_path=foreign_path)
        if hf(cfg):  # a script of its own, launched as the trial is
            res["launches"].append(run_job(trial, Job(trial, args, work, "reference"), lay, set(), marker, res,
                                           external=False))
            kill_matching(marker)
        else:
            res["launches"].append(run_forked(trial, args, work))
        res.update(verdict_inputs(trial, lay, sentinels, foreign_files))
        return res
    if fault == "user_error":  # the user's pre-flight, as launch_training.sh runs it before torchrun
        args = config_args(trial, lay, foreign_path=foreign_path)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "ddp_training.py"), "--check-config", *flags(args)],
                              cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=120)
        res["launches"].append({"codes": [proc.returncode], "timed_out": False, "stderr": proc.stderr[-6000:],
                                "wall_s": round(time.monotonic() - start, 1), "left_behind": 0})
        res.update(verdict_inputs(trial, lay, sentinels, foreign_files))
        return res
    try:
        for attempt in (0, 1):
            # The relaunch resumes with resume=auto, or, while the run has no checkpoint of its own,
            # repeats its command (resume=auto would start a resume=PATH run afresh).
            relaunch_mode = "auto" if newest_own_step_file(lay, set(foreign_files)) else None
            args = config_args(trial, lay, resume=relaunch_mode if attempt else None, foreign_path=foreign_path)
            if attempt:
                args.pop("recovery.fault_inject", None)  # a fault fires in the first start (restart 0) only, anyway
                if relaunch_world(cfg) != world(cfg):
                    res["world_changed"] = f"{world(cfg)} -> {relaunch_world(cfg)} ranks"
            job = Job(trial, args, work, f"launch{attempt}", world_size=relaunch_world(cfg) if attempt else None)
            launch = run_job(trial, job, lay, set(foreign_files), marker, res, external=attempt == 0)
            res["launches"].append(launch)
            if launch["timed_out"]:
                res["timed_out"] = True
                break
            summary = read_summary(lay)
            finished = is_finished(cfg, summary)
            fatal = marker_text(lay, "FATAL")
            clean = finished and all(c == 0 for c in launch["codes"])
            if clean or fatal or attempt or 2 in launch["codes"] or fault == "user_error":
                break
            res["relaunched"] = True
    finally:
        kill_matching(marker)
        hosts = _hosts.pop(str(work), None)
        if hosts is not None:
            hosts.remove()
        if injected(trial) and res["hit"] is None:
            # The trial's own faults, not the slowing of every step (REJOIN_SLOW) beside them.
            kinds = [part.split("@")[0].strip() for part in injected(trial).split(";")]
            said = [f"fault injection: {'killed DataLoader worker' if k == 'kill_worker' else k}" for k in kinds]
            texts = [p.read_text(errors="replace") for p in lay.logs.glob("rank_*.log")]
            res["hit"] = any(word in text for text in texts for word in said)
            if not res["hit"]:
                res["notes"].append("fault_inject never fired")
        res.update(verdict_inputs(trial, lay, sentinels, foreign_files))
        # A survivor of a peer's loss saved the last finished step alone (the trainer's _save_survivor_checkpoint).
        logs = [p.read_text(errors="replace") for p in lay.logs.glob("rank_*.log")]
        res["saved_alone"] = any("the last step every rank finished, alone" in text for text in logs)
        # A restart's rank 0 waited for the lock of a survivor of its run (checkpoint_files._locked_fd).
        res["waited_for_lock"] = any("(a survivor saving alone?): waiting" in text for text in logs)
        if mounted:
            unmount(lay.ck)
    return res


_forkserver = None
_forkserver_lock = threading.Lock()


def forkserver():
    """A multiprocessing fork server that has imported torch and the framework once: an
    uninterrupted reference run forks from it instead of starting (and importing) anew."""
    global _forkserver
    with _forkserver_lock:
        if _forkserver is None:
            import multiprocessing
            os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["framework.trainer", "framework.data", "ddp_training", "explore_stream"])
            _forkserver = ctx
        return _forkserver


def forked_rank(argv: list[str], stream: bool, rank: int, world_size: int, port: int, out: str) -> None:
    """One rank of a reference run, in a process forked from the fork server."""
    os.setsid()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import logging

    import ddp_training
    import explore_stream
    try:
        code = (explore_stream.main if stream else ddp_training.main)(argv)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_forked(trial: dict, args: dict, work: Path) -> dict:
    """An uninterrupted run of ``args`` on world(cfg) forked ranks; its launch record."""
    cfg, ctx = trial["config"], forkserver()
    w, port, start = world(cfg), free_port(), time.monotonic()
    out = work / "reference.out"
    procs = [ctx.Process(target=forked_rank, args=(flags(args), cfg["data"] == "stream", r, w, port, str(out)))
             for r in range(w)]
    for proc in procs:
        proc.start()
    deadline = start + bound_s(trial)
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(proc.is_alive() for proc in procs)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {"codes": [proc.exitcode for proc in procs], "timed_out": timed_out,
            "wall_s": round(time.monotonic() - start, 1), "stderr": out.read_text(errors="replace")[-6000:]
            if out.exists() else "", "left_behind": 0}


def marker_text(lay: Layout, name: str) -> str | None:
    try:
        return (lay.ck / name).read_text(errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def run_job(trial, job: Job, lay: Layout, foreign: set[str], marker: str, res: dict, *, external: bool) -> dict:
    fault = trial["fault"]
    start, bound = time.monotonic(), bound_s(trial)
    needs_signal = external and fault in ("kill9_worker", "kill9_agent", "kill9_node", "sigterm_worker",
                                          "sigterm_launcher", "corrupt_newest", "unreadable_newest",
                                          "second_launch", "sigstop_worker", "cut_link") and not injected_fully(trial)
    condition = moment_reached(trial, lay) if needs_signal else None
    second, second_ended = None, None
    timed_out = False
    rejoin_at = None  # a node range's lost node starts again then
    freezer_done = threading.Event()
    if external and fault == "kill9_slow_save":
        threading.Thread(target=freeze_in_save, args=(trial, job, lay, res, freezer_done), daemon=True).start()
    # After a fault on 2 nodes, an agent can outlive every worker: in torchrun's exit barrier (300 s)
    # when its workers exited 0 and the other node's failed (a worker killed at the export, after
    # rank 0 finished), or in its rendezvous (600 s) for a node that is gone (a known limit of
    # torchrun, docs/known-limits.md; issue 21): as a scheduler would, the job is ended once no worker
    # of it is left. A stopped worker (sigstop_worker) counts as none: after the other node's agent
    # gave up (no restarts left), nothing tells its own agent, which would wait for it forever.
    orphan_agent = external and trial["config"]["topology"] == "2x1"
    no_workers_since, next_look = None, 0.0
    while not job.done():
        if orphan_agent and (res.get("hit") or heals(trial["config"])) and time.monotonic() >= next_look:
            next_look = time.monotonic() + 1.0
            workers = job.workers().values()
            # A stopped worker with restarts left: its agent ends it (SIGTERM, SIGKILL 30 s later)
            # before it joins the restart's round; the bound ends the launch if it never does.
            # Healing, node 1's torchrun is a job of its own, which nothing tells once node 0 ended:
            # its stopped worker (on "another host") is ended as a scheduler would reclaim the host.
            # Cut off (cut_link), it may wait for the run's store for ddp.timeout_s: 10 s, then ended too.
            healed_alone = heals(trial["config"]) and job.procs[0].poll() is not None
            if not healed_alone and (any(running(proc) for proc in workers)
                                     or (workers and trial["config"]["max_restarts"])):
                no_workers_since = None
            elif no_workers_since is None:
                no_workers_since = time.monotonic()
            # past a restart's re-rendezvous; healing, past node 0's run store's linger for node 1's clients
            elif time.monotonic() - no_workers_since > (15.0 if heals(trial["config"]) else 10.0):
                stopped = list(job.workers().values())
                res["notes"].append("node 1 ended by the explorer 10 s after node 0's launcher (a host reclaimed)"
                                    if healed_alone else "the job ended by the explorer: only torchrun's agent was "
                                    "left" + (" (and a stopped worker)" if stopped else ""))
                for proc in stopped:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.kill()
                job.kill(marker + "__none__")
                break
        if second is not None and second_ended is None and second.done():
            second_ended = time.monotonic()  # while the first launch still runs
        if condition is not None and condition():
            condition = None
            if fault == "second_launch":
                args = config_args(trial, lay, foreign_path=Path(res["dir"]) / "elsewhere" / "step_00000004.pt")
                second = Job(trial, args, Path(res["dir"]), "second")
                res["hit"] = True
            else:
                res["hit"] = deliver(trial, job, lay, foreign, res)
                res["fault_at_s"] = round(time.monotonic() - start, 1)
                if res["hit"] and rejoins(trial):
                    rejoin_at = time.monotonic() + REJOIN_AFTER_S
        if rejoin_at is not None and (time.monotonic() >= rejoin_at or log_has(lay, " x 1 ranks x ")
                                      or log_has(lay, "goes on with 1 of 2 ranks")):
            rejoin_at = None
            job.rejoin()
            res["rejoined_at_s"] = round(time.monotonic() - start, 1)
            no_workers_since = None
        if time.monotonic() - start > bound:
            timed_out = True
            break
        time.sleep(0.01 if condition is not None else 0.1)
    if condition is not None and res["hit"] is None:
        res["hit"] = False
        res["notes"].append("the run ended before the moment came")
    if second is not None:
        while not second.done() and time.monotonic() - start < bound:
            time.sleep(0.05)
        if not second.done():
            timed_out = True
        res["second"] = {"codes": second.codes(), "stderr_tail": second.stderr()[-1500:],
                         "ended_while_first_ran": second_ended is not None}
        second.kill(marker + "__none__")
    if timed_out:
        res["notes"].append(f"launch still running after {bound:.0f} s; killed")
        res["stacks"] = dump_stacks(marker, lay.logs / "hang_stacks.txt")
        job.kill(marker)
    else:
        # Workers whose agent was killed save and exit on their own (PR_SET_PDEATHSIG): they may
        # outlive it by a checkpoint write; one still there after the grace is left behind.
        grace = time.monotonic() + ORPHAN_GRACE_S
        while processes_matching(marker) and time.monotonic() < grace:
            time.sleep(0.2)
    freezer_done.set()
    codes = job.codes()
    if "rejoined_at_s" in res and codes[-1] != 0 and is_finished(trial["config"], read_summary(lay)) and \
            "checkpoint on 2 ranks" not in (lay.logs / "rank_0.log").read_text(errors="replace"):
        # The node came back after the survivor had finished alone: there was no run left to join.
        res["notes"].append(f"the rejoined node came after the run's end (exit {codes[-1]}, not counted)")
        codes = codes[:-1]
    return {"codes": codes, "timed_out": timed_out, "wall_s": round(time.monotonic() - start, 1),
            "stderr": job.stderr()[-6000:], "left_behind": len(processes_matching(marker))}


def dump_stacks(marker: str, path: Path) -> str | None:
    """Every live process of a hung trial, its threads' Python and native stacks (py-spy, where it is
    installed), written to ``path`` before the kill: a hang found once must show where it waited."""
    if shutil.which("py-spy") is None:
        return None
    dumps = []
    for proc in processes_matching(marker):
        try:
            out = subprocess.run(["py-spy", "dump", "--native", "--pid", str(proc.pid)], capture_output=True,
                                 text=True, timeout=30)
            dumps.append(f"=== pid {proc.pid}: {' '.join(proc.cmdline())[:300]}\n{out.stdout}{out.stderr}")
        except (subprocess.TimeoutExpired, psutil.NoSuchProcess, OSError) as e:
            dumps.append(f"=== pid {proc.pid}: no dump ({e})")
    with contextlib.suppress(OSError):
        path.write_text("\n".join(dumps))
    return str(path)


def freeze_in_save(trial: dict, job: Job, lay: Layout, res: dict, done: threading.Event) -> None:
    """kill9_slow_save: once the survivor (the last rank; rank 0 is the one killed) holds
    checkpoint_dir's lock, which only its survivor checkpoint takes, stop it for SLOW_SAVE_S: a save that
    outlasts the next round's start (a large model on a slow disk)."""
    last, lock, survivor = world(trial["config"]) - 1, lay.ck / ".lock", None
    while not done.is_set():
        if survivor is None:
            survivor = job.workers().get(last)
            time.sleep(0.05)
            continue
        try:
            holder = json.loads(lock.read_text()).get("pid")
        except (OSError, ValueError, AttributeError):
            holder = None
        if holder == survivor.pid:
            try:
                survivor.suspend()
                frozen = time.monotonic()
                res["froze_survivor"] = True
                res["notes"].append(f"the survivor (rank {last}) stopped for {SLOW_SAVE_S:.0f} s holding the lock")
                done.wait(SLOW_SAVE_S)
                survivor.resume()
                res["froze_survivor_s"] = round(time.monotonic() - frozen, 1)
            except psutil.NoSuchProcess:
                pass
            return
        time.sleep(0.001)


def running(proc: psutil.Process) -> bool:
    try:
        return proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def injected_fully(trial: dict) -> bool:
    """The fault is fired by fault_inject alone (no external signal)."""
    return (trial["fault"] in ("kill9_worker", "sigterm_worker") and trial["moment"] not in ("rollback", "export")
            and not hf(trial["config"])) or stops_itself(trial)


def stops_itself(trial: dict) -> bool:
    """Healing in place, a SIGSTOP inside a step comes from fault_inject (the worker stops itself at
    the step's start): a signal sent when the log shows step K lands anywhere in the next
    milliseconds, often in an evaluation, which restarts from the checkpoint by design."""
    return (trial["fault"] == "sigstop_worker" and heals(trial["config"])
            and trial["moment"] in HEALS_IN_PLACE["sigstop_worker"])


ROLLED_BACK = r"rolled back to the checkpoint of step (\d+)"


def started_sizes(log: str) -> list[int]:
    """The world size of each (re)start in a rank's log (its effective-batch line, an even split or not)."""
    return [int(even or uneven) for even, uneven in re.findall(
        r"effective batch: (?:\d+ per rank x (\d+) ranks|(\d+) ranks with)", log)]


def regroupings(log: str) -> list[tuple[int, int]]:
    """(old, new) world size of each heal, then of each growth, in place in a rank's log."""
    return ([(int(old), int(new)) for new, old in re.findall(r"goes on with (\d+) of (\d+) ranks", log)]
            + [(int(old), int(new)) for new, old in re.findall(r"trains on (\d+) ranks \(was (\d+)", log)])


def verdict_inputs(trial: dict, lay: Layout, sentinels: dict, foreign_files: dict) -> dict:
    cfg = trial["config"]
    changed = []
    for path, digest in sentinels.items():
        p = Path(path)
        if not p.is_file() or sha(p) != digest:
            changed.append(f"{path} {'deleted' if not p.exists() else 'changed'}")
    adopted = resumed_foreign(lay, foreign_files)
    for name, digest in foreign_files.items():
        p = lay.ck / name
        if adopted and not p.exists():
            continue  # resume=auto continued that lineage (as documented): its keep_last prunes it
        if not p.is_file() or sha(p) != digest:
            changed.append(f"another run's {name} {'deleted' if not p.exists() else 'changed'}")
    manifest_missing = []
    try:
        entries = json.loads((lay.ck / "manifest.json").read_text())
        manifest_missing = [e["file"] for e in entries if not (lay.ck / e["file"]).exists()]
    except (FileNotFoundError, ValueError, NotADirectoryError, TypeError, KeyError):
        entries = None
    samples, torn = samples_by_epoch(lay, max(world(cfg), relaunch_world(cfg)))
    export = lay.export or lay.ck / "export"
    # Every replica's log, read once.
    texts = {p.name: p.read_text(errors="replace") for p in sorted(lay.logs.glob("rank_*.log"))} \
        if lay.logs.is_dir() else {}
    log0 = texts.get("rank_0.log", "")
    # Each (re)start's world size, from its effective-batch line: a resume at another size, or a
    # fresh start at another (no checkpoint yet) with the same global batch.
    # The first launch's size leads: a launch killed before it logged one (kill -9 at start-up)
    # left the relaunch's as the only line, which hid its change of size.
    sizes = [world(cfg)] + started_sizes(log0)
    # Healing in place: each heal and each growth, in the survivor's log (replica 0's, or the last
    # one's when the fault strikes rank 0: ``victim``); a restart from the checkpoint through the
    # run's store, on any rank's.
    kept = texts.get(f"rank_{survivor(cfg)}.log", "")
    regrouped = regroupings(kept)
    # A change that only another replica's log tells: the victim's restarted process that formed a
    # restart generation alone and grew back (seed 42000's trial 67: 2 -> 1 -> 2 ranks, all in the
    # victim's log, and compared bit for bit), or its own start at another size.
    others = [text for name, text in texts.items() if name != f"rank_{survivor(cfg)}.log"]
    elsewhere = [change for text in others
                 for change in regroupings(text) + [(world(cfg), n) for n in started_sizes(text)]]
    regrouped += [change for change in dict.fromkeys(elsewhere) if change not in regrouped and change[0] != change[1]]
    # Whether the rollback moment's injected spike (bad_data@step=7, first launch only) fired: a
    # fault delivered at an earlier, natural rollback can end that launch before step 7.
    injected_spike = any("fault injection: bad_data" in text for text in texts.values())
    logs = list(texts.values())
    return {"world_changes": [f"{a} -> {b}" for a, b in zip(sizes, sizes[1:], strict=False) if a != b]
            + [f"{a} -> {b} in place" for a, b in regrouped],
            "healed": kept.count("healed in place: a peer was lost"),
            "restarted_in_store": any("resumes from the checkpoint" in text for text in logs),
            "final_weights": final_weights(lay) if elastic(cfg) else None,
            "node_lost_marker": marker_text(lay, "NODE_LOST") is not None,
            "changed": changed, "manifest_present": entries is not None, "manifest_missing": manifest_missing,
            "summary": read_summary(lay), "fatal": marker_text(lay, "FATAL"),
            "preempted_marker": marker_text(lay, "PREEMPTED") is not None,
            "metrics": metrics_rows(lay), "samples": {str(k): dict(v) for k, v in samples.items()}, "torn": torn,
            "written_steps": sorted(written_steps(lay)),
            "logs_present": {n: (lay.logs / n).is_file() for n in ("rank_0.log", "metrics.jsonl", "summary.json")},
            "export_present": (export / "model.safetensors").is_file(),
            "resumed_foreign": adopted, "injected_spike": injected_spike,
            "rollback_targets": sorted({int(n) for n in re.findall(ROLLED_BACK, log0)})}


def final_weights(lay: Layout) -> dict | None:
    """The final model's weights (checkpoint_dir/final_model.pt), for a comparison within a tolerance."""
    import torch
    try:
        return torch.load(lay.ck / "final_model.pt", weights_only=True, map_location="cpu")
    except (FileNotFoundError, NotADirectoryError, RuntimeError, EOFError):
        return None


def max_weight_diff(a: dict, b: dict) -> float:
    """The largest absolute difference of two state dicts, the attention key biases left out: their
    gradient is 0 exactly (the softmax cancels them), and AdamW turns fp32's summation-order noise
    there into a walk of up to lr a step that says nothing about the training (tests/integration/test_elastic.py)."""
    def part(name, t):
        if name.endswith("attn.qkv.bias"):
            n = t.numel() // 3
            return t.new_tensor([]) if n == 0 else t.flatten()[[*range(n), *range(2 * n, 3 * n)]]
        return t
    if a.keys() != b.keys():
        return float("inf")
    return max(((part(k, a[k]) - part(k, b[k])).abs().max().item() for k in a if a[k].numel()), default=0.0)


def resumed_foreign(lay: Layout, foreign_files: dict) -> bool:
    """Whether a launch resumed from one of the other run's checkpoints."""
    log_path = lay.logs / "rank_0.log"
    if not foreign_files or not log_path.is_file():
        return False
    names = "|".join(map(re.escape, foreign_files))
    return re.search(rf"resuming from \S*/({names})\b", log_path.read_text(errors="replace")) is not None


# --- the invariants ------------------------------------------------------------------------------
def check(trial: dict, res: dict, ref: dict | None) -> dict[str, str | None]:
    """invariant -> None (holds), 'n/a', or what broke it. Pure: works on recorded results."""
    ctx = Context(trial, res, ref)
    return {"nothing_lost": nothing_lost(ctx), "equivalence": equivalence(ctx), "no_hang": no_hang(ctx),
            "explained": explained(ctx), "accounting": accounting(ctx), "in_place": in_place(ctx)}


class Context:
    """What every invariant reads about one trial's result."""

    def __init__(self, trial: dict, res: dict, ref: dict | None):
        self.trial, self.res, self.ref = trial, res, ref
        self.cfg, self.fault = trial["config"], trial["fault"]
        self.spec, self.n = FAULTS[self.fault], total_steps(self.cfg)
        # The explorer's spike guard is deliberately twitchy (a 3-step window, threshold 4): after a
        # fault that changes the losses (injected bad data, the rollback moment's spike, a skipped
        # NaN step), a loss that merely slows its fall can count as more spikes, and past
        # max_rollbacks=3 the guard stops the run with a FATAL that lists them. That is the guard
        # doing what it was configured to do (issue 33: seed 5000's trial 25), not a fault unsurvived.
        # So may a run whose losses differ from the reference's by design: one that changed its
        # world size (the same global batch summed in another order: seed 7000's trial 610 took
        # other rollbacks), or saved by the clock (a rollback then goes back to the
        # checkpoint just before the spike, one step, and the window scores the redone step against
        # the same trend again: z = 20-31 on ordinary losses in seed 8000's trial 1). A bit-exact
        # run sees the reference's losses, and so its spikes: a guard stop there is still a failure.
        # The uninterrupted run itself (fault none: the reference's own check) may end so too.
        # guard_on_other_losses: the rollback guard decides on losses or checkpoints other than the
        # uninterrupted run's, after a world-size change (seed 7000's trial 610) or with timed
        # checkpoints (trial 40): how many spikes it sees, and which samples each epoch excludes,
        # differ by design, so the weights and the epochs' samples are not compared either.
        # So do they when the rollback moment came at a natural spike before the injected one, and
        # the launch that would have injected it ended first (seed 9000's trial 240): the reference
        # keeps that spike, the trial never saw it.
        # And when a checkpoint the fault added (a survivor checkpoint, a preemption's) became a rollback's
        # target: the guard goes back to the newest checkpoint before the spike (seed 9000's trial
        # 751 rolled back to its survivor checkpoint of step 4, the reference to step 3).
        mine, theirs = res.get("rollback_targets"), (ref or {}).get("rollback_targets")
        self.guard_on_other_losses = self.cfg["spike_guard"] == "rollback" and (
            bool(self.cfg.get("save_every_minutes")) or bool(res.get("world_changes"))
            or (trial["moment"] == "rollback" and not res.get("injected_spike", True))
            or (mine is not None and theirs is not None and mine != theirs))
        self.guard_stop = (self.cfg["spike_guard"] == "rollback"
                           and (self.fault in ("bad_data", "nan", "none") or trial["moment"] == "rollback"
                                or self.guard_on_other_losses)
                           and "max_rollbacks" in (res.get("fatal") or "")) or self.as_uninterrupted(res, ref)
        self.transient = self.spec.transient and not res.get("unreadable_only") and not self.guard_stop
        self.summary = res.get("summary")
        self.finished = is_finished(self.cfg, self.summary)
        self.last = res["launches"][-1] if res.get("launches") else {"codes": [], "stderr": ""}


    @staticmethod
    def as_uninterrupted(res: dict, ref: dict | None) -> bool:
        """The run stopped with the FATAL its uninterrupted reference stopped with: the guard's
        max_rollbacks, the same spikes and samples (seed 7000's trial 15: a node stopped and
        rejoined, and the run replayed the reference's rollbacks exactly)."""
        def why(fatal: str | None) -> str:
            return (fatal or "").split("FatalError: ", 1)[-1]

        mine, theirs = why(res.get("fatal")), why((ref or {}).get("fatal"))
        return "max_rollbacks" in mine and mine == theirs


def joined(problems: list[str]) -> str | None:
    return "; ".join(dict.fromkeys(problems)) or None


def nothing_lost(c: Context) -> str | None:
    res = c.res
    problems = list(res.get("changed", []))
    if res.get("manifest_missing"):
        problems.append(f"manifest lists missing files {res['manifest_missing']}")
    if c.finished or (exit_ok(c.fault, res) and c.fault != "user_error"):
        missing_logs = [k for k, v in res.get("logs_present", {}).items() if not v]
        if missing_logs:
            problems.append(f"log_dir lacks {missing_logs} after the run finished")
        if not res.get("manifest_present"):
            problems.append("checkpoint_dir has no manifest.json after the run finished")
        if not res.get("export_present"):  # an HF trial's: its script's trainer.save_model
            problems.append("no exported model.safetensors after the run finished")
        if c.fault == "none":
            due = set(periodic_saves(c.cfg))
            if (c.summary or {}).get("rollbacks"):  # samples excluded: the epochs end before their nominal step
                due = {s for s in due if c.cfg["save_every_steps"] and s % c.cfg["save_every_steps"] == 0}
            skipped = sorted(s for s in due - set(res.get("written_steps", [])) if s > start_step(c.cfg))
            if skipped:
                problems.append(f"due checkpoints never written: steps {skipped}")
    if res.get("froze_survivor") and not res.get("saved_alone"):
        problems.append("the survivor held checkpoint_dir's lock for its survivor checkpoint, was slowed, and never "
                        "wrote its checkpoint")
    return joined(problems)


def equivalence(c: Context) -> str | None:
    if not c.spec.exact:
        return "n/a"
    if c.ref is None or not c.ref.get("finished"):
        stopped = (c.ref or {}).get("fatal") or ""
        if c.finished and "max_rollbacks" in stopped and not c.guard_on_other_losses:
            # a run on the reference's losses (bit-exact) makes the guard's decisions again
            return f"finished, where the uninterrupted run stopped with the guard's FATAL: {stopped[:200]}"
        return "n/a" if not c.finished or c.guard_on_other_losses else None
    if c.res.get("resumed_foreign") and c.cfg["resume"] != "auto":
        return "n/a"  # the relaunch's resume=auto picked the other run's newer checkpoint, as documented
    if not c.finished:
        return "n/a"  # judged by 'explained'
    if c.guard_on_other_losses:  # the rollbacks land elsewhere (see the Context): not comparable
        return "n/a"
    changes = c.res.get("world_changes")
    if changes:  # the same global batch, the gradients summed in another order: within a tolerance
        if c.cfg["comm_hook"] != "none":
            return "n/a"  # a lossy hook (fp16/bf16, PowerSGD) rounds otherwise at another world size
        mine, theirs = c.res.get("final_weights"), c.ref.get("weights")
        if mine is None or theirs is None:
            return f"world size changed ({', '.join(changes)}): no final_model.pt to compare"
        diff = max_weight_diff(mine, theirs)
        if diff > WORLD_CHANGE_TOLERANCE:
            return (f"world size changed ({', '.join(changes)}): final weights {diff:.2e} from the reference's "
                    f"(> {WORLD_CHANGE_TOLERANCE:g})")
        return None
    if c.summary["model_sha256"] != c.ref["model_sha256"]:
        return f"model_sha256 {c.summary['model_sha256'][:12]} != reference {c.ref['model_sha256'][:12]}"
    return None


def no_hang(c: Context) -> str | None:
    launches = c.res.get("launches", [])
    hung = [i for i, launch in enumerate(launches) if launch["timed_out"]]
    left = sum(launch.get("left_behind", 0) for launch in launches)
    second = c.res.get("second")
    if second and None in second["codes"]:
        return "the second launch did not end"
    return (f"launch {hung} ran past its bound of {bound_s(c.trial):.0f} s" if hung else
            f"{left} process(es) left behind" if left else None)


def explained(c: Context) -> str | None:
    res, stderr, codes = c.res, c.last.get("stderr", ""), c.last["codes"]
    problems = []
    if c.fault == "user_error":
        if 2 not in codes:
            problems.append(f"a user's mistake (dataset_size=2, batch_size={BATCH}) passed --check-config "
                            f"(exit {codes})")
        if "Traceback" in stderr:
            problems.append("a user's mistake printed a traceback: " + tail_error(stderr))
    elif exit_ok(c.fault, res):
        if c.summary is not None and not c.finished:
            problems.append(f"exit 0, but the run ended at step {c.summary.get('steps')} of {c.n}"
                            + (" (preempted, after the relaunch too)" if c.summary.get("preempted") else ""))
    else:
        why = res.get("fatal") or next((ln for ln in stderr.splitlines() if ln.startswith(("fatal:", "error:"))),
                                       None)
        if not why and not res.get("timed_out"):
            problems.append(f"stopped (exit {codes}) without a FATAL or one-line reason: {tail_error(stderr)}")
        if c.transient and not res.get("timed_out"):
            problems.append(f"a transient fault ({c.fault}) was not survived: {(why or '')[:300]}")
        if (res.get("unreadable_only") and res["unreadable_only"] not in (res.get("fatal") or "")
                and not c.guard_stop):  # a relaunch afresh that the guard stopped (seed 9000's trial 792)
            problems.append(f"the run's only checkpoint {res['unreadable_only']} was made unreadable, and the run "
                            f"stopped without a FATAL naming it (exit {codes})")
    if c.transient and res.get("fatal"):
        problems.append(f"FATAL after a transient fault: {res['fatal'][:300]}")
    if c.fault == "crash_one_rank" and not res.get("timed_out"):
        # The same error after every restart: the restart-loop guard stops it (FATAL, exit 1), not a
        # lost node (NODE_LOST, exit 75) and not a restart budget burnt to the end.
        if codes != [1]:
            problems.append(f"a deterministic error on one rank: launch_training.sh exited {codes}, not 1")
        if not res.get("fatal"):
            problems.append("a deterministic error on one rank ended without a FATAL")
        elif "max_no_progress_restarts" not in res["fatal"]:
            problems.append(f"a deterministic error on one rank: the FATAL is not the restart-loop guard's: "
                            f"{res['fatal'][:200]}")
        if res.get("node_lost_marker"):
            problems.append("a deterministic error on one rank left NODE_LOST (a relaunch would be asked for)")
    second = res.get("second")
    if second and ((0 in second["codes"] and second["ended_while_first_ran"]) or "Traceback" in second["stderr_tail"]):
        problems.append(f"the second launch exited {second['codes']}: {tail_error(second['stderr_tail'])}")
    return joined(problems)


def accounting(c: Context) -> str | None:
    res, problems = c.res, []
    rows = res.get("metrics")
    if rows:
        steps = [r["step"] for r in rows]
        repeats = [b for a, b in zip(steps, steps[1:], strict=False) if b <= a]
        if repeats:
            problems.append(f"read_metrics steps not increasing (again at {repeats[:5]})")
        losses = [r for r in rows if "train/loss" in r]
        if c.finished and losses and losses[-1]["train/loss"] != c.summary.get("final_train_loss"):
            problems.append(f"last metrics loss {losses[-1]['train/loss']} != summary's "
                            f"{c.summary.get('final_train_loss')}")
    elif c.finished:
        problems.append("no metrics.jsonl")
    if c.cfg["data"] == "stream":
        return joined(problems)  # a stream's samples have no indices to account for
    for epoch, counts in res.get("samples", {}).items():
        twice = sorted(int(i) for i, n in counts.items() if n > 1)
        if twice:
            problems.append(f"epoch {epoch}: samples seen twice {twice[:8]}")
    if c.spec.exact and c.finished and c.ref and c.ref.get("finished") and not c.guard_on_other_losses:
        done_epochs = c.n // STEPS_PER_EPOCH if c.cfg["stop"] == "num_epochs" else MAX_STEPS // STEPS_PER_EPOCH
        for epoch in map(str, range(done_epochs)):
            got, want = set(res["samples"].get(epoch, {})), set(c.ref["samples"].get(epoch, {}))
            if got != want:
                problems.append(f"epoch {epoch}: {len(want - got)} samples missing, {len(got - want)} extra")
    return joined(problems)


def in_place(c: Context) -> str | None:
    """Healing in place, a rank lost inside a step (HEALS_IN_PLACE) heals: the survivors go on in
    their processes, and no rank restarts from the checkpoint."""
    if not heals(c.cfg):
        return "n/a"
    if c.trial["moment"] not in HEALS_IN_PLACE.get(c.fault, ()) or (
            c.fault == "sigstop_worker" and not c.cfg.get("peer_timeout")) or c.res.get("hit") is False:
        return None if c.res.get("healed") is not None else "n/a"
    problems = []
    if not c.res.get("healed"):
        problems.append(f"{c.fault} at {c.trial['moment']} did not heal in place")
    if c.res.get("restarted_in_store"):
        problems.append(f"{c.fault} at {c.trial['moment']} restarted from the checkpoint")
    return joined(problems)


def exit_ok(fault: str, res: dict) -> bool:
    """The last launch exited 0 (an agent's own exit by the kill we sent it excepted)."""
    launches = res.get("launches") or [{"codes": [None]}]
    if launches[-1].get("timed_out"):
        return False  # its codes are those of the explorer's own kill
    return all(c == 0 or (fault in ("kill9_agent", "kill9_node") and c == -9 and len(launches) == 1)
               for c in launches[-1]["codes"])


def tail_error(stderr: str) -> str:
    errors = [m.group(1).strip() for m in EXCEPTION_LINE.finditer(stderr)
              if "ChildFailedError" not in m.group(1) and not m.group(1).strip().startswith("raise ")]
    return (errors[-1] if errors else (stderr.strip().splitlines() or [""])[-1])[:300]


# --- references (cached by the configuration's key) ---------------------------------------------
def ref_key(trial: dict) -> str:
    """The choices that can change the final model (a save schedule only through a rollback)."""
    cfg, keys = trial["config"], list(MODEL_DIMS)
    if cfg["spike_guard"] == "rollback":
        keys += ["save_every_steps", "save_interval", "save_every_minutes"]
    if hf(cfg):
        keys += ["save_every_steps", "keep_last"]  # the script's command line (not its model)
    return json.dumps({"world": world(cfg), "start": start_step(cfg), "spike": trial["moment"] == "rollback",
                       "elastic": elastic(cfg), "trainer": cfg.get("trainer", "builtin"),
                       "split": cfg.get("split", "even"),
                       **{k: cfg.get(k, DIMS[k][0]) for k in keys}}, sort_keys=True)


class References:
    def __init__(self, workdir: Path):
        self.workdir, self.cache, self.locks = workdir, {}, collections.defaultdict(threading.Lock)
        self.guard = threading.Lock()

    def get(self, trial: dict) -> dict:
        key = ref_key(trial)
        with self.guard:
            lock = self.locks[key]
        with lock:
            if key not in self.cache:
                res = run_trial(trial, self.workdir, reference=True)
                summary = res["summary"]
                finished = is_finished(trial["config"], summary)
                self.cache[key] = {"finished": finished, "model_sha256": (summary or {}).get("model_sha256"),
                                   "fatal": res.get("fatal"), "rollback_targets": res.get("rollback_targets"),
                                   "samples": res["samples"], "dir": res["dir"], "weights": res["final_weights"],
                                   "checks": check({**trial, "fault": "none", "moment": "rollback" if
                                                    trial["moment"] == "rollback" else "startup"}, res, None)}
                if finished:
                    shutil.rmtree(res["dir"], ignore_errors=True)
            return self.cache[key]


def evaluate(trial: dict, refs: References, workdir: Path) -> dict:
    """Run a trial and its reference; the verdict (invariant -> None | 'n/a' | problem)."""
    # A fault that changes the result by design is compared with no reference.
    ref = refs.get(trial) if FAULTS[trial["fault"]].exact else None
    res = run_trial(trial, workdir)
    verdict = check(trial, res, ref)
    if ref is not None:  # a reference that itself breaks an invariant is this configuration's failure
        for name, problem in ref["checks"].items():
            if problem and problem != "n/a" and not verdict.get(name):
                verdict[name] = f"(uninterrupted run) {problem}"
    failed = [k for k, v in verdict.items() if v and v != "n/a"]
    if res.get("world_changes") and ref is not None and res.get("final_weights") and ref.get("weights"):
        res["weight_diff"] = max_weight_diff(res["final_weights"], ref["weights"])
    if not failed:
        shutil.rmtree(res["dir"], ignore_errors=True)
    return {"trial": trial, "verdict": verdict, "failed": failed, "hit": res.get("hit"), "notes": res["notes"],
            "codes": [launch["codes"] for launch in res["launches"]], "dir": res["dir"],
            "wall_s": sum(launch["wall_s"] for launch in res["launches"]), "second": res.get("second"),
            "saved_alone": res.get("saved_alone"), "world_changes": res.get("world_changes"),
            "rejoined": "rejoined_at_s" in res, "froze_survivor": res.get("froze_survivor", False),
            "weight_diff": res.get("weight_diff"), "waited_for_lock": res.get("waited_for_lock")}


# --- shrinking ---------------------------------------------------------------------------------
def simpler(trial: dict):
    """Trials one choice simpler than ``trial``: each dimension at its simplest value, then no
    fault, then the simplest moment of the fault."""
    for dim, values in DIMS.items():
        if trial["config"].get(dim, values[0]) != values[0]:
            yield {**trial, "config": {**trial["config"], dim: values[0]}}
    if trial["fault"] != "none":
        yield {**trial, "fault": "none", "moment": "startup"}
    moments = FAULTS[trial["fault"]].moments
    if trial["moment"] != moments[0]:
        for m in moments[:moments.index(trial["moment"])]:
            yield {**trial, "moment": m}


def shrink(result: dict, run, budget: int = 8, log=print) -> dict:
    """The smallest trial found that still fails one of ``result``'s invariants; ``run(trial)``
    evaluates a candidate (``evaluate`` bound to the references and the work directory). A choice
    whose simplification made the trial pass is not tried again."""
    current, failed, runs, needed = result, set(result["failed"]), 0, set()
    progress = True
    while progress and runs < budget:
        progress = False
        for cand in simpler(current["trial"]):
            change = changed_choice(current["trial"], cand)
            if applicable(cand) is not None or change in needed:
                continue
            if runs >= budget:
                break
            runs += 1
            attempt = run(cand)
            if failed & set(attempt["failed"]):
                log(f"    shrunk: {describe(cand)} still fails {sorted(failed & set(attempt['failed']))}")
                if current is not result and current.get("dir"):
                    shutil.rmtree(current["dir"], ignore_errors=True)
                current, failed, progress = attempt, failed & set(attempt["failed"]), True
                break
            needed.add(change)
            if attempt.get("dir"):
                shutil.rmtree(attempt["dir"], ignore_errors=True)
    return current


def changed_choice(a: dict, b: dict) -> str:
    diff = [k for k in a["config"] if a["config"][k] != b["config"].get(k)]
    return diff[0] if diff else ("fault" if a["fault"] != b["fault"] else "moment")


def signature(result: dict) -> tuple:
    """What a failure looks like with paths, numbers and hashes left out: one shrink per kind."""
    return tuple(sorted((k, re.sub(r"/\S+|[0-9a-f]{12,}|\d+", "#", result["verdict"][k])[:80])
                        for k in result["failed"]))


def repro(trial: dict) -> str:
    return f"python bench/explore.py --replay '{json.dumps(trial, separators=(',', ':'))}'"


def describe(trial: dict) -> str:
    cfg = trial["config"]
    return (f"{trial['fault']}@{trial['moment']} " + " ".join(f"{k}={v}" for k, v in cfg.items()
                                                             if v != DIMS[k][0]))


# --- the table -----------------------------------------------------------------------------------
def results_from_log(text: str, seed: int, fixed: dict | None = None) -> list[dict]:
    """The results a run printed, one line per trial, rebuilt with the trials drawn from ``seed``
    (and ``fixed``, as that run drew them)."""
    results = []
    for m in re.finditer(r"^\[(\d+)/\d+\] \S+ .*?: (ok|FAIL (.*)) \(\d+ s\)$", text, re.M):
        index = int(m.group(1)) - 1
        verdict = {} if m.group(2) == "ok" else dict(
            part.split(": ", 1) for part in re.split(r"; (?=[a-z_]+: )", m.group(3)))
        results.append({"index": index, "trial": draw(random.Random(seed + index), fixed), "failed": list(verdict),
                        "verdict": verdict, "hit": None})
    return sorted(results, key=lambda r: r["index"])


def table(results: list[dict]) -> str:
    lines = ["dimension         value            trials  failing", "-" * 52]
    dims = {**{k: [r["trial"]["config"].get(k, DIMS[k][0]) for r in results] for k in DIMS},
            "fault": [r["trial"]["fault"] for r in results], "moment": [r["trial"]["moment"] for r in results]}
    for dim, values in dims.items():
        counts = collections.Counter(map(str, values))
        fails = collections.Counter(str(v) for v, r in zip(values, results, strict=True) if r["failed"])
        for value in sorted(counts):
            lines.append(f"{dim:17s} {value:16s} {counts[value]:6d}  {fails[value]:7d}")
    lines += ["", "invariant       pass   n/a  fail", "-" * 34]
    for inv in INVARIANTS:
        v = [r["verdict"].get(inv) for r in results]
        lines.append(f"{inv:14s} {sum(x is None for x in v):5d} {sum(x == 'n/a' for x in v):5d} "
                     f"{sum(bool(x) and x != 'n/a' for x in v):5d}")
    missed = sum(r["hit"] is False for r in results)
    lines.append(f"\n{len(results)} trials, {sum(bool(r['failed']) for r in results)} failing; "
                 f"{missed} whose moment never came (run as drawn, the fault undelivered)")
    return "\n".join(lines)


def explore(n: int, seed: int, jobs: int, workdir: Path, *, do_shrink: bool = True, max_shrinks: int = 1000,
            shrink_budget: int = 8, log=print, minutes: float = 0.0, trials: list[dict] | None = None,
            fixed: dict | None = None) -> list[dict]:
    """``n`` trials drawn from ``seed`` (their configurations holding the ``fixed`` choices), or
    the given ``trials`` (a rerun of an earlier run's)."""
    refs = References(workdir)
    trials = [draw(random.Random(seed + i), fixed) for i in range(n)] if trials is None else trials
    n = len(trials)
    deadline = time.monotonic() + minutes * 60 if minutes else None

    def one(i: int) -> dict | None:
        if deadline is not None and time.monotonic() > deadline:
            return None  # past the time budget: the trial is not started
        result = evaluate(trials[i], refs, workdir)
        result["index"] = i
        status = "ok" if not result["failed"] else "FAIL " + "; ".join(
            f"{k}: {result['verdict'][k][:160]}" for k in result["failed"])
        log(f"[{i + 1}/{n}] {describe(trials[i])}: {status} ({result['wall_s']:.0f} s)")
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = [r for r in pool.map(one, range(n)) if r is not None]
    if do_shrink:
        shrunk: dict[tuple, dict] = {}
        for result in results:
            if result["failed"] and signature(result) in shrunk:
                result.update(same_as=shrunk[signature(result)]["index"], repro=shrunk[signature(result)]["repro"])
            elif result["failed"] and len(shrunk) < max_shrinks:
                shrunk[signature(result)] = result
                log(f"shrinking trial {result['index']}: {describe(result['trial'])} fails {result['failed']}")
                small = shrink(result, lambda t: evaluate(t, refs, workdir), budget=shrink_budget, log=log)
                result["shrunk"] = {"trial": small["trial"], "failed": small["failed"], "verdict": small["verdict"]}
                result["repro"] = repro(small["trial"])
                log(f"    repro: {result['repro']}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--fix", action="append", default=[], metavar="DIM=VALUE",
                        help="draw only trials with this choice (e.g. heal=in_place); repeatable")
    parser.add_argument("--out", default="explore.json", help="a file name under bench/results/, or a path")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--max-shrinks", type=int, default=1000, help="shrink at most this many kinds of failure")
    parser.add_argument("--shrink-budget", type=int, default=8, help="trial runs allowed to shrink one failure")
    parser.add_argument("--replay", help="one trial's JSON, as a failing trial's repro line prints it")
    parser.add_argument("--rerun", help="an earlier run's results file: run its trials again, on this code")
    parser.add_argument("--rerun-faults", default="", help="with --rerun: only the trials of these faults (a,b)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--minutes", type=float, default=0.0, help="start no trial after this many minutes (0: all)")
    parser.add_argument("--from-log", help="the table of a run stopped early, from its console log (with its --seed)")
    args = parser.parse_args()
    fixed = {}
    for item in args.fix:
        dim, _, text = item.partition("=")
        value = next((v for v in DIMS.get(dim, []) if str(v).lower() == text.lower()), None)
        if value is None:
            parser.error(f"--fix {item}: allowed dimensions and values: "
                         + "; ".join(f"{k}={'|'.join(map(str, v))}" for k, v in DIMS.items()))
        fixed[dim] = value
    if args.from_log:
        results = results_from_log(Path(args.from_log).read_text(), args.seed, fixed or None)
        print(table(results))
        print("(from the log: a trial whose invariant was n/a counts as passing it)")
        return
    workdir = Path(tempfile.mkdtemp(prefix="explore-"))
    start = time.monotonic()
    try:
        if args.replay:
            trial = json.loads(args.replay)
            why = applicable(trial)
            if why:
                parser.error(f"--replay: {why}")
            result = evaluate(trial, References(workdir), workdir)
            print(json.dumps({k: result[k] for k in ("trial", "verdict", "failed", "codes", "notes", "dir", "wall_s",
                                                     "saved_alone", "world_changes", "rejoined", "froze_survivor",
                                                     "weight_diff", "waited_for_lock")},
                             indent=2))
            raise SystemExit(1 if result["failed"] else 0)
        rerun = None
        if args.rerun:
            faults = set(filter(None, args.rerun_faults.split(",")))
            # A dimension added since that run takes its first value (what those trials ran with).
            rerun = [{**r["trial"], "config": {**{k: v[0] for k, v in DIMS.items()}, **r["trial"]["config"]}}
                     for r in json.loads(Path(args.rerun).read_text())["results"]
                     if not faults or r["trial"]["fault"] in faults]
        results = explore(args.trials, args.seed, args.jobs, workdir, do_shrink=not args.no_shrink,
                          max_shrinks=args.max_shrinks, shrink_budget=args.shrink_budget, minutes=args.minutes,
                          trials=rerun, fixed=fixed or None)
        print()
        print(table(results))
        for r in results:
            if r["failed"]:
                print(f"\ntrial {r['index']} ({describe(r['trial'])}):")
                for inv in r["failed"]:
                    print(f"  {inv}: {r['verdict'][inv]}")
                if "shrunk" in r:
                    print(f"  shrunk to {describe(r['shrunk']['trial'])}: {r['repro']}")
                elif "same_as" in r:
                    print(f"  the same failure as trial {r['same_as']}: {r['repro']}")
        out = Path(args.out) if os.sep in args.out else ROOT / "bench" / "results" / args.out
        out.write_text(json.dumps({"seed": args.seed, "fixed": fixed, "trials": len(results), "jobs": args.jobs,
                                   "wall_s": round(time.monotonic() - start), "dimensions": DIMS,
                                   "faults": {k: v.what for k, v in FAULTS.items()}, "not_covered": NOT_COVERED,
                                   "results": results}, indent=1, default=str))
        print(f"\nwrote {out} ({time.monotonic() - start:.0f} s)")
    finally:
        if not args.keep and not any(p.name.startswith("trial-") for p in workdir.iterdir()):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work directory (failing trials) kept: {workdir}", file=sys.stderr)


if __name__ == "__main__":
    main()
