"""Metrics sinks on rank 0: TensorBoard scalars and a tqdm progress bar."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from ..config import as_dict, non_default
from ..resilience.memory import in_use_gb, memory_stats
from ..state import atomic
from ..train.events import Listener
from .logs import DETAIL

log = logging.getLogger(__name__)


def _open_appending(path: Path) -> tuple:
    """``(file, earlier)``: ``path`` opened to append line-buffered, and whether it held lines
    already; a last line torn by a kill is ended first, so that it stays a line of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = path.is_file() and path.stat().st_size > 0
    file = open(path, "a+", buffering=1)
    if earlier:
        file.seek(file.seek(0, 2) - 1)
        torn = file.read(1) != "\n"
        file.seek(0, 2)
        if torn:
            file.write("\n")
    return file, earlier


def _json_lines(path: str | Path):
    for line in Path(path).read_text().splitlines():
        try:
            yield json.loads(line)
        except ValueError:  # the last line of a process killed while writing it: never complete
            log.warning("%s: skipping a torn line: %.80s", path, line)


class JsonlStream:
    """log_dir/metrics.jsonl: one JSON line per logged step holding every scalar that goes to
    TensorBoard, appended and line-buffered (a process killed with -9 keeps what it wrote). A
    resumed or restarted run, or any run on a used log_dir, first appends ``{"purge_from": K}``:
    as TensorBoard's purge_step does, a reader drops the earlier lines of step >= K (written
    after the checkpoint the run resumed from, or by an earlier run), and the steps then increase."""

    def __init__(self, path: Path, initial_step: int):
        self.file, self.earlier = _open_appending(path)
        self.step: int | None = None
        self.values: dict[str, float] = {}
        if initial_step or self.earlier:
            self.purge_from(initial_step + 1)

    def purge_from(self, step: int) -> None:
        self.flush()
        self.step = None
        self.file.write(json.dumps({"purge_from": step}) + "\n")

    def add(self, step: int, values: dict[str, float]) -> None:
        if step != self.step:
            self.flush()
            self.step = step
        self.values.update(values)

    def flush(self) -> None:
        if self.step is not None and self.values:
            self.file.write(json.dumps({"step": self.step, **self.values}) + "\n")
        self.values = {}

    def close(self) -> None:
        self.flush()
        self.file.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The lines of a metrics.jsonl with purges applied: one dict per step, steps increasing."""
    rows: list[dict] = []
    for record in _json_lines(path):
        if "purge_from" in record:
            rows = [r for r in rows if r["step"] < record["purge_from"]]
        elif rows and rows[-1]["step"] == record["step"]:
            rows[-1].update(record)
        else:
            rows.append(record)
    return rows


class Metrics:
    """Writes scalars to TensorBoard and log_dir/metrics.jsonl and drives the progress bar, on
    rank 0 only."""

    def __init__(self, *, enabled: bool, log_dir: str | Path, tensorboard: bool, progress_bar: str,
                 total_steps: int, initial_step: int = 0):
        self.writer = None
        self.bar = None
        self.jsonl = None
        if not enabled:
            return
        self.jsonl = JsonlStream(Path(log_dir) / "metrics.jsonl", initial_step)
        self.tensorboard_dir = Path(log_dir) / "tensorboard" if tensorboard else None
        self._open_writer(purge_step=initial_step + 1 if initial_step or self.jsonl.earlier else None)
        show = progress_bar == "true" or (progress_bar == "auto" and sys.stderr.isatty())
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

    def _open_writer(self, purge_step: int | None) -> None:
        """A resumed (or rolled-back) run purges what was logged after its checkpoint."""
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.tensorboard_dir), purge_step=purge_step)

    def purge_from(self, step: int) -> None:
        if self.jsonl is not None:
            self.jsonl.purge_from(step)
        if self.writer is not None:
            self.writer.close()
            self._open_writer(purge_step=step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.jsonl is not None:
            self.jsonl.add(step, values)
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def end_step(self) -> None:
        """Write the step's row now: a rank killed after it finished a step must not take the row
        with it, as the next restart may resume after that step (a survivor checkpoint). A value added
        for the step later (its evaluation) goes in a line of its own, which readers merge."""
        if self.jsonl is not None:
            self.jsonl.flush()

    def progress(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepLog(Listener):
    """Per-step bookkeeping of a run: the latest losses, throughput, and the periodic log lines,
    TensorBoard scalars and memory readings."""

    def __init__(self, metrics: Metrics, *, cfg, device: torch.device, total_steps: int,
                 health: Callable[[], dict[str, float]] = dict):
        self.metrics = metrics
        self.health = health
        self.cfg, self.device, self.total_steps = cfg, device, total_steps
        self.first_loss: float | None = None
        self.loss: float | None = None
        self.val_loss: float | None = None
        self.tokens = 0
        self.start = self.window_start = time.perf_counter()
        self.window_tokens = 0

    @classmethod
    def open(cls, cfg, env, *, total_steps: int, initial_step: int,
             health: Callable[[], dict[str, float]] = dict) -> StepLog:
        """``health()``: the run-health scalars each logged step adds."""
        metrics = Metrics(enabled=env.is_main, log_dir=cfg.logging.dir, tensorboard=cfg.logging.tensorboard,
                          progress_bar=cfg.logging.progress_bar, total_steps=total_steps, initial_step=initial_step)
        steps = cls(metrics, cfg=cfg, device=env.device, total_steps=total_steps, health=health)
        steps.loss = steps.logged_loss()  # a resume that runs no step ends with its checkpoint's loss
        return steps

    def close(self) -> None:
        self.metrics.close()

    def step_end(self, result, model) -> None:
        self.record(result.step, result.epoch, result.loss, result.lr, result.grad_norm, result.tokens,
                    health=self.health())

    def record(self, step: int, epoch: int, loss: float, lr: float, grad_norm, tokens: int,
               health: dict[str, float] | None = None) -> None:
        """One committed step; ``health`` (the run-health scalars) joins the periodic scalars."""
        cfg = self.cfg
        self.loss = loss
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.tokens += tokens
        self.window_tokens += tokens
        self.metrics.progress(loss)
        log.debug("step %d: loss %.6f lr %.3e", step, loss, lr)
        if step % cfg.logging.interval == 0 or step == self.total_steps:
            now = time.perf_counter()
            tps = self.window_tokens / (now - self.window_start)
            norm = float(grad_norm)
            log.info("step %d/%d | epoch %d | loss %.4f | lr %.3e | grad_norm %.3f | %.0f tok/s",
                     step, self.total_steps, epoch, loss, lr, norm, tps)
            self.metrics.scalars(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                                        "train/tokens_per_sec": tps, **(health or {})})
            self.window_start, self.window_tokens = now, 0
        if step % cfg.memory.check_interval == 0:
            stats = memory_stats(self.device)
            log.info("memory: %s", ", ".join(f"{k} {v:.2f}" for k, v in stats.items()), extra=DETAIL)
            self.metrics.scalars(step, {f"memory/{k}": v for k, v in stats.items()})
            if in_use_gb(stats) > cfg.memory.max_gb:
                log.warning("memory in use %.2f GiB exceeds max_memory_gb=%g", in_use_gb(stats), cfg.memory.max_gb)
        self.metrics.end_step()

    def purge_from(self, step: int) -> None:
        """A rollback: the steps from ``step`` on are run again; drop what was logged for them."""
        self.metrics.purge_from(step)
        self.loss = self.logged_loss()  # not the discarded step's, should the run end here

    def logged_loss(self) -> float | None:
        """The last train/loss that metrics.jsonl keeps (rank 0; None on the other ranks)."""
        if self.metrics.jsonl is None:
            return None
        losses = [r["train/loss"] for r in read_metrics(self.metrics.jsonl.file.name) if "train/loss" in r]
        return losses[-1] if losses else None

    def record_val(self, step: int, val_loss: float | None) -> None:
        self.val_loss = val_loss
        if val_loss is not None:
            log.info("step %d | val_loss %.4f", step, val_loss)
            self.metrics.scalars(step, {"val/loss": val_loss})
            self.metrics.end_step()

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation) does not count as training time for tokens/s."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.start += spent
            self.window_start += spent

    def summary(self, *, step: int, epochs: float, world_size: int, model_sha256: str, preempted: bool,
                skipped_steps: int, restarts: int, **health) -> dict:
        return {"first_train_loss": self.first_loss, "final_train_loss": self.loss, "final_val_loss": self.val_loss,
                "steps": step, "epochs": epochs, "tokens_per_sec": self.tokens_per_sec(), "wall_s": self.wall_s(),
                "world_size": world_size, "model_sha256": model_sha256, "preempted": preempted,
                "skipped_steps": skipped_steps, "restarts": restarts, **health}

    def wall_s(self) -> float:
        return time.perf_counter() - self.start

    def tokens_per_sec(self) -> float:
        wall = self.wall_s()
        return self.tokens / wall if wall > 0 else 0.0


def seconds_since_process_start() -> float:
    """How long this process has run, to 10 ms: /proc's start time in clock ticks since boot
    against the uptime (psutil's create_time is whole seconds off: the boot time it adds is)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(stat[stat.rindex(")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux: the coarser clock
        import psutil
        return time.time() - psutil.Process().create_time()


class StartupClock(Listener):
    """Where a process's seconds go before its first step ends (a restart's cost, bench/goodput.py):
    the interpreter and imports (from the process's start), then each phase the trainer marks.
    Logged once, at the first step's end (on the event bus), on every rank."""

    def step_end(self, result, model) -> None:
        if not self.logged:
            self.mark("first step")
            self.log_once()

    def __init__(self) -> None:
        self.phases: dict[str, float] = {"interpreter and imports": seconds_since_process_start()}
        self._last = time.monotonic()
        self.logged = False

    def mark(self, phase: str) -> None:
        """The phase that has just ended."""
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def log_once(self) -> None:
        if self.logged:
            return
        self.logged = True
        log.info("start-up took %.2f s to the end of the first step: %s", sum(self.phases.values()),
                 ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items()))


class SampleLog(Listener):
    """The audit trail of record_samples: each committed step's sample indices on this rank, one
    JSON line per step, line-buffered so that a process killed with -9 keeps every line it wrote.
    A step written again (after a restart, a resume or a rollback), or the first step written to
    a used file, is preceded by ``{"purge_from": K}``, as in metrics.jsonl: ``read_samples``
    drops the earlier lines of step >= K.

    On the event bus: a step is recorded once its gradients are computed, before the ranks agree
    on it (optimizer_step's all-reduce). Once a peer has passed that agreement the step is
    committed (a survivor checkpoint holds it, a restart does not redo it), so this rank's record
    must exist even if this rank dies right after; a step that is not committed is redone, and its
    line dropped by the redo's ``purge_from``. Healing in place, a step of a generation that a
    newer one has replaced (``outdated()``: a process frozen in it that runs again after the others
    healed without it and redid the step) is not committed and not written: no redo would purge
    it. ``sampler``: the step's indices (``pending()``).
    ``world_size``: rank 0's, so that a redo (a rollback) purges the files of the ranks this run
    does not have too (``purge_absent_ranks``): after a shrink their records of the redone steps
    belong to no run."""

    def __init__(self, path: Path | None, sampler=None, *, world_size: int | None = None,
                 outdated: Callable[[], bool] | None = None):
        self.file, earlier = _open_appending(path) if path is not None else (None, False)
        self.last_step: float = math.inf if earlier else 0  # steps count from 1
        self.sampler = sampler
        self.path, self.world_size = path, world_size
        self.outdated = outdated

    def gradients(self, step: int, model) -> None:
        if self.file is not None and self.outdated is not None and self.outdated():
            log.warning("step %d is not recorded: this process's generation was replaced (it was frozen or cut off "
                        "while the others healed without it)", step + 1)
            return
        self.write(self.sampler.epoch, step + 1, self.sampler.pending())

    def write(self, epoch: int, step: int, indices: list[int]) -> None:
        if self.file is None:
            return
        if step <= self.last_step:
            self.file.write(json.dumps({"purge_from": step}) + "\n")
            if self.world_size is not None and self.last_step != math.inf:  # a redo within this run
                self.purge_absent_ranks(self.path.parent, self.world_size, step)
        self.last_step = step
        self.file.write(json.dumps({"epoch": epoch, "step": step, "indices": indices}) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    @staticmethod
    def purge_absent_ranks(log_dir: Path, world_size: int, from_step: int) -> None:
        """Rank 0, at the start of a run on ``world_size`` ranks: the files of ranks this run does
        not have (an earlier restart had more) get ``{"purge_from": from_step}``. Their lines of
        later steps were written by a restart that died before its next checkpoint, and no
        rank of this run would purge them; a rank that exists purges its own file at its first step."""
        for path in log_dir.glob("samples_rank_*.jsonl"):
            rank = path.stem.removeprefix("samples_rank_")
            if rank.isdigit() and int(rank) >= world_size:
                file, earlier = _open_appending(path)
                with file:
                    if earlier:
                        file.write(json.dumps({"purge_from": from_step}) + "\n")


def read_samples(path: str | Path) -> list[dict]:
    """The records of a samples_rank_N.jsonl with purges applied: ``{"epoch", "step", "indices"}``
    per committed step, steps increasing."""
    records: list[dict] = []
    for record in _json_lines(path):
        if "purge_from" in record:
            records = [r for r in records if r["step"] < record["purge_from"]]
        else:
            records.append(record)
    return records


CONSOLE_LINE = 240
"""A console line's budget for a list: what does not fit is named by count and kept in the JSON file."""


def changed_keys(changed: dict, budget: int = CONSOLE_LINE) -> str:
    """``key=value, ...`` of the keys that differ from the defaults, cut to ``budget`` characters
    with the number of keys left out."""
    items = [f"{k}={v!r}" for k, v in changed.items()]
    if not items:
        return "the defaults"
    if len(items[0]) > budget:  # one long value (a path, a fault plan): shown cut rather than not at all
        items[0] = items[0][:budget - 3] + "..."
    shown: list[str] = []
    for n, item in enumerate(items):
        rest = len(items) - n - 1
        if shown and len(", ".join([*shown, item])) + (len(f" and {rest} more") if rest else 0) > budget:
            break
        shown.append(item)
    left = len(items) - len(shown)
    return ", ".join(shown) + (f" and {left} more" if left else "")


def summary_line(summary: dict) -> str:
    """The final summary in words (the whole of it is in summary.json)."""
    shown = [("step {}", "steps", ""), ("epochs {}", "epochs", ".2f"), ("train loss {}", "final_train_loss", ".4f"),
             ("val loss {}", "final_val_loss", ".4f"), ("{} tok/s", "tokens_per_sec", ".0f"), ("{} s", "wall_s", ".1f"),
             ("world size {}", "world_size", ""), ("model_sha256 {:.12}", "model_sha256", "")]
    return ", ".join(text.format(format(summary[key], fmt) if fmt else summary[key])
                     for text, key, fmt in shown if summary.get(key) is not None)


def log_run_start(cfg, env, sampler, *, model: torch.nn.Module, amp: bool, total_steps: int,
                  num_workers: int, builtin_model: bool = True, builtin_data: bool = True) -> None:
    """The run's opening lines: versions and config, model, effective batch, each rank's share,
    schedule; rank 0 also saves the resolved config as log_dir/config.json. The config shown and
    saved holds the keys that apply to a run with or without the built-in model and data."""
    s = sampler
    applies = dict(builtin_model=builtin_model, builtin_data=builtin_data)
    log.info("framework %s, torch %s, config: %s", __version__, torch.__version__,
             json.dumps(as_dict(cfg, **applies), sort_keys=True), extra=DETAIL)
    if env.is_main:
        log.info("config: %s (saved as %s)", changed_keys(non_default(cfg, **applies)),
                 Path(cfg.logging.dir) / "config.json")
    log.info("model: %s, %.2fM parameters, amp=%s", type(model).__name__,
             sum(p.numel() for p in model.parameters()) / 1e6, f"on ({cfg.precision.dtype})" if amp else "off (fp32)")
    if s.uneven is not None:
        log.info("effective batch: %s = %d samples per step", s.describe(), s.global_batch)
    else:
        log.info("effective batch: %d per rank x %d ranks x %d accumulation = %d samples per step",
                 s.batch_size, env.world_size, s.accumulation, s.global_batch)
    if s.num_samples is None:
        log.info("rank %d reads its shard of a stream (length unknown), %d samples a step", env.rank,
                 s.batch_size * s.accumulation)
    else:
        log.info("rank %d share: %d steps/epoch x %d samples = %d of %d samples per epoch; %d loader workers",
                 env.rank, s.steps_per_epoch, s.rank_batch, s.steps_per_epoch * s.rank_batch, s.num_samples,
                 num_workers)
    log.info("schedule: %d steps (%d per epoch, train.num_epochs=%d, train.max_steps=%d)", total_steps,
             s.steps_per_epoch, cfg.train.num_epochs, cfg.train.max_steps)
    if env.is_main:
        atomic.write_bytes(Path(cfg.logging.dir) / "config.json",
                           json.dumps(as_dict(cfg, **applies), indent=2, sort_keys=True).encode())
