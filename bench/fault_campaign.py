#!/usr/bin/env python3
"""Fault campaign: real faults, delivered at moments nobody chose, to real 2-rank DDP runs.

Every cell is one fault at one moment on one topology. It trains the tiny model below to step 48
under torchrun with ``--max-restarts 2`` (plus, for some faults, one relaunch of the same command,
as a scheduler would do) and compares the result with an uninterrupted reference run of the same
topology. Every cell reports:

- outcome: ``survived`` (the run finished, by itself, through torchrun's restarts, or through the
  one relaunch the fault calls for), ``clean stop`` (non-zero exit with a one-line reason: a FATAL
  marker or a ``fatal:`` line on stderr), ``HANG`` (still running after --cell-timeout seconds;
  every process is then killed) or ``FAILED`` (anything else, e.g. a traceback and no explanation);
- the exit codes of every launch, in order (torchrun's, or launch_training.sh's);
- bit-exact: the final model_sha256 equals the reference's (promised after kill -9, SIGTERM, a
  hang and a corrupted checkpoint; not after a NaN, whose skipped step changes the result);
- samples lost / repeated: from log_dir/samples_rank_N.jsonl, the last record of each (epoch,
  step) winning, each epoch's committed indices against the reference's;
- recovery: seconds from the fault to the first "resumed from step" line, or to the end of the run;
- left behind: processes whose command line mentions the cell's directory after the cell ended
  (must be 0); they are killed afterwards;
- hit: whether the fault landed in the moment it was aimed at (a temp file can be gone before the
  kill arrives; such a cell is run once more).

usage: python bench/fault_campaign.py [--topology 1x2|2x1|all] [--faults a,b] [--moments x,y] [--quick]
                                      [--cell-timeout 180] [--keep] [--list]

Writes bench/results/fault_campaign.json and bench/results/fault_campaign.md (a table for the README).
Run it alone: the cells are timed, and two cores are shared by two ranks and this script.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from framework.observability.metrics import read_samples  # noqa: E402
from harness.launch import free_port, kill_matching, processes_matching, torchrun_cmd, worker_env  # noqa: E402

# --- the run every cell trains ----------------------------------------------------------------
# 2 ranks x batch 40 = 80 samples per step over 2,560 sequences: 32 steps per epoch, so 48 steps cross
# an epoch boundary. The validation set is 256 sequences (a tenth of the data), all evaluated: an
# evaluation costs about one training step, long enough to land a fault in.
STEPS, SAVE_EVERY, EVAL_EVERY = 48, 8, 16
CONFIG = {"vocab_size": 64, "hidden_size": 96, "num_heads": 2, "num_layers": 2, "seq_len": 48, "dataset_size": 2560,
          "batch_size": 40, "dropout": 0.1, "train.max_steps": STEPS, "checkpoint.every_steps": SAVE_EVERY,
          "checkpoint.keep_last": 3, "log_interval": 1, "eval.interval": EVAL_EVERY, "eval.steps": 7, "num_workers": 0,
          "train.deterministic": True, "logging.record_samples": True, "logging.tensorboard": True, "target_loss": 0.0,
          "learning_rate": 2e-3, "optim.warmup_steps": 4, "train.seed": 5, "checkpoint.resume": "auto"}
MAX_RESTARTS = 2
HANG_TIMEOUTS = {"recovery.step_timeout_s": 3, "recovery.step_timeout_factor": 2}  # the hang cells' watchdog
SCHEDULER_DELAY_S = 2.0  # how long "the scheduler" takes to notice a dead agent and relaunch it

# --- the moments ------------------------------------------------------------------------------
MID_STEP = 21   # mid-epoch 0; the newest checkpoint is 16 (a resume from 32, the end of the epoch: eval)
EVAL_STEP = 32  # the evaluation after step 32 (end of epoch 0; its checkpoint is written meanwhile)
CKPT_STEPS = range(24, STEPS)  # the periodic saves of steps 24, 32 and 40
MOMENTS = {
    "startup": "before step 1: right after rank 0 logs 'process group up'",
    "mid_step": f"right after rank 0 logs 'step {MID_STEP}/{STEPS}'",
    "eval": f"rank 0 logged 'evaluating at step {EVAL_STEP}' and not yet its val_loss",
    "ckpt_write": "a periodic checkpoint's temp file .step_*.pt.tmp.* exists (step 24, 32 or 40)",
    "final_save": f"the final checkpoint's temp file exists, or rank 0 logged the final 'step {STEPS} | val_loss'",
}


# --- the faults -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    what: str
    bit_exact: bool        # is the final model promised to equal the reference?
    relaunch_if_preempted: bool = False  # a SIGTERM cell: after a clean PREEMPTED stop, relaunch once
    topologies: tuple = ("1x2", "2x1")


FAULTS = {
    "kill9_worker": Fault("kill -9 of worker rank 1", True),
    "kill9_agent": Fault("kill -9 of the torchrun agent of rank 1's node; once every process of the job has "
                         "ended, the scheduler relaunches the whole job (every node's command) once", True),
    "sigterm_worker": Fault("SIGTERM to worker rank 1; relaunch once after PREEMPTED", True, True),
    "sigterm_launcher": Fault("SIGTERM to ./launch_training.sh; relaunch once after PREEMPTED", True, True, ("1x2",)),
    "double_sigterm": Fault("two SIGTERMs 10 ms apart to worker rank 1; relaunch once after PREEMPTED", True, True),
    "hang": Fault("recovery.fault_inject hang (holds the GIL) with recovery.step_timeout_s=3, "
                  "recovery.step_timeout_factor=2", True),
    "nan": Fault("recovery.fault_inject nan: a NaN in rank 1's gradients (the step is skipped on all ranks)", False),
    "full_disk": Fault("checkpoint.dir on a small tmpfs that a later checkpoint cannot fit", False),
    "kill9_rank0_ckpt": Fault("kill -9 of rank 0 while a checkpoint temp file exists", True),
    "corrupt_newest": Fault("the newest step_*.pt truncated to half, then kill -9 of worker rank 1", True),
}

# The cells: which moments each fault is delivered at (every other combination is in SKIPPED).
ALL = tuple(MOMENTS)
APPLICABLE = {
    "kill9_worker": ALL,
    "kill9_agent": ALL,
    "sigterm_worker": ALL,
    "sigterm_launcher": ALL,
    "double_sigterm": ALL,
    "hang": ("startup", "mid_step", "ckpt_write"),
    "nan": ("startup", "mid_step"),
    "full_disk": ("ckpt_write", "final_save"),
    "kill9_rank0_ckpt": ("ckpt_write", "final_save"),
    "corrupt_newest": ("mid_step", "eval", "ckpt_write", "final_save"),
}
SKIPPED = {
    ("hang", "eval"): ("the campaign hangs a rank at the start of a step; a hang in the evaluation "
                       "(hang@step=K,at=eval) is tested in tests/integration/test_fault_tolerance.py"),
    ("hang", "final_save"): ("the campaign hangs a rank at the start of a step; a kill -9 at the final save "
                             "(sigkill@step=K,at=save) is tested in tests/integration/test_fault_tolerance.py"),
    ("nan", "eval"): "a NaN is injected into a step's gradients; an evaluation computes none",
    ("nan", "ckpt_write"): "a NaN is injected into a step's gradients; a checkpoint write computes none",
    ("nan", "final_save"): "a NaN is injected into a step's gradients; the final save computes none",
    ("full_disk", "startup"): "nothing is written to checkpoint_dir before the first save: that is the ckpt_write cell",
    ("full_disk", "mid_step"): "a full disk is met by the next save: that is the ckpt_write cell",
    ("full_disk", "eval"): "an evaluation writes nothing to checkpoint_dir",
    ("kill9_rank0_ckpt", "startup"): "defined by its moment (a checkpoint being written); see kill9_worker",
    ("kill9_rank0_ckpt", "mid_step"): "defined by its moment (a checkpoint being written); see kill9_worker",
    ("kill9_rank0_ckpt", "eval"): "defined by its moment (a checkpoint being written); see kill9_worker",
    ("corrupt_newest", "startup"): "no checkpoint exists before step 1",
}
# What the fault_inject cells put in the config (the framework fires them itself).
INJECTED = {
    ("hang", "startup"): "hang@step=0,rank=1",           # the first step, right after start-up
    ("hang", "mid_step"): f"hang@step={MID_STEP},rank=1",
    ("hang", "ckpt_write"): "hang@step=24,rank=0",       # the step after save 24, while it is written
    ("nan", "startup"): "nan@step=0,rank=1",
    ("nan", "mid_step"): f"nan@step={MID_STEP},rank=1",
}
QUICK = [("kill9_worker", "mid_step"), ("kill9_worker", "eval"), ("sigterm_worker", "eval"), ("hang", "mid_step"),
         ("kill9_rank0_ckpt", "ckpt_write"), ("corrupt_newest", "mid_step"), ("kill9_agent", "mid_step")]
TOPOLOGIES = {"1x2": "1 node x 2 processes", "2x1": "2 nodes x 1 process on loopback"}

for _fault in FAULTS:
    for _moment in MOMENTS:
        assert (_moment in APPLICABLE[_fault]) != ((_fault, _moment) in SKIPPED), (_fault, _moment)

# The trainer logs "evaluating at step N" when an evaluation starts (a recent addition). Without it,
# the eval moment falls back to the step line just before the evaluation, plus a short delay.
EVAL_LINE_LOGGED = any("evaluating at step" in p.read_text() for p in (ROOT / "framework").glob("*.py"))
TMP_FILE = re.compile(r"\.step_(\d{8})\.pt\.tmp\.\w+$")  # framework.state.atomic: a mkstemp suffix


# --- one run: its agents, their outputs, and the rank logs as they grow ------------------------
def train_args(run_dir: Path, extra: dict) -> list[str]:
    cfg = {**CONFIG, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck"), **extra}
    return [part for key, value in cfg.items()
            for part in (f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value))]


class Run:
    """The agents of one run (one torchrun per node, or launch_training.sh), each started in a
    session of its own with stdout/stderr in files; every launch and its exit code is kept."""

    def __init__(self, topology: str, run_dir: Path, extra: dict, *, launcher: bool = False):
        self.dir, self.topology = run_dir, topology
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "ck").mkdir(parents=True, exist_ok=True)
        args, port = train_args(run_dir, extra), free_port()
        script = ROOT / "ddp_training.py"
        self.env = worker_env()
        if launcher:
            self.cmds = [[str(ROOT / "launch_training.sh"), "--cpu", "--nproc", "2", "--max-restarts",
                          str(MAX_RESTARTS), "--", *args]]
            self.env = {k: v for k, v in self.env.items() if k != "PYTHONPATH"} | {"PYTHON": sys.executable}
        elif topology == "1x2":
            self.cmds = [torchrun_cmd(script, args, nproc=2, port=port, extra=["--max-restarts", str(MAX_RESTARTS)])]
        else:
            self.cmds = []
            for _node in range(2):
                cmd = torchrun_cmd(script, args, nproc=1, port=port,
                                   extra=["--max-restarts", str(MAX_RESTARTS), "--rdzv-id", f"fc-{port}"])
                cmd[cmd.index("--nnodes") + 1] = "2"
                self.cmds.append(cmd)
        self.procs: list[subprocess.Popen | None] = [None] * len(self.cmds)
        self.launches: list[dict] = []  # {node, proc, out, err}

    def start(self, node: int) -> None:
        n = sum(1 for launch in self.launches if launch["node"] == node)
        out, err = self.dir / f"agent{node}.{n}.out", self.dir / f"agent{node}.{n}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(self.cmds[node], cwd=ROOT, env=self.env, stdout=fo, stderr=fe,
                                    start_new_session=True)
        self.procs[node] = proc
        self.launches.append({"node": node, "proc": proc, "out": out, "err": err})

    def exit_labels(self) -> list[str]:
        """Each launch's exit code, in order, with its node on 2 nodes (n1:-9 = node 1's agent killed)."""
        return [(f"n{launch['node']}:" if len(self.cmds) > 1 else "") + str(launch["proc"].poll())
                for launch in self.launches]

    def start_all(self) -> None:
        for node in range(len(self.cmds)):
            self.start(node)

    def done(self) -> bool:
        return all(p is None or p.poll() is not None for p in self.procs)

    def exit_codes(self) -> list[int | None]:
        return [launch["proc"].poll() for launch in self.launches]

    def last_codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def stderr(self) -> str:
        return "".join(launch["err"].read_text(errors="replace") for launch in self.launches if launch["err"].exists())

    def workers(self) -> dict[int, tuple[psutil.Process, int]]:
        """rank -> (worker process, node of its agent), for the workers alive now."""
        found = {}
        for node, agent in enumerate(self.procs):
            try:
                children = psutil.Process(agent.pid).children(recursive=True)
            except (psutil.NoSuchProcess, AttributeError):
                continue
            for child in children:
                try:
                    env = child.environ()
                    if "TORCHELASTIC_RESTART_COUNT" in env and "RANK" in env:
                        found[int(env["RANK"])] = (child, node)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
        return found

    def kill_everything(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        kill_matching(f"{self.dir}/")
        for proc in self.procs:
            if proc is not None:
                proc.wait()


class LogWatch:
    """Tails every rank's log; remembers when (monotonic) each line was first seen."""

    def __init__(self, run_dir: Path):
        self.paths = {rank: run_dir / "logs" / f"rank_{rank}.log" for rank in (0, 1)}
        self.files: dict[int, object] = {}
        self.partial: dict[int, bytes] = {}
        self.lines: list[tuple[float, int, str]] = []
        self._found: dict[tuple[str, int], tuple[int, float | None]] = {}

    def poll(self) -> None:
        for rank, path in self.paths.items():
            if rank not in self.files:
                try:
                    self.files[rank] = open(path, "rb")
                except FileNotFoundError:
                    continue
            data = self.files[rank].read()
            if data:
                now = time.monotonic()
                *complete, self.partial[rank] = (self.partial.get(rank, b"") + data).split(b"\n")
                self.lines += [(now, rank, line.decode(errors="replace")) for line in complete]

    def first(self, needle: str, rank: int = 0, after: float = float("-inf")) -> float | None:
        """When the first line of ``rank`` containing ``needle`` (seen after ``after``) was seen."""
        if after != float("-inf"):
            return next((t for t, r, line in self.lines if t >= after and r == rank and needle in line), None)
        pos, found = self._found.get((needle, rank), (0, None))
        while found is None and pos < len(self.lines):
            t, r, line = self.lines[pos]
            pos += 1
            if r == rank and needle in line:
                found = t
        self._found[(needle, rank)] = (pos, found)
        return found

    def has(self, needle: str, rank: int = 0) -> bool:
        return self.first(needle, rank) is not None

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def checkpoint_temp(ck_dir: Path, steps) -> Path | None:
    """A checkpoint temp file (.step_N.pt.tmp.XXXXXXXX) for one of ``steps``, if one exists now."""
    try:
        names = os.listdir(ck_dir)
    except FileNotFoundError:
        return None
    for name in names:
        m = TMP_FILE.match(name)
        if m and int(m.group(1)) in steps:
            return ck_dir / name
    return None


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def newest_step_file(ck_dir: Path) -> Path | None:
    files = sorted(ck_dir.glob("step_*.pt"))
    return files[-1] if files else None


# --- what a finished run left -----------------------------------------------------------------
def committed_samples(run_dir: Path) -> tuple[dict[int, collections.Counter], int]:
    """epoch -> Counter of committed sample indices (both ranks), the log's purges applied (a restart
    or rollback writes ``purge_from`` before it repeats a step); and the number of torn lines (a
    process killed mid-write)."""
    by_epoch: dict[int, collections.Counter] = {}
    torn = 0
    for rank in (0, 1):
        path = run_dir / "logs" / f"samples_rank_{rank}.jsonl"
        if not path.exists():
            continue
        for rec in read_samples(path):
            by_epoch.setdefault(rec["epoch"], collections.Counter()).update(rec["indices"])
        for line in path.read_text().splitlines():
            try:
                json.loads(line)
            except ValueError:
                torn += 1
    return by_epoch, torn


def sample_diff(got: dict, ref: dict) -> tuple[int, int]:
    """(missing, repeated) over every epoch."""
    missing = repeated = 0
    for epoch in set(got) | set(ref):
        g, r = got.get(epoch, collections.Counter()), ref.get(epoch, collections.Counter())
        missing += sum((r - g).values())
        repeated += sum((g - r).values())
    return missing, repeated


def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "logs" / "summary.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def completed(summary: dict | None) -> bool:
    return bool(summary) and summary.get("steps") == STEPS and not summary.get("preempted")


EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:)?\s*((?:[\w.]+\.)?\w*(?:Error|Exception)\b:?.*)$", re.M)


def explain(run: Run) -> tuple[str | None, str]:
    """('fatal' | 'preempted' | None, a one-line reason) for a run that did not finish cleanly."""
    ck, stderr = run.dir / "ck", run.stderr()
    fatal_line = next((line for line in stderr.splitlines() if line.startswith("fatal:")), None)
    try:
        marker = (ck / "FATAL").read_text(errors="replace").strip()
    except (FileNotFoundError, OSError):
        marker = None
    if marker or fatal_line:
        return "fatal", (f"FATAL: {marker}" if marker else fatal_line)[:300]
    if (ck / "PREEMPTED").exists() and (read_summary(run.dir) or {}).get("preempted"):
        return "preempted", f"PREEMPTED: {(ck / 'PREEMPTED').read_text().strip()}"
    errors = [m.group(1).strip() for m in EXCEPTION_LINE.finditer(stderr)
              if "ChildFailedError" not in m.group(1) and not m.group(1).strip().startswith("raise ")]
    summary = read_summary(run.dir)
    if completed(summary):
        return None, f"the run completed ({STEPS} steps) but exited {run.last_codes()}"
    if errors:
        return None, errors[-1][:300]
    return None, f"exit codes {run.exit_codes()}, no explanation on stderr"


# --- one cell ---------------------------------------------------------------------------------
@dataclass
class Cell:
    topology: str
    fault: str
    moment: str
    index: int = 0
    result: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.topology} {self.fault} @ {self.moment}"


class CellTimeout(Exception):
    pass


def wait_until(run: Run, watch: LogWatch, condition, deadline: float, interval: float = 0.002):
    """Poll until ``condition()`` is truthy (returns it), the run ends (returns None), or the deadline."""
    while True:
        watch.poll()
        value = condition()
        if value:
            return value
        if run.done():
            watch.poll()
            return condition() or None
        if time.monotonic() > deadline:
            raise CellTimeout
        time.sleep(interval)


def moment_reached(moment: str, run: Run, watch: LogWatch):
    """A condition for ``wait_until``: truthy once ``moment`` has come."""
    ck = run.dir / "ck"
    if moment == "startup":
        return lambda: watch.has("process group up")
    if moment == "mid_step":
        return lambda: watch.has(f"step {MID_STEP}/{STEPS} ")
    if moment == "eval":
        needle = f"evaluating at step {EVAL_STEP}" if EVAL_LINE_LOGGED else f"step {EVAL_STEP}/{STEPS} "
        return lambda: watch.has(needle)
    if moment == "ckpt_write":
        return lambda: checkpoint_temp(ck, CKPT_STEPS)
    if moment == "final_save":
        return lambda: checkpoint_temp(ck, [STEPS]) or watch.has(f"step {STEPS} | val_loss")
    raise ValueError(moment)


def moment_still_on(moment: str, run: Run, watch: LogWatch, trigger) -> tuple[bool, str]:
    """Right after the fault: was it inside the moment? (hit, how we know)."""
    watch.poll()
    if moment == "startup":
        return not watch.has(f"step 1/{STEPS} "), "before rank 0 logged step 1"
    if moment == "mid_step":
        return not watch.has(f"step {MID_STEP + 1}/{STEPS} "), f"before rank 0 logged step {MID_STEP + 1}"
    if moment == "eval":
        how = f"before rank 0 logged step {EVAL_STEP}'s val_loss"
        if not EVAL_LINE_LOGGED:
            how += f" (no 'evaluating at step' line: 20 ms after 'step {EVAL_STEP}/{STEPS}')"
        return not watch.has(f"step {EVAL_STEP} | val_loss"), how
    if isinstance(trigger, Path):
        return trigger.exists(), f"{trigger.name} still there"
    return not (run.dir / "ck" / "final_model.pt").exists(), "before final_model.pt was written"


def fill_disk(directory: Path) -> int:
    """Fill the file system of ``directory``; returns the bytes written."""
    written = 0
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
                written += 65536
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    return written


def deliver(fault: str, run: Run, target: dict[int, tuple[psutil.Process, int]], notes: list[str]) -> bool:
    """Deliver an external fault now; False when its target was already gone."""
    def pid(rank: int) -> int:
        return target[rank][0].pid
    try:
        if fault in ("kill9_worker", "corrupt_newest", "kill9_rank0_ckpt"):
            if fault == "corrupt_newest":
                newest = newest_step_file(run.dir / "ck")
                if newest is None:
                    notes.append("no step file to truncate")
                    return False
                os.truncate(newest, newest.stat().st_size // 2)
                notes.append(f"truncated {newest.name}")
            os.kill(pid(0 if fault == "kill9_rank0_ckpt" else 1), signal.SIGKILL)
        elif fault == "kill9_agent":
            os.kill(run.procs[target[1][1]].pid, signal.SIGKILL)
        elif fault == "sigterm_worker":
            os.kill(pid(1), signal.SIGTERM)
        elif fault == "double_sigterm":
            os.kill(pid(1), signal.SIGTERM)
            time.sleep(0.010)
            os.kill(pid(1), signal.SIGTERM)
        elif fault == "sigterm_launcher":
            os.kill(run.procs[0].pid, signal.SIGTERM)
        elif fault == "full_disk":
            notes.append(f"filled the tmpfs with {fill_disk(run.dir / 'ck') // 1024} KiB")
        else:
            raise ValueError(fault)
    except ProcessLookupError:
        return False
    return True


def mount_tmpfs(directory: Path, size_kib: int) -> str | None:
    """Mount a tmpfs of ``size_kib`` on ``directory``; None, or why it could not."""
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(directory)],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"mount exited {proc.returncode}")


def unmount(directory: Path) -> None:
    if subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def run_cell(cell: Cell, ref: dict, workdir: Path, timeout: float) -> dict:
    fault, moment, spec = cell.fault, cell.moment, FAULTS[cell.fault]
    run_dir = workdir / f"{cell.index:02d}-{cell.topology}-{fault}-{moment}"
    if run_dir.exists():
        run_dir = workdir / f"{run_dir.name}-again"
    run_dir.mkdir(parents=True)
    extra = {}
    if (fault, moment) in INJECTED:
        extra["fault_inject"] = INJECTED[(fault, moment)]
    if fault == "hang":
        extra.update(HANG_TIMEOUTS)
    notes: list[str] = []
    mounted = False
    if fault == "full_disk":
        (run_dir / "ck").mkdir()
        s, m = ref["checkpoint_bytes"], ref["final_model_bytes"]
        # ckpt_write: room for two checkpoints: the third (step 24) cannot fit. final_save: room for
        # everything, then the disk is filled up when the last step is logged.
        size_kib = (2 * s + 64 * 1024) // 1024 if moment == "ckpt_write" else (5 * s + 2 * m + 512 * 1024) // 1024
        why = mount_tmpfs(run_dir / "ck", size_kib)
        if why:
            return {"outcome": "skipped", "reason": f"could not mount a tmpfs: {why}", "dir": str(run_dir)}
        mounted = True
        notes.append(f"tmpfs {size_kib} KiB")

    run = Run(cell.topology, run_dir, extra, launcher=fault == "sigterm_launcher")
    watch = LogWatch(run_dir)
    marker = f"{run_dir}/"
    start = time.monotonic()
    deadline = start + timeout
    res: dict = {"dir": str(run_dir), "config_extra": extra}
    t_fault = None
    hit, hit_how = False, ""
    orphans: list[psutil.Process] = []
    timed_out = False
    try:
        run.start_all()
        # 1. the fault
        if fault in ("hang", "nan"):
            line = f"fault injection: {fault} at step"
            rank = 0 if "rank=0" in extra["fault_inject"] else 1
            t_fault = wait_until(run, watch, lambda: watch.first(line, rank), deadline, 0.02)
            hit, hit_how = t_fault is not None, "the fault injection line was logged"
            if hit and moment == "ckpt_write":
                order = [line for _, r, line in watch.lines if r == 0 and ("checkpoint step 24 written" in line
                                                                           or "fault injection: hang" in line)]
                hit = "fault injection" in order[0]
                hit_how = "the hang began before rank 0 logged 'checkpoint step 24 written'"
        elif fault == "full_disk" and moment == "ckpt_write":
            t_fault = wait_until(run, watch, lambda: watch.first("No space left"), deadline, 0.02)
            hit, hit_how = t_fault is not None, "rank 0 logged 'No space left on device'"
        else:
            # the targets are found once both ranks are up, so that the moment is not missed looking for them
            wait_until(run, watch, lambda: watch.has("process group up", 0) and watch.has("process group up", 1),
                       deadline, 0.005)
            target = wait_until(run, watch, lambda: (lambda w: w if len(w) == 2 else None)(run.workers()),
                                deadline, 0.01) or {}
            if fault == "full_disk":  # final_save: fill the disk as the last step is logged
                condition = lambda: watch.has(f"step {STEPS}/{STEPS} ")  # noqa: E731
            else:
                condition = moment_reached(moment, run, watch)
            interval = 0.001 if moment in ("ckpt_write", "final_save") else 0.002
            trigger = wait_until(run, watch, condition, deadline, interval) if target else None
            if trigger and moment == "eval" and not EVAL_LINE_LOGGED:
                time.sleep(0.02)  # past the checkpoint snapshot, into the evaluation
            if trigger:
                children = []
                if fault == "kill9_agent":
                    children = psutil.Process(run.procs[target[1][1]].pid).children(recursive=True)
                if isinstance(trigger, Path):
                    notes.append(f"fault at {trigger.name}")
                if deliver(fault, run, target, notes):
                    t_fault = time.monotonic()
                    hit, hit_how = moment_still_on(moment, run, watch, trigger)
                    if fault == "kill9_agent":
                        orphans = children
            if t_fault is None:
                hit_how = "the run ended before the moment came" if not trigger else "the target was gone"
        # 2. what follows: torchrun's restarts, the scheduler's relaunches, waiting for the end
        relaunched: set[int] = set()
        preempt_relaunched = False
        while True:
            watch.poll()
            now = time.monotonic()
            if fault == "kill9_agent" and t_fault is not None and now - t_fault >= SCHEDULER_DELAY_S:
                if orphans and "orphans" not in res:
                    alive = [p for p in orphans if running(p)]
                    res["orphans"] = len(alive)
                    if alive:
                        notes.append(f"{len(alive)} orphaned worker(s) alive {SCHEDULER_DELAY_S:.0f} s after the "
                                     "agent kill")
                # The scheduler relaunches the whole job once every process of it has ended (as a
                # cgroup-based scheduler would), unless the run had finished.
                if run.done() and not processes_matching(marker) and not relaunched:
                    relaunched.add(-1)
                    if not completed(read_summary(run_dir)):
                        res["first_run"] = f"job ended, exit {run.last_codes()}: {explain(run)[1]}"
                        run.start_all()
                        continue
            if fault == "kill9_agent" and t_fault is not None and not relaunched:
                pass  # the job has not ended yet
            elif run.done():
                if (spec.relaunch_if_preempted and not preempt_relaunched and not completed(read_summary(run_dir))
                        and (run_dir / "ck" / "PREEMPTED").exists()):
                    preempt_relaunched = True
                    res["first_run"] = f"clean stop, exit {run.last_codes()}: {explain(run)[1]}"
                    run.start_all()
                    continue
                break
            if now > deadline:
                raise CellTimeout
            time.sleep(0.02)
    except CellTimeout:
        timed_out = True
        res["alive_at_timeout"] = len(processes_matching(marker))
        res["last_log_line"] = watch.lines[-1][2] if watch.lines else ""
        run.kill_everything()
    finally:
        end = time.monotonic()
        if not timed_out:
            time.sleep(1.0)  # give exiting processes a moment before counting what is left behind
            left = processes_matching(marker)
            res["leftovers"] = len(left)
            res["leftover_cmds"] = [f"pid {p.pid}: " + " ".join(os.path.basename(a) for a in p.info["cmdline"][:4])
                                    for p in left]
            run.kill_everything()
        watch.poll()
        watch.close()
        explanation = explain(run)  # before the tmpfs (and the markers on it) goes away
        if mounted:
            unmount(run_dir / "ck")

    # 3. the verdict
    summary = read_summary(run_dir)
    res.update(exit_codes=run.exit_codes(), exits=run.exit_labels(), hit=hit, hit_how=hit_how,
               wall_s=round(end - start, 1), bit_exact_promised=spec.bit_exact)
    if timed_out:
        res.update(outcome="HANG", reason=f"still running after {timeout:.0f} s; last log line: "
                                          f"{res['last_log_line'][-200:]}")
    elif completed(summary) and all(code == 0 or (fault == "kill9_agent" and code == -9)
                                    for code in run.last_codes()):
        # After an agent kill, that agent's own exit is the kill: the run completed all the same.
        res.update(outcome="survived", reason="")
    else:
        kind, reason = explanation
        res.update(outcome="clean stop" if kind else "FAILED", reason=reason)
    res["bit_exact"] = (summary["model_sha256"] == ref["model_sha256"]) if completed(summary) else None
    res["steps"] = (summary or {}).get("steps")
    if res["outcome"] == "survived":
        got, torn = committed_samples(run_dir)
        res["samples_missing"], res["samples_repeated"] = sample_diff(got, ref["samples"])
        if torn:
            notes.append(f"{torn} torn line(s) in samples_rank_N.jsonl")
        resumed = watch.first("resumed from step", 0, after=t_fault) if t_fault is not None else None
        res["recover_s"] = round((resumed if resumed is not None else end) - t_fault, 1) if t_fault else None
        res["recover_to"] = "resume" if resumed is not None else "end"
    res["restarts"] = sum(1 for _, r, line in watch.lines if r == 0 and "process group up" in line)
    res["resumed_from"] = [int(m.group(1)) for _, r, line in watch.lines
                           if r == 0 and (m := re.search(r"resumed from step (\d+)", line))]
    res["unusable"] = sorted({m.group(1) for _, r, line in watch.lines
                              if (m := re.search(r"checkpoint \S*/(step_\d+\.pt) is unusable", line))})
    res["notes"] = notes
    res["reason"] = res["reason"].replace(str(run_dir), "<cell>")
    return res


# --- references -------------------------------------------------------------------------------
def reference(topology: str, workdir: Path, timeout: float) -> dict:
    run_dir = workdir / f"reference-{topology}"
    run, watch = Run(topology, run_dir, {}), LogWatch(run_dir)
    start = time.monotonic()
    run.start_all()
    while not run.done():
        if time.monotonic() - start > timeout:
            run.kill_everything()
            raise SystemExit(f"the {topology} reference run did not finish in {timeout:.0f} s; see {run_dir}")
        watch.poll()
        time.sleep(0.002)
    watch.poll()
    watch.close()
    summary = read_summary(run_dir)
    if not completed(summary) or run.last_codes() != [0] * len(run.procs):
        raise SystemExit(f"the {topology} reference run failed ({run.exit_codes()}); see {run_dir}:\n"
                         f"{run.stderr()[-3000:]}")
    kill_matching(f"{run_dir}/")
    samples, _ = committed_samples(run_dir)
    sizes = [p.stat().st_size for p in (run_dir / "ck").glob("step_*.pt")]
    # how long the moments last, as seen from here (the window a fault has to land in)
    step_seen = [watch.first(f"step {k}/{STEPS} ") for k in range(1, STEPS + 1)]
    gaps = sorted(b - a for a, b in zip(step_seen, step_seen[1:], strict=False) if a and b)
    evals = [watch.first(f"step {k} | val_loss") - step_seen[k - 1] for k in range(EVAL_EVERY, STEPS, EVAL_EVERY)]
    writes = [float(m.group(1)) for _, _rank, line in watch.lines
              if (m := re.search(r"written: .* write ([\d.]+) s", line))]
    return {"dir": str(run_dir), "model_sha256": summary["model_sha256"], "samples": samples,
            "wall_s": round(time.monotonic() - start, 1), "checkpoint_bytes": max(sizes),
            "final_model_bytes": (run_dir / "ck" / "final_model.pt").stat().st_size,
            "median_step_ms": round(1e3 * gaps[len(gaps) // 2]) if gaps else None,
            "eval_ms": [round(1e3 * e) for e in evals], "checkpoint_write_ms": [round(1e3 * w) for w in writes]}


# --- the report -------------------------------------------------------------------------------
COLUMNS = ["#", "topology", "fault", "moment", "outcome", "exit codes", "bit-exact", "lost/repeated",
           "recover s", "left", "hit", "reason / notes"]


def row(cell: Cell) -> list[str]:
    r = cell.result
    if r.get("outcome") == "skipped":
        return [str(cell.index), cell.topology, cell.fault, cell.moment, "skipped", "", "", "", "", "", "",
                r["reason"]]
    exact = {True: "yes", False: "NO", None: "-"}[r["bit_exact"]]
    if not r["bit_exact_promised"] and r["bit_exact"] is not None:
        exact = f"({exact.lower()})"
    samples = f"{r['samples_missing']}/{r['samples_repeated']}" if "samples_missing" in r else "-"
    recover = "-"
    if r.get("recover_s") is not None:
        recover = f"{r['recover_s']}{'' if r.get('recover_to') == 'resume' else ' (end)'}"
    left = str(r["leftovers"]) if "leftovers" in r else "killed"
    details = [r["reason"]] if r["reason"] else []
    if r.get("first_run"):
        details.append(f"first run: {r['first_run']}")
    if r.get("restarts", 1) > 1:
        details.append(f"{r['restarts']} restarts")
    if r.get("resumed_from"):
        details.append(f"resumed from {', '.join(map(str, r['resumed_from']))}")
    if r.get("unusable"):
        details.append(f"skipped {', '.join(r['unusable'])}")
    details += r["notes"]
    if r.get("leftover_cmds"):
        details.append("left behind: " + "; ".join(r["leftover_cmds"][:4]))
    if not r["hit"]:
        details.append(f"moment missed: {r['hit_how']}")
    codes = " ".join(r["exits"])
    return [str(cell.index), cell.topology, cell.fault, cell.moment, r["outcome"], codes, exact, samples, recover,
            left, "yes" if r["hit"] else "no", "; ".join(details)]


def totals(cells: list[Cell]) -> dict:
    ran = [c.result for c in cells if c.result.get("outcome") != "skipped"]
    promised = [r for r in ran if r["bit_exact_promised"] and r["bit_exact"] is not None]
    return {"cells": len(ran),
            **{k: sum(r["outcome"] == k for r in ran) for k in ("survived", "clean stop", "HANG", "FAILED")},
            "skipped": len(cells) - len(ran),
            "bit_exact": f"{sum(bool(r['bit_exact']) for r in promised)}/{len(promised)}",
            "samples_lost": sum(r.get("samples_missing", 0) for r in ran),
            "samples_repeated": sum(r.get("samples_repeated", 0) for r in ran),
            "left_behind": sum(r.get("leftovers", 0) for r in ran),
            "moment_missed": sum(not r["hit"] for r in ran)}


def print_table(cells: list[Cell]) -> None:
    rows = [COLUMNS] + [row(c) for c in cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[-1])


def markdown(cells: list[Cell], t: dict, refs: dict, skipped_combos: list) -> str:
    lines = [f"**Fault campaign** (`python bench/fault_campaign.py`; {STEPS} steps, 2 ranks, save every "
             f"{SAVE_EVERY} steps, evaluate every {EVAL_EVERY}, `--max-restarts {MAX_RESTARTS}`, "
             f"record_samples on; bit-exact against an uninterrupted run of the same topology):", "",
             "| " + " | ".join(COLUMNS[1:]) + " |", "|" + " --- |" * (len(COLUMNS) - 1)]
    for c in cells:
        lines.append("| " + " | ".join(v.replace("|", "\\|") for v in row(c)[1:]) + " |")
    lines += ["", f"{t['cells']} cells: {t['survived']} survived, {t['clean stop']} clean stops, {t['HANG']} hangs, "
              f"{t['FAILED']} failed; bit-exact {t['bit_exact']} where promised; samples lost "
              f"{t['samples_lost']}, repeated {t['samples_repeated']}; processes left behind {t['left_behind']}; "
              f"moments missed {t['moment_missed']}. Exit codes are each launch's in order; (yes)/(no): "
              f"bit-exactness not promised for that fault; recover s: fault to 'resumed from step' "
              f"((end): to the end of the run).", "",
              "Not run (fault x moment combinations that do not apply):", ""]
    lines += [f"- {f} @ {m}: {why}" for f, m, why in skipped_combos] or ["- (none in this selection)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=["1x2", "2x1", "all"], default="all")
    parser.add_argument("--faults", default="", help=f"comma-separated subset of: {', '.join(FAULTS)}")
    parser.add_argument("--moments", default="", help=f"comma-separated subset of: {', '.join(MOMENTS)}")
    parser.add_argument("--quick", action="store_true", help="only: " + ", ".join(f"{f}@{m}" for f, m in QUICK))
    parser.add_argument("--cell-timeout", type=float, default=180.0, help="seconds before a cell is a HANG")
    parser.add_argument("--keep", action="store_true", help="keep the run directories of surviving cells too")
    parser.add_argument("--list", action="store_true", help="print the cells that would run, and exit")
    args = parser.parse_args()

    faults = [f for f in args.faults.split(",") if f] or list(FAULTS)
    moments = [m for m in args.moments.split(",") if m] or list(MOMENTS)
    for name, known in (*((f, FAULTS) for f in faults), *((m, MOMENTS) for m in moments)):
        if name not in known:
            parser.error(f"unknown {'fault' if known is FAULTS else 'moment'} {name!r}; known: {', '.join(known)}")
    topologies = ["1x2", "2x1"] if args.topology == "all" else [args.topology]
    cells, skipped_combos = [], []
    for topology in topologies:
        for fault in faults:
            for moment in moments:
                if (fault, moment) in SKIPPED:
                    if topology == topologies[0]:
                        skipped_combos.append((fault, moment, SKIPPED[(fault, moment)]))
                elif topology not in FAULTS[fault].topologies:
                    if moment == moments[0]:
                        skipped_combos.append((fault, f"every moment on {topology}",
                                               "launch_training.sh starts one node"))
                elif not args.quick or (fault, moment) in QUICK:
                    cells.append(Cell(topology, fault, moment, index=len(cells) + 1))

    print(f"fault campaign: {len(cells)} cells on {', '.join(TOPOLOGIES[t] for t in topologies)}; "
          f"{len(skipped_combos)} combinations not applicable")
    if not EVAL_LINE_LOGGED:
        print(f"note: the trainer does not log 'evaluating at step N' yet; the eval moment is 20 ms after "
              f"'step {EVAL_STEP}/{STEPS}'")
    if args.list:
        for c in cells:
            how = INJECTED.get((c.fault, c.moment), MOMENTS[c.moment])
            print(f"  {c.index:3d}  {c.name:42s} {how}")
        for f, m, why in skipped_combos:
            print(f"  skip {f} @ {m}: {why}")
        return
    workdir = Path(tempfile.mkdtemp(prefix="fault_campaign-"))
    print(f"run directories under {workdir}")
    campaign_start = time.monotonic()
    refs = {}
    for topology in sorted({c.topology for c in cells}):
        refs[topology] = reference(topology, workdir, max(args.cell_timeout, 300.0))
        ref = refs[topology]
        print(f"reference {topology}: {ref['wall_s']} s, model_sha256 {ref['model_sha256'][:16]}, checkpoint "
              f"{ref['checkpoint_bytes'] / 2**20:.2f} MiB; a step takes {ref['median_step_ms']} ms, the evaluations "
              f"{ref['eval_ms']} ms (step line to val_loss line), the checkpoint writes "
              f"{ref['checkpoint_write_ms']} ms")

    for cell in cells:
        print(f"[{cell.index}/{len(cells)}] {cell.name} ...", flush=True)
        for attempt in (1, 2):
            cell.result = run_cell(cell, refs[cell.topology], workdir, args.cell_timeout)
            cell.result["attempt"] = attempt
            if cell.result.get("outcome") == "skipped" or cell.result["hit"]:
                break
            print(f"    moment missed ({cell.result['hit_how']}); once more", flush=True)
        r = cell.result
        if r.get("outcome") != "skipped" and r["outcome"] == "survived" and r["hit"] and not args.keep:
            shutil.rmtree(r["dir"], ignore_errors=True)
        print("    " + " | ".join(f"{k} {v}" for k, v in zip(COLUMNS[4:], row(cell)[4:], strict=True) if v), flush=True)

        write_results(args, cells, refs, skipped_combos, topologies, workdir, final=False)

    t = totals(cells)
    print()
    print_table(cells)
    print(f"\ntotals: {json.dumps(t)}  ({time.monotonic() - campaign_start:.0f} s)")
    write_results(args, cells, refs, skipped_combos, topologies, workdir, final=True)
    if not args.keep:
        for ref in refs.values():
            shutil.rmtree(ref["dir"], ignore_errors=True)
    if any(workdir.iterdir()):
        print(f"run directories (logs, agent outputs) kept under {workdir}")
    else:
        workdir.rmdir()


def write_results(args, cells, refs, skipped_combos, topologies, workdir, *, final: bool) -> None:
    """The JSON and the markdown table, rewritten after every cell (an interrupted campaign keeps
    what it measured)."""
    cells = [c for c in cells if c.result]
    t = totals(cells)
    out_dir = ROOT / "bench" / "results"
    result = {"config": CONFIG, "max_restarts": MAX_RESTARTS, "moments": MOMENTS,
              "faults": {k: v.what for k, v in FAULTS.items()},
              "eval_line_logged": EVAL_LINE_LOGGED, "topologies": topologies, "quick": args.quick,
              "references": {k: {kk: vv for kk, vv in v.items() if kk != "samples"} for k, v in refs.items()},
              "cells": [{"topology": c.topology, "fault": c.fault, "moment": c.moment, **c.result} for c in cells],
              "not_applicable": [{"fault": f, "moment": m, "reason": why} for f, m, why in skipped_combos],
              "totals": t, "workdir": str(workdir)}
    (out_dir / "fault_campaign.json").write_text(json.dumps(result, indent=2))
    (out_dir / "fault_campaign.md").write_text(markdown(cells, t, refs, skipped_combos))
    if final:
        print(f"wrote {out_dir / 'fault_campaign.json'} and {out_dir / 'fault_campaign.md'}")


if __name__ == "__main__":
    main()
